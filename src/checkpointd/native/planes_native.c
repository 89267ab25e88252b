/* Byte-plane kernels of checkpointd's "zstd-planes" codec, one pass each.
 *
 * The NumPy kernels in codecs/plane_kernels.py and codecs/huffman.py make several passes over a chunk
 * (widen, shift, OR, rotate, nibble unpack, escape fix-up), each a separate call that drops and retakes
 * the GIL. These do the same work in one pass over cache-sized blocks and are called through ctypes,
 * which releases the GIL for the whole call. The formats are those of docs/format.md: both sides must
 * produce and accept the same bytes (tests compare them).
 *
 * Planes format: each element (2, 4 or 8 bytes, little-endian) is rotated left by one bit, then byte j
 * of every element goes to plane j. Planes are written raw or Huffman-coded (below). A nibble plane
 * (read only: earlier releases wrote them) stores 4-bit codes (value - base, 15 for an escape): code k
 * in the high nibble of byte k for k < h = ceil(n / 2), code h + k in its low nibble; the escaped
 * values follow, in element order.
 *
 * Built by `pip install` as an optional extension of setup.py (-O3, no -march: a wheel may run on
 * other hosts) and loaded by native/planes.py with ctypes. Plain C99, no Python headers.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "planes_native.h"

#define CPD_ABI 7
#define BLOCK 4096 /* elements per block: a block's unpacked planes stay in L1/L2 */
#define SUB 256    /* escapes are looked for in sub-blocks that contain one (rare) */
#define MAX_ITEMSIZE 8

int cpd_abi(void) { return CPD_ABI; }

/* Whether any byte of p[0..n) equals v (a byte-wide OR reduction: vectorizes). */
static int any_equal(const uint8_t *p, int64_t n, uint8_t v) {
    uint8_t acc = 0;
    for (int64_t i = 0; i < n; i++) acc |= (uint8_t)(p[i] == v);
    return acc;
}

/* Nibble plane values of elements [start, stop) into dst; escapes put back from esc[*k...].
 * Returns 0, or -1 when more escape codes are found than n_esc (the caller checks the total). */
static int unpack_nibbles(const uint8_t *packed, int64_t count, uint8_t base, const uint8_t *esc,
                          int64_t n_esc, int64_t *k, int64_t start, int64_t stop, uint8_t *dst) {
    int64_t half = (count + 1) / 2;
    int64_t i = start;
    for (; i < stop && i < half; i++) dst[i - start] = (uint8_t)((packed[i] >> 4) + base);
    for (; i < stop; i++) dst[i - start] = (uint8_t)((packed[i - half] & 15) + base);
    if (n_esc == 0) return 0; /* as the NumPy decoder: codes 15 are only looked for when escapes exist */
    uint8_t marker = (uint8_t)(base + 15);
    int64_t n = stop - start;
    for (int64_t s = 0; s < n; s += SUB) {
        int64_t e = s + SUB < n ? s + SUB : n;
        if (!any_equal(dst + s, e - s, marker)) continue;
        for (int64_t j = s; j < e; j++) {
            if (dst[j] != marker) continue;
            if (*k >= n_esc) return -1;
            dst[j] = esc[(*k)++];
        }
    }
    return 0;
}

/* Decode planes into out (count elements of itemsize bytes), rotating back when rotated != 0.
 *
 * For plane j: mode[j] 0 = data[j] holds its count bytes; 1 = data[j] holds ceil(count / 2) bytes of
 * nibble codes, base[j] their base, esc[j] its n_esc[j] escaped values.
 * Returns 0; j + 1 when plane j's escape codes do not number n_esc[j]; -1 for a bad itemsize/mode. */
