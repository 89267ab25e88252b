/* AVX2 versions of the plane split and merge of planes_native.c, for 2- and 4-byte elements: the same
 * bytes (tests compare them with the scalar and NumPy kernels), 32 elements a step.
 *
 * Why: built without -march (a wheel may run on other hosts), the scalar loops move a byte at a time.
 * On the H200 benchmark host (Xeon), splitting a 16 MiB fp32 chunk took 4.0 ms scalar and ~1.4 ms
 * with AVX2, a third of that chunk's encoding; docs/performance.md has the codec's speed.
 *
 * Each function handles the longest prefix of whole 32-element steps and returns its length; the
 * caller finishes the tail with the scalar loop. Compiled for AVX2 by a target attribute and called
 * only where the CPU has it (cpd_simd), so the library still loads and runs on any x86-64. Elsewhere
 * (other architectures, other compilers) the functions are stubs that handle nothing. */
#ifndef CPD_PLANES_SIMD_H
#define CPD_PLANES_SIMD_H

#include <stdint.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define CPD_AVX2 __attribute__((target("avx2")))

static int simd_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
}

/* Within each 128-bit lane: bytes 0, 4, 8, 12, then 1, 5, 9, 13, ... (byte j of 4 elements together);
 * the same mask undoes it. */
#define GROUP4 _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, \
                                0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)
/* Within each lane: the low bytes of 8 elements, then their high bytes; and back. */
#define GROUP2 _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, \
                                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)
#define UNGROUP2 _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, \
                                  0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15)

CPD_AVX2 static int64_t split4_avx2(int64_t count, const uint8_t *in, uint8_t *const *planes) {
    const __m256i group = GROUP4, pairs = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int64_t i = 0;
    for (; i + 32 <= count; i += 32) {
        __m256i r[4];
        for (int k = 0; k < 4; k++) { /* 8 rotated elements -> 64-bit words: byte j of each, for planes 0..3 */
            __m256i x = _mm256_loadu_si256((const __m256i *)(in + 4 * i + 32 * k));
            x = _mm256_or_si256(_mm256_slli_epi32(x, 1), _mm256_srli_epi32(x, 31));
            r[k] = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(x, group), pairs);
        }
        __m256i t0 = _mm256_unpacklo_epi64(r[0], r[1]), t1 = _mm256_unpackhi_epi64(r[0], r[1]);
        __m256i t2 = _mm256_unpacklo_epi64(r[2], r[3]), t3 = _mm256_unpackhi_epi64(r[2], r[3]);
        _mm256_storeu_si256((__m256i *)(planes[0] + i), _mm256_permute2x128_si256(t0, t2, 0x20));
        _mm256_storeu_si256((__m256i *)(planes[1] + i), _mm256_permute2x128_si256(t1, t3, 0x20));
        _mm256_storeu_si256((__m256i *)(planes[2] + i), _mm256_permute2x128_si256(t0, t2, 0x31));
        _mm256_storeu_si256((__m256i *)(planes[3] + i), _mm256_permute2x128_si256(t1, t3, 0x31));
    }
    return i;
}

CPD_AVX2 static int64_t merge4_avx2(int64_t count, const uint8_t *const *src, uint8_t *out) {
    const __m256i group = GROUP4, unpairs = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    int64_t i = 0;
    for (; i + 32 <= count; i += 32) {
        __m256i p0 = _mm256_loadu_si256((const __m256i *)(src[0] + i)), p1 = _mm256_loadu_si256((const __m256i *)(src[1] + i));
        __m256i p2 = _mm256_loadu_si256((const __m256i *)(src[2] + i)), p3 = _mm256_loadu_si256((const __m256i *)(src[3] + i));
        __m256i t0 = _mm256_permute2x128_si256(p0, p2, 0x20), t2 = _mm256_permute2x128_si256(p0, p2, 0x31);
        __m256i t1 = _mm256_permute2x128_si256(p1, p3, 0x20), t3 = _mm256_permute2x128_si256(p1, p3, 0x31);
        __m256i r[4] = {_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1),
                        _mm256_unpacklo_epi64(t2, t3), _mm256_unpackhi_epi64(t2, t3)};
        for (int k = 0; k < 4; k++) {
            __m256i x = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(r[k], unpairs), group);
            x = _mm256_or_si256(_mm256_srli_epi32(x, 1), _mm256_slli_epi32(x, 31));
            _mm256_storeu_si256((__m256i *)(out + 4 * i + 32 * k), x);
        }
    }
    return i;
}

CPD_AVX2 static int64_t split2_avx2(int64_t count, const uint8_t *in, uint8_t *const *planes) {
    const __m256i group = GROUP2;
    int64_t i = 0;
    for (; i + 32 <= count; i += 32) {
        __m256i r[2];
        for (int k = 0; k < 2; k++) { /* 16 rotated elements -> their 16 low bytes, then their 16 high bytes */
            __m256i x = _mm256_loadu_si256((const __m256i *)(in + 2 * i + 32 * k));
            x = _mm256_or_si256(_mm256_slli_epi16(x, 1), _mm256_srli_epi16(x, 15));
            r[k] = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(x, group), 0xD8);
        }
        _mm256_storeu_si256((__m256i *)(planes[0] + i), _mm256_permute2x128_si256(r[0], r[1], 0x20));
        _mm256_storeu_si256((__m256i *)(planes[1] + i), _mm256_permute2x128_si256(r[0], r[1], 0x31));
    }
    return i;
}

CPD_AVX2 static int64_t merge2_avx2(int64_t count, const uint8_t *const *src, uint8_t *out) {
    const __m256i ungroup = UNGROUP2;
    int64_t i = 0;
    for (; i + 32 <= count; i += 32) {
        __m256i p0 = _mm256_loadu_si256((const __m256i *)(src[0] + i)), p1 = _mm256_loadu_si256((const __m256i *)(src[1] + i));
        __m256i r[2] = {_mm256_permute2x128_si256(p0, p1, 0x20), _mm256_permute2x128_si256(p0, p1, 0x31)};
        for (int k = 0; k < 2; k++) {
            __m256i x = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(r[k], 0xD8), ungroup);
            x = _mm256_or_si256(_mm256_srli_epi16(x, 1), _mm256_slli_epi16(x, 15));
            _mm256_storeu_si256((__m256i *)(out + 2 * i + 32 * k), x);
        }
    }
    return i;
}

#else
static int simd_supported(void) { return 0; }
static int64_t split4_avx2(int64_t c, const uint8_t *in, uint8_t *const *p) { (void)c; (void)in; (void)p; return 0; }
static int64_t merge4_avx2(int64_t c, const uint8_t *const *s, uint8_t *o) { (void)c; (void)s; (void)o; return 0; }
static int64_t split2_avx2(int64_t c, const uint8_t *in, uint8_t *const *p) { (void)c; (void)in; (void)p; return 0; }
static int64_t merge2_avx2(int64_t c, const uint8_t *const *s, uint8_t *o) { (void)c; (void)s; (void)o; return 0; }
#endif

#endif
