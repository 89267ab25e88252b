/* Byte-plane kernels of checkpointd's "zstd-planes" codec, one pass each.
 *
 * The NumPy kernels in codecs/planes.py make several passes over a chunk (widen, shift, OR,
 * rotate, nibble unpack, escape fix-up), each a separate call that drops and retakes the GIL. These
 * do the same work in one pass over cache-sized blocks and are called through ctypes, which releases
 * the GIL for the whole call. The formats are exactly those of codecs/planes.py: both sides must
 * produce and accept the same bytes (tests compare them).
 *
 * Planes format: each element (2, 4 or 8 bytes, little-endian) is rotated left by one bit, then byte j
 * of every element goes to plane j. A nibble plane stores 4-bit codes (value - base, 15 for an escape):
 * code k in the high nibble of byte k for k < h = ceil(n / 2), code h + k in its low nibble; the
 * escaped values follow, in element order.
 *
 * Built by `pip install` as an optional extension of setup.py (-O3, no -march: a wheel may run on
 * other hosts) and loaded by native/planes.py with ctypes. Plain C99, no Python headers.
 */
#include <stdint.h>
#include <string.h>

#define CPD_ABI 1
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

/* Whether any byte of p[0..n) lies outside base .. base + 14. */
static int any_escape(const uint8_t *p, int64_t n, uint8_t base) {
    uint8_t acc = 0;
    for (int64_t i = 0; i < n; i++) acc |= (uint8_t)((uint8_t)(p[i] - base) >= 15);
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

/* Nibble-pack a plane of count values: packed gets ceil(count / 2) code bytes, then the escaped values
 * (those outside base .. base + 14) in element order. Returns the escape count, or -1 once it would
 * exceed max_escapes (packed must hold ceil(count / 2) + max_escapes bytes). */
int64_t cpd_pack_nibbles(const uint8_t *plane, int64_t count, int32_t base, uint8_t *packed, int64_t max_escapes) {
    int64_t half = (count + 1) / 2, n_esc = 0;
    uint8_t b = (uint8_t)base;
    for (int64_t k = 0; k < count - half; k++) { /* every code byte with both nibbles */
        uint8_t hi = (uint8_t)(plane[k] - b), lo = (uint8_t)(plane[k + half] - b);
        hi = hi < 15 ? hi : 15;
        lo = lo < 15 ? lo : 15;
        packed[k] = (uint8_t)((hi << 4) | lo);
    }
    if (count & 1) { /* the last code byte has no low nibble */
        uint8_t hi = (uint8_t)(plane[half - 1] - b);
        packed[half - 1] = (uint8_t)((hi < 15 ? hi : 15) << 4);
    }
    uint8_t *esc = packed + half;
    for (int64_t s = 0; s < count; s += SUB) {
        int64_t e = s + SUB < count ? s + SUB : count;
        if (!any_escape(plane + s, e - s, b)) continue;
        for (int64_t i = s; i < e; i++) {
            if ((uint8_t)(plane[i] - b) < 15) continue;
            if (n_esc >= max_escapes) return -1;
            esc[n_esc++] = plane[i];
        }
    }
    return n_esc;
}