int64_t cpd_decode_planes(int32_t itemsize, int64_t count, const uint8_t *const *data, const int32_t *mode,
                          const int32_t *base, const uint8_t *const *esc, const int64_t *n_esc,
                          int32_t rotated, uint8_t *out) {
    if (itemsize != 2 && itemsize != 4 && itemsize != 8) return -1;
    static __thread uint8_t scratch[MAX_ITEMSIZE][BLOCK];
    int64_t taken[MAX_ITEMSIZE] = {0};
    const uint8_t *src[MAX_ITEMSIZE];
    for (int j = 0; j < itemsize; j++)
        if (mode[j] != 0 && mode[j] != 1) return -1;
    for (int64_t start = 0; start < count; start += BLOCK) {
        int64_t stop = start + BLOCK < count ? start + BLOCK : count, n = stop - start;
        for (int j = 0; j < itemsize; j++) {
            if (mode[j] == 0) {
                src[j] = data[j] + start;
            } else {
                if (unpack_nibbles(data[j], count, (uint8_t)base[j], esc[j], n_esc[j], &taken[j], start, stop,
                                   scratch[j]))
                    return j + 1;
                src[j] = scratch[j];
            }
        }
        uint8_t *o = out + start * itemsize;
        if (itemsize == 2) {
            const uint8_t *p0 = src[0], *p1 = src[1];
            for (int64_t i = 0; i < n; i++) {
                uint16_t r = (uint16_t)(p0[i] | (p1[i] << 8));
                if (rotated) r = (uint16_t)((r >> 1) | (r << 15));
                memcpy(o + 2 * i, &r, 2);
            }
        } else if (itemsize == 4) {
            const uint8_t *p0 = src[0], *p1 = src[1], *p2 = src[2], *p3 = src[3];
            for (int64_t i = 0; i < n; i++) {
                uint32_t r = (uint32_t)p0[i] | ((uint32_t)p1[i] << 8) | ((uint32_t)p2[i] << 16) | ((uint32_t)p3[i] << 24);
                if (rotated) r = (r >> 1) | (r << 31);
                memcpy(o + 4 * i, &r, 4);
            }
        } else {
            for (int64_t i = 0; i < n; i++) {
                uint64_t r = 0;
                for (int j = 0; j < 8; j++) r |= (uint64_t)src[j][i] << (8 * j);
                if (rotated) r = (r >> 1) | (r << 63);
                memcpy(o + 8 * i, &r, 8);
            }
        }
    }
    for (int j = 0; j < itemsize; j++)
        if (mode[j] == 1 && n_esc[j] && taken[j] != n_esc[j]) return j + 1;
    return 0;
}

/* Split count elements of in into planes[j] (byte j of each element rotated left by one bit). */
int64_t cpd_split_planes(int32_t itemsize, int64_t count, const uint8_t *in, uint8_t *const *planes) {
    if (itemsize == 2) {
        uint8_t *p0 = planes[0], *p1 = planes[1];
        for (int64_t i = 0; i < count; i++) {
            uint16_t x;
            memcpy(&x, in + 2 * i, 2);
            x = (uint16_t)((x << 1) | (x >> 15));
            p0[i] = (uint8_t)x;
            p1[i] = (uint8_t)(x >> 8);
        }
    } else if (itemsize == 4) {
        uint8_t *p0 = planes[0], *p1 = planes[1], *p2 = planes[2], *p3 = planes[3];
        for (int64_t i = 0; i < count; i++) {
            uint32_t x;
            memcpy(&x, in + 4 * i, 4);
            x = (x << 1) | (x >> 31);
            p0[i] = (uint8_t)x;
            p1[i] = (uint8_t)(x >> 8);
            p2[i] = (uint8_t)(x >> 16);
            p3[i] = (uint8_t)(x >> 24);
        }
    } else if (itemsize == 8) {
        for (int64_t i = 0; i < count; i++) {
            uint64_t x;
            memcpy(&x, in + 8 * i, 8);
            x = (x << 1) | (x >> 63);
            for (int j = 0; j < 8; j++) planes[j][i] = (uint8_t)(x >> (8 * j));
        }
    } else {
        return -1;
    }
    return 0;
}

