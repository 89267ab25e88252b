#include <stdint.h>
#include <string.h>
#include <emmintrin.h>
/* copy n bytes with non-temporal stores to dst (bypassing the cache); regular loads from src */
void cpd_copy_nt(uint8_t *dst, const uint8_t *src, int64_t n) {
    int64_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head); dst += head; src += head; n -= head;
    int64_t blocks = n / 64;
    for (int64_t i = 0; i < blocks; i++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + 0));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)(dst + 0), a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        src += 64; dst += 64;
    }
    n -= blocks * 64;
    memcpy(dst, src, n);
    _mm_sfence();
}
