/* The kernels of planes_native.c that planes_encode.c builds on. */
#ifndef CPD_PLANES_NATIVE_H
#define CPD_PLANES_NATIVE_H

#include <stdint.h>

#define HUFF_BITS 11

int64_t cpd_split_planes(int32_t itemsize, int64_t count, const uint8_t *in, uint8_t *const *planes);
void cpd_histogram(const uint8_t *p, int64_t n, int64_t *counts);
void cpd_code_lengths(const int64_t *counts, int32_t max_bits, uint8_t *lengths);
int64_t cpd_huffman_encode(const uint8_t *plane, int64_t n, const uint16_t *codes, const uint8_t *lens,
                           int64_t block, uint32_t *ends, uint8_t *out, int64_t cap);

#endif