/* ---- Huffman-coded planes (mode 3 of codecs/huffman.py) ----
 * A plane of n byte symbols is cut into blocks of B symbols; each block's codes follow the previous
 * block's in one bit stream, read least significant bit first (bit i is bit i % 8 of byte i / 8). A
 * code's first bit is its most significant (canonical codes, stored bit-reversed). ends[k] is the bit
 * where block k ends. Decoding goes through a table of 2^11 entries indexed by the next 11 bits:
 * entry = length << 8 | symbol, 0 for bit patterns that start no code. */


/* counts[v] += number of bytes equal to v in p[0..n) (counts: 256 int64, zeroed by the caller). Eight
 * tables, one per byte of a 64-bit load, so that runs of one value (the exponent planes are mostly a
 * few values) do not wait on one counter; 32-bit counts, summed every 2^30 bytes. */
void cpd_histogram(const uint8_t *p, int64_t n, int64_t *counts) {
    uint32_t c[8][256];
    for (int64_t s = 0; s < n; s += (int64_t)1 << 30) {
        int64_t e = n - s > ((int64_t)1 << 30) ? s + ((int64_t)1 << 30) : n, i = s;
        memset(c, 0, sizeof c);
        for (; i + 8 <= e; i += 8) {
            uint64_t w;
            memcpy(&w, p + i, 8);
            c[0][w & 255]++;
            c[1][(w >> 8) & 255]++;
            c[2][(w >> 16) & 255]++;
            c[3][(w >> 24) & 255]++;
            c[4][(w >> 32) & 255]++;
            c[5][(w >> 40) & 255]++;
            c[6][(w >> 48) & 255]++;
            c[7][w >> 56]++;
        }
        for (; i < e; i++) c[0][p[i]]++;
        for (int v = 0; v < 256; v++)
            for (int k = 0; k < 8; k++) counts[v] += c[k][v];
    }
}

/* Depths of the leaves of a Huffman tree over n weights (1 <= n <= 256) into depth[0..n): the tree that
 * merges the two lightest nodes first, ties going to the node made first (leaves by index, then merged
 * nodes in the order they were made), as codecs/huffman.py's heap of (weight, index) does. Two queues
 * give that order: merged weights never decrease, and leaves come before merged nodes of equal weight. */
static void tree_depths(const int64_t *weights, int32_t n, int64_t *depth) {
    int32_t order[256], parent[511];
    int64_t weight[511];
    for (int32_t i = 0; i < n; i++) { /* leaves by (weight, index): insertion sort, stable */
        int32_t j = i;
        while (j > 0 && weights[order[j - 1]] > weights[i]) { order[j] = order[j - 1]; j--; }
        order[j] = i;
        weight[i] = weights[i];
    }
    int32_t leaf = 0, made = n, taken = n; /* merged nodes: [taken, made) wait in the second queue */
    while ((n - leaf) + (made - taken) > 1) {
        int32_t pick[2];
        for (int k = 0; k < 2; k++) {
            if (leaf < n && (taken == made || weight[order[leaf]] <= weight[taken])) pick[k] = order[leaf++];
            else pick[k] = taken++;
        }
        weight[made] = weight[pick[0]] + weight[pick[1]];
        parent[pick[0]] = parent[pick[1]] = made;
        made++;
    }
    int64_t d[511];
    d[made - 1] = 0;
    for (int32_t node = made - 2; node >= 0; node--) d[node] = d[parent[node]] + 1;
    for (int32_t i = 0; i < n; i++) depth[i] = d[i];
}

/* The deepest leaf of the tree over weights[i] >> shift (at least 1), its depths in depth. */
static int64_t shifted_depths(const int64_t *weights, int32_t n, int shift, int64_t *depth) {
    int64_t w[256], deepest = 0;
    for (int32_t i = 0; i < n; i++) w[i] = (weights[i] >> shift) > 1 ? weights[i] >> shift : 1;
    tree_depths(w, n, depth);
    for (int32_t i = 0; i < n; i++) deepest = depth[i] > deepest ? depth[i] : deepest;
    return deepest;
}

