/* A planes chunk's payload in one call: what codecs/planes.py's encode_planes and codecs/huffman.py's
 * coder do with NumPy and several native calls, here without returning to Python between them.
 *
 * Why: chunks are encoded on a pool of threads in one Python process (the persist process's, or the
 * training process's for remote roots), and a thread that wants the GIL back waits for whichever
 * thread holds it. Coded from Python through the separate kernels, a chunk takes the GIL back about
 * ten times (sample entropies, code tables, headers between the calls): beside a busy Python thread,
 * a 16 MiB fp32 chunk that codes in 7 ms then takes about 55 ms, against about 27 in one call (a
 * 2-core host). docs/performance.md has the codec's speed.
 *
 * The bytes are the Python coder's (docs/format.md; tests compare them): planes split, each plane worth
 * coding Huffman-coded (mode 3) and kept only if smaller than its raw bytes, raw planes moved up behind
 * the stored ones. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "planes_native.h"

#define MODE_RAW 0
#define MODE_HUFFMAN 3
#define LENGTHS_NBYTES 128

/* Shannon entropy, in bits per byte, of each of the itemsize (2, 4 or 8) rotated byte planes of the
 * count elements at sample (split and counted a block at a time by the kernels of planes_native.c). */
void cpd_sample_entropy(int32_t itemsize, int64_t count, const uint8_t *sample, double *bits) {
    enum { STEP = 4096 };
    static __thread uint8_t block[8][STEP];
    uint8_t *planes[8];
    int64_t counts[8][256];
    memset(counts, 0, sizeof counts);
    for (int32_t j = 0; j < 8; j++) planes[j] = block[j];
    for (int64_t s = 0; s < count; s += STEP) {
        int64_t n = count - s < STEP ? count - s : STEP;
        if (cpd_split_planes(itemsize, n, sample + s * itemsize, planes) < 0) return;
        for (int32_t j = 0; j < itemsize; j++) cpd_histogram(block[j], n, counts[j]);
    }
    for (int32_t j = 0; j < itemsize; j++) {
        double total = (double)count, h = 0.0;
        for (int v = 0; v < 256; v++)
            if (counts[j][v]) {
                double f = counts[j][v] / total;
                h -= f * log2(f);
            }
        bits[j] = h;
    }
}

/* huffman.canonical_codes: each byte's code (by length, then byte value), bit-reversed so that the bit
 * read first is bit 0. */
static void canonical_codes(const uint8_t *lens, uint16_t *codes) {
    uint32_t next = 0; /* the next code, padded to HUFF_BITS bits, most significant bit first */
    memset(codes, 0, 256 * sizeof *codes);
    for (int len = 1; len <= HUFF_BITS; len++)
        for (int v = 0; v < 256; v++)
            if (lens[v] == len) {
                uint32_t rev = 0;
                for (int b = 0; b < HUFF_BITS; b++) rev |= ((next >> b) & 1u) << (HUFF_BITS - 1 - b);
                codes[v] = (uint16_t)rev;
                next += 1u << (HUFF_BITS - len);
            }
}

static void put_u32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16), p[3] = (uint8_t)(v >> 24);
}

/* One plane of n symbols coded into scratch as huffman.py stores it (header, code lengths, block ends,
 * stream): its size, or -1 if scratch is too small. */
static int64_t code_plane(const uint8_t *plane, int64_t n, int64_t block, uint8_t *scratch, int64_t cap) {
    int64_t counts[256] = {0}, blocks = (n + block - 1) / block;
    uint8_t lens[256];
    uint16_t codes[256];
    int64_t head = 8 + LENGTHS_NBYTES + 4 * blocks;
    if (cap < head) return -1;
    cpd_histogram(plane, n, counts);
    cpd_code_lengths(counts, HUFF_BITS, lens);
    canonical_codes(lens, codes);
    put_u32(scratch, (uint32_t)block);
    put_u32(scratch + 4, (uint32_t)blocks);
    for (int i = 0; i < LENGTHS_NBYTES; i++) scratch[8 + i] = (uint8_t)(lens[2 * i] | (lens[2 * i + 1] << 4));
    uint32_t *ends = (uint32_t *)(scratch + 8 + LENGTHS_NBYTES); /* little-endian hosts: written in place */
    int64_t stream = cpd_huffman_encode(plane, n, codes, lens, block, ends, scratch + head, cap - head);
    return stream < 0 ? -1 : head + stream;
}

/* The planes of count elements of in (itemsize bytes each) into out (count * itemsize bytes): plane j
 * is Huffman-coded where worth[j] and that is smaller than count bytes, else stored raw; the stored
 * planes follow each other from out[0]. modes[j] and stored[j] get each plane's mode and size. scratch
 * holds a coded plane: at least huffman.coded_bound(count) bytes.
 * Returns the planes' bytes, or -1 (a bad itemsize, too little scratch). */
int64_t cpd_encode_planes(int32_t itemsize, int64_t count, const uint8_t *in, const uint8_t *worth, int64_t block,
                          uint8_t *out, uint8_t *scratch, int64_t scratch_cap, uint8_t *modes, int64_t *stored) {
    uint8_t *planes[8];
    if ((itemsize != 2 && itemsize != 4 && itemsize != 8) || count < 0) return -1;
    for (int32_t j = 0; j < itemsize; j++) planes[j] = out + j * count;
    if (cpd_split_planes(itemsize, count, in, planes) < 0) return -1;
    int64_t at = 0;
    for (int32_t j = 0; j < itemsize; j++) {
        int64_t size = worth[j] && count ? code_plane(planes[j], count, block, scratch, scratch_cap) : count;
        if (size < 0) return -1;
        if (size < count) { /* over this plane's raw bytes or before them: later planes stay where they are */
            memcpy(out + at, scratch, size);
            modes[j] = MODE_HUFFMAN;
        } else {
            size = count;
            if (out + at != planes[j]) memmove(out + at, planes[j], count);
            modes[j] = MODE_RAW;
        }
        stored[j] = size;
        at += size;
    }
    return at;
}