/* codecs/huffman.py's code_lengths: Huffman code lengths of 256 byte counts (0 for absent bytes), at
 * most max_bits, the counts halved (each present byte kept at least 1) the fewest times that fit, found
 * by doubling then bisection. The same lengths as the Python code (tests compare them). */
void cpd_code_lengths(const int64_t *counts, int32_t max_bits, uint8_t *lengths) {
    int64_t weights[256], depth[256], fits[256];
    int32_t symbol[256], n = 0;
    memset(lengths, 0, 256);
    for (int32_t v = 0; v < 256; v++)
        if (counts[v] > 0) { symbol[n] = v; weights[n++] = counts[v]; }
    if (n == 0) return;
    if (n == 1) { lengths[symbol[0]] = 1; return; }
    if (shifted_depths(weights, n, 0, fits) > max_bits) {
        int low = 0, high = 1;
        for (;; low = high, high *= 2)
            if (shifted_depths(weights, n, high, fits) <= max_bits) break;
        while (high - low > 1) {
            int mid = (low + high) / 2;
            if (shifted_depths(weights, n, mid, depth) <= max_bits) {
                memcpy(fits, depth, sizeof(int64_t) * n);
                high = mid;
            } else {
                low = mid;
            }
        }
    }
    for (int32_t i = 0; i < n; i++) lengths[symbol[i]] = (uint8_t)fits[i];
}

/* Encode n symbols with codes[v] (bit-reversed, so the first bit to read is bit 0) of lens[v] bits
 * (1..HUFF_BITS; every symbol that occurs must have a code: the caller builds them from the plane's own
 * histogram). Block k ends at bit ends[k]. Returns the stream's bytes, or -1 if out (cap bytes) could be
 * too small. Five codes (at most 55 bits) are joined before they go into the 64-bit accumulator, which is
 * then stored whole (8 bytes, unaligned) and advanced by its complete bytes: no dependency on the bit
 * count inside the five. Codes and lengths sit in two tables of their own (nothing to unpack), and a
 * block's end is read off the output position. (Four codes a step from one packed table, with a check
 * per symbol, took 1.6x as long.) */
int64_t cpd_huffman_encode(const uint8_t *plane, int64_t n, const uint16_t *codes, const uint8_t *lens,
                           int64_t block, uint32_t *ends, uint8_t *out, int64_t cap) {
    uint64_t code[256];
    uint32_t len[256];
    for (int v = 0; v < 256; v++) {
        code[v] = codes[v];
        len[v] = lens[v];
    }
    if (cap < (n * HUFF_BITS + 7) / 8 + 16) return -1;
    uint64_t acc = 0;
    int have = 0;
    uint8_t *dst = out;
    for (int64_t s = 0, k = 0; s < n; s += block, k++) {
        int64_t e = s + block < n ? s + block : n, i = s;
        for (; i + 5 <= e; i += 5) {
            uint32_t a = plane[i], b = plane[i + 1], c = plane[i + 2], d = plane[i + 3], f = plane[i + 4];
            uint32_t to_b = len[a], to_c = to_b + len[b], to_d = to_c + len[c], to_f = to_d + len[d];
            uint64_t v = code[a] | code[b] << to_b | code[c] << to_c | code[d] << to_d | code[f] << to_f;
            acc |= v << have; /* have <= 7 here, v <= 55 bits */
            have += to_f + len[f];
            memcpy(dst, &acc, 8);
            dst += have >> 3;
            acc >>= have & ~7;
            have &= 7;
        }
        for (; i < e; i++) {
            acc |= code[plane[i]] << have;
            have += len[plane[i]];
            memcpy(dst, &acc, 8);
            dst += have >> 3;
            acc >>= have & ~7;
            have &= 7;
        }
        ends[k] = (uint32_t)((dst - out) * 8 + have);
    }
    if (have) *dst++ = (uint8_t)acc;
    return dst - out;
}

typedef struct {
    int64_t pos, stop, last, left;
    uint8_t *out;
    const uint16_t *table;
} huff_cursor;

/* Up to 5 symbols of one block from a single unaligned 8-byte load (57 bits >= 5 x 11): only while the
 * 8 bytes lie within the block's bytes. Returns 0, 1 for a bit pattern that starts no code, or 2 when
 * the fast path no longer applies. */
static inline int huff_fast5(const uint8_t *src, huff_cursor *c) {
    int64_t pos = c->pos;
    if (c->left < 5 || (pos >> 3) + 8 > c->last) return 2;
    uint64_t acc, syms = 0;
    memcpy(&acc, src + (pos >> 3), 8);
    acc >>= pos & 7;
    int used = 0, bad = 0;
    for (int j = 0; j < 5; j++) { /* symbols gathered in a register: a byte store could alias the cursor */
        uint16_t e = c->table[acc & ((1u << HUFF_BITS) - 1)];
        int len = e >> 8;
        bad |= !len;
        syms |= (uint64_t)(e & 255) << (8 * j);
        acc >>= len;
        used += len;
    }
    memcpy(c->out, &syms, 5);
    c->out += 5;
    c->left -= 5;
    c->pos = pos + used;
    return bad;
}

/* The rest of a block, a symbol at a time; bytes at or past the block's last read as zeros. Returns 0,
 * or 1 if the block's bits do not decode to exactly its symbols ending at its end. */
static int huff_finish(const uint8_t *src, huff_cursor *c) {
    for (; c->left > 0; c->left--) {
        if (c->pos > c->stop) return 1;
        uint64_t acc = 0;
        int64_t byte = c->pos >> 3;
        for (int j = 0; j < 3; j++) acc |= (uint64_t)(byte + j < c->last ? src[byte + j] : 0) << (8 * j);
        uint16_t e = c->table[(acc >> (c->pos & 7)) & ((1u << HUFF_BITS) - 1)];
        int len = e >> 8;
        if (!len) return 1;
        *c->out++ = (uint8_t)e;
        c->pos += len;
    }
    return c->pos != c->stop;
}

#define HUFF_LANES 4 /* blocks decoded together: independent dependency chains for the core to overlap */

/* Pair tables: for each 11-bit window, the first code's symbol and, when the second code also lies
 * wholly in the window, its symbol too: entry = count << 24 | bits << 16 | second << 8 | first, 0 for a
 * window that starts no code. Two symbols per lookup where codes are short (exponents: ~2.6 bits). */
static void huff_pairs(const uint16_t *table, uint32_t *pairs) {
    for (uint32_t w = 0; w < (1u << HUFF_BITS); w++) {
        uint16_t e1 = table[w];
        uint32_t l1 = e1 >> 8;
        if (!l1) {
            pairs[w] = 0;
            continue;
        }
        uint16_t e2 = table[(w >> l1) & ((1u << HUFF_BITS) - 1)];
        uint32_t l2 = e2 >> 8;
        if (l2 && l1 + l2 <= HUFF_BITS)
            pairs[w] = 2u << 24 | (l1 + l2) << 16 | (uint32_t)(e2 & 255) << 8 | (e1 & 255);
        else
            pairs[w] = 1u << 24 | l1 << 16 | (e1 & 255);
    }
}

/* Decode n blocks. blocks: per block four int64 (first bit and end bit in src, output offset in dst,
 * table index << 32 | symbols), made by the caller from checked plane headers; tables: 2^HUFF_BITS
 * entries per plane. The contract of the GPU kernel (codecs/huffman_device.py), on the CPU: every block
 * reads only its own bytes. Returns 0, k + 1 for a bad block k (one of four decoded together), or -1
 * when out of memory. */
int64_t cpd_huffman_blocks(const uint8_t *src, uint8_t *dst, const int64_t *blocks, int64_t n,
                           const uint16_t *tables) {
    int64_t n_tables = 0;
    for (int64_t k = 0; k < n; k++) n_tables = (blocks[4 * k + 3] >> 32) + 1 > n_tables ? (blocks[4 * k + 3] >> 32) + 1 : n_tables;
    uint32_t *pairs = malloc((size_t)(n_tables ? n_tables : 1) << HUFF_BITS << 2);
    if (!pairs) return -1;
    for (int64_t t = 0; t < n_tables; t++) huff_pairs(tables + (t << HUFF_BITS), pairs + (t << HUFF_BITS));
    int64_t result = 0;
    for (int64_t k0 = 0; k0 < n && !result; k0 += HUFF_LANES) {
        int lanes = n - k0 < HUFF_LANES ? (int)(n - k0) : HUFF_LANES;
        huff_cursor c[HUFF_LANES];
        for (int j = 0; j < lanes; j++) {
            const int64_t *b = blocks + 4 * (k0 + j);
            c[j].pos = b[0];
            c[j].stop = b[1];
            c[j].last = (b[1] + 7) >> 3;
            c[j].out = dst + b[2];
            c[j].left = b[3] & 0xffffffff;
            c[j].table = tables + ((b[3] >> 32) << HUFF_BITS);
            if (b[0] > b[1]) result = k0 + j + 1;
        }
        if (result) break;
        if (lanes == HUFF_LANES) { /* all four in registers while each has 8 symbols and 8 bytes left */
            int64_t p[HUFF_LANES], lim[HUFF_LANES], left[HUFF_LANES];
            uint8_t *o[HUFF_LANES];
            const uint32_t *t[HUFF_LANES];
            for (int j = 0; j < HUFF_LANES; j++) {
                p[j] = c[j].pos;
                lim[j] = (c[j].last - 8) * 8; /* pos below this: 8 bytes at pos / 8 are the block's */
                o[j] = c[j].out;
                left[j] = c[j].left;
                t[j] = pairs + (c[j].table - tables);
            }
            int bad = 0;
            while (left[0] >= 8 && left[1] >= 8 && left[2] >= 8 && left[3] >= 8 && p[0] < lim[0] && p[1] < lim[1] &&
                   p[2] < lim[2] && p[3] < lim[3]) {
                uint64_t acc[HUFF_LANES], syms[HUFF_LANES] = {0, 0, 0, 0};
                int used[HUFF_LANES] = {0, 0, 0, 0}, got[HUFF_LANES] = {0, 0, 0, 0};
                for (int j = 0; j < HUFF_LANES; j++) {
                    memcpy(&acc[j], src + (p[j] >> 3), 8);
                    acc[j] >>= p[j] & 7;
                }
                for (int s = 0; s < 4; s++) { /* 4 lookups (44 of the 57 bits), 4 to 8 symbols a lane */
                    for (int j = 0; j < HUFF_LANES; j++) {
                        uint32_t e = t[j][acc[j] & ((1u << HUFF_BITS) - 1)];
                        int len = (e >> 16) & 255;
                        bad |= !e;
                        syms[j] |= (uint64_t)(e & 0xffff) << (8 * got[j]);
                        got[j] += e >> 24;
                        acc[j] >>= len;
                        used[j] += len;
                    }
                }
                for (int j = 0; j < HUFF_LANES; j++) {
                    memcpy(o[j], &syms[j], 8); /* within the block (8 left): later symbols overwrite the rest */
                    o[j] += got[j];
                    left[j] -= got[j];
                    p[j] += used[j];
                }
                if (bad) break;
            }
            for (int j = 0; j < HUFF_LANES; j++) {
                c[j].left = left[j];
                c[j].pos = p[j];
                c[j].out = o[j];
            }
            if (bad) {
                result = k0 + 1;
                break;
            }
        }
        for (int j = 0; j < lanes && !result; j++) {
            while (1) {
                int r = huff_fast5(src, &c[j]);
                if (r == 1) result = k0 + j + 1;
                if (r) break;
            }
            if (!result && huff_finish(src, &c[j])) result = k0 + j + 1;
        }
    }
    free(pairs);
    return result;
}
