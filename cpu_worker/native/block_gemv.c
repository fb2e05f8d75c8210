/* Block-quantized linear layers: weights in blocks of 32 along k, each block with its own scale, as
 * llama.cpp's Q8_0 (int8, scale d), Q4_0 (4 bits, q - 8, scale d) and Q4_1 (4 bits, q, scale d and
 * minimum m) hold them; activations quantized per block of 32 as well (int8, q = round(x / d_x),
 * d_x = max|x| / 127 over the block). y[m, n] = sum over blocks b of d_w[n, b] d_x[m, b] dot(w, x)
 * (+ m_w[n, b] d_x[m, b] sum(x_q) for Q4_1) (+ bias[n]).
 *
 * Why blocks: one scale across a whole weight row, or a whole token, is too coarse for a real model
 * (outlier channels): on SmolLM2-135M-Instruct per-row int8 keeps ~11 of 48 greedy tokens of fp32's,
 * Q8_0 x Q8_0 ~26 (python -m tools.bench_quality; docs/kernels.md).
 *
 * Row independence (what keeps verification lossless): a row's activations are quantized from that
 * row alone, each block's dot product is an exact integer T[m, n, b], and the float arithmetic that
 * follows is one fixed sequence per (row, output), whatever the row count, the row's place in the call
 * or the thread count: acc = 0; for each block b in order: acc = acc + float(T) * (d_w * d_x), and for
 * Q4_1 then acc = acc + (m_w * d_x) * float(S[m, b]) (S: the sum of the activation block's integers);
 * then the bias. Multiply, then add (built with -ffp-contract=off). Only whole-block integer sums
 * enter the float sequence, so any way of computing them (VNNI, AVX2's pair sums, plain C, AMX's
 * tile products) gives the same bits; SIMD paths run 8 outputs side by side, one per lane.
 *
 * Dot products: VNNI multiplies unsigned by signed bytes, so a signed weight block w and activation
 * block x go in as |w| and x * sign(w) (x in [-127, 127], which the quantizer guarantees); Q4_1's
 * weights are unsigned already. AVX2 without VNNI gets the same sums from maddubs (pairs; at most
 * 2 * 128 * 127 in magnitude, no saturation) and madd against ones.
 *
 * Layout: a weight row is k / 32 blocks of 32 bytes (Q8_0) or 16 bytes (Q4_0, Q4_1: element j in
 * the low nibble of byte j, element j + 16 in its high nibble), GGUF's order; the fp16 scales (and
 * Q4_1's minimums) are grouped by 8 outputs, [ceil(n_out / 8), k / 32, 8], so the 8 lanes' scales of
 * a block are one load (a last partial group is padded).
 */
#include "dovetail.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QBLOCK 32
#if defined(__AVX2__) && defined(__F16C__)
#define BLOCK_SIMD 1 /* 8 outputs side by side */
#else
#define BLOCK_SIMD 0
#endif

#define BLOCK_Q8_0 DOVETAIL_BLOCK_Q8_0
#define BLOCK_Q4_0 DOVETAIL_BLOCK_Q4_0
#define BLOCK_Q4_1 DOVETAIL_BLOCK_Q4_1

/* The SIMD path this build runs: 2 VNNI (AVX512-VNNI with VL, or AVX-VNNI), 1 AVX2, 0 plain C. */
int dovetail_block_simd(void) {
#if BLOCK_SIMD && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
    return 2;
#elif BLOCK_SIMD
    return 1;
#else
    return 0;
#endif
}

/* An fp16 scale as fp32, exactly (F16C's conversion is exact too, denormals included). */
static inline float half_to_float_exact(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {
        float value = (float)mantissa * 5.9604644775390625e-8f;
        memcpy(&bits, &value, sizeof bits);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

/* Activations: per block of 32, d = max|x| / 127 and q = nearbyint(x / d) in [-127, 127] (all zero
 * for a zero block); sums[b] = sum of the block's q (Q4_1's minimum term). k % 32 == 0. */
void dovetail_quantize_blocks(const float *x, int8_t *q, float *d, int32_t *sums, int64_t rows, int64_t k) {
    int64_t blocks = k / QBLOCK;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *in = x + m * k + b * QBLOCK;
            float amax = 0.0f;
            for (int j = 0; j < QBLOCK; j++) amax = fabsf(in[j]) > amax ? fabsf(in[j]) : amax;
            float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *out = q + m * k + b * QBLOCK;
            int32_t sum = 0;
            for (int j = 0; j < QBLOCK; j++) {
                float v = nearbyintf(in[j] * inverse);
                v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
                out[j] = (int8_t)v;
                sum += out[j];
            }
            d[m * blocks + b] = scale;
            sums[m * blocks + b] = sum;
        }
}

/* One block's 32 weights as signed integers (Q4_0: q - 8; Q4_1: q, 0..15). */
static inline void weight_block_values(const uint8_t *row, int type, int64_t b, int32_t out[QBLOCK]) {
    if (type == BLOCK_Q8_0) {
        const int8_t *q = (const int8_t *)row + b * QBLOCK;
        for (int j = 0; j < QBLOCK; j++) out[j] = q[j];
        return;
    }
    const uint8_t *packed = row + b * (QBLOCK / 2);
    int offset = type == BLOCK_Q4_0 ? 8 : 0;
    for (int j = 0; j < QBLOCK / 2; j++) {
        out[j] = (packed[j] & 0x0f) - offset;
        out[j + QBLOCK / 2] = (packed[j] >> 4) - offset;
    }
}

static inline int64_t row_bytes(int type, int64_t k) { return type == BLOCK_Q8_0 ? k : k / 2; }

/* The grouped fp16 value of output n at block b. */
static inline float grouped(const uint16_t *values, int64_t n, int64_t b, int64_t blocks) {
    return half_to_float_exact(values[((n >> 3) * blocks + b) * 8 + (n & 7)]);
}

/* One (row, output) by the reference sequence: the plain C path, and every SIMD path's tail. */
static float dot_one(const uint8_t *w, const uint16_t *scales, const uint16_t *minimums, int type, int64_t n,
                     const int8_t *xq, const float *xd, const int32_t *xs, int64_t blocks) {
    float acc = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        int32_t values[QBLOCK], total = 0;
        weight_block_values(w, type, b, values);
        for (int j = 0; j < QBLOCK; j++) total += values[j] * (int32_t)xq[b * QBLOCK + j];
        float scale = grouped(scales, n, b, blocks) * xd[b];
        float term = (float)total * scale;
        acc = acc + term;
        if (type == BLOCK_Q4_1) {
            float min_scale = grouped(minimums, n, b, blocks) * xd[b];
            float min_term = min_scale * (float)xs[b];
            acc = acc + min_term;
        }
    }
    return acc;
}

#if BLOCK_SIMD
static inline __m256i lane_dot(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i load_weight_block(const uint8_t *row, int type, int64_t b) {
    if (type == BLOCK_Q8_0) return _mm256_loadu_si256((const __m256i *)(row + b * QBLOCK));
    __m128i packed = _mm_loadu_si128((const __m128i *)(row + b * (QBLOCK / 2)));
    __m128i mask = _mm_set1_epi8(0x0f);
    __m256i bytes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), _mm_and_si128(packed, mask));
    return type == BLOCK_Q4_0 ? _mm256_sub_epi8(bytes, _mm256_set1_epi8(8)) : bytes;
}

/* Eight vectors of 8 int32 lanes -> one vector of their 8 totals (exact: integer sums). */
static inline __m256i lane_totals(const __m256i v[8]) {
    __m256i a01 = _mm256_hadd_epi32(v[0], v[1]), a23 = _mm256_hadd_epi32(v[2], v[3]);
    __m256i a45 = _mm256_hadd_epi32(v[4], v[5]), a67 = _mm256_hadd_epi32(v[6], v[7]);
    __m256i b0 = _mm256_hadd_epi32(a01, a23), b1 = _mm256_hadd_epi32(a45, a67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

/* Outputs [n, n + 8) for every row of the call: each weight block is loaded once for all rows;
 * acc holds the rows' running sums (8 lanes a row). */
static void dot_group(const uint8_t *w, int64_t stride, const uint16_t *scales, const uint16_t *minimums, int type,
                      const int8_t *xq, const float *xd, const int32_t *xs, int64_t rows, int64_t k, int64_t blocks,
                      float *acc) {
    for (int64_t m = 0; m < rows; m++) _mm256_storeu_ps(acc + 8 * m, _mm256_setzero_ps());
    for (int64_t b = 0; b < blocks; b++) {
        __m256i magnitude[8], weight[8];
        for (int j = 0; j < 8; j++) {
            weight[j] = load_weight_block(w + j * stride, type, b);
            magnitude[j] = type == BLOCK_Q4_1 ? weight[j] : _mm256_sign_epi8(weight[j], weight[j]);
        }
        __m256 weight_scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + b * 8)));
        __m256 weight_min = type == BLOCK_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(minimums + b * 8)))
                                               : _mm256_setzero_ps();
        for (int64_t m = 0; m < rows; m++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(xq + m * k + b * QBLOCK)), lanes[8];
            for (int j = 0; j < 8; j++)
                lanes[j] = lane_dot(magnitude[j], type == BLOCK_Q4_1 ? x : _mm256_sign_epi8(x, weight[j]));
            __m256 x_scale = _mm256_set1_ps(xd[m * blocks + b]);
            __m256 term = _mm256_mul_ps(_mm256_cvtepi32_ps(lane_totals(lanes)), _mm256_mul_ps(weight_scale, x_scale));
            __m256 sum = _mm256_add_ps(_mm256_loadu_ps(acc + 8 * m), term);
            if (type == BLOCK_Q4_1) {
                __m256 min_term = _mm256_mul_ps(_mm256_mul_ps(weight_min, x_scale),
                                                _mm256_set1_ps((float)xs[m * blocks + b]));
                sum = _mm256_add_ps(sum, min_term);
            }
            _mm256_storeu_ps(acc + 8 * m, sum);
        }
    }
}
#endif

/* y[rows, n_out] for activations quantized by dovetail_quantize_blocks. Weights and grouped scales
 * as described above; minimums only for Q4_1; bias may be NULL. Returns -1 for an unknown type or
 * a k that is not a multiple of 32. */
int dovetail_block_linear(const int8_t *xq, const float *xd, const int32_t *xs, int64_t rows, const uint8_t *w,
                          const uint16_t *scales, const uint16_t *minimums, int type, const float *bias, float *y,
                          int64_t n_out, int64_t k, int threads) {
    if (k % QBLOCK != 0 || type < BLOCK_Q8_0 || type > BLOCK_Q4_1) return -1;
    if (type == BLOCK_Q4_1 && minimums == NULL) return -1;
    int64_t blocks = k / QBLOCK, stride = row_bytes(type, k), groups = (n_out + 7) / 8;
#pragma omp parallel num_threads(threads)
    {
#if BLOCK_SIMD
        /* The rows' running sums; without it (no memory) the plain sequence computes the same bits. */
        float *acc = (float *)malloc((size_t)(rows > 0 ? rows : 1) * 8 * sizeof(float));
#endif
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            int64_t first = g * 8, count = n_out - first < 8 ? n_out - first : 8;
#if BLOCK_SIMD
            if (count == 8 && acc != NULL) {
                dot_group(w + first * stride, stride, scales + g * blocks * 8, minimums ? minimums + g * blocks * 8 : NULL,
                          type, xq, xd, xs, rows, k, blocks, acc);
                for (int64_t m = 0; m < rows; m++)
                    for (int j = 0; j < 8; j++) y[m * n_out + first + j] = acc[8 * m + j];
                continue;
            }
#endif
            for (int64_t m = 0; m < rows; m++)
                for (int64_t n = first; n < first + count; n++)
                    y[m * n_out + n] = dot_one(w + n * stride, scales, minimums, type, n, xq + m * k, xd + m * blocks,
                                               xs + m * blocks, blocks);
        }
#if BLOCK_SIMD
        free(acc);
#endif
    }
    if (bias)
        for (int64_t m = 0; m < rows; m++)
            for (int64_t n = 0; n < n_out; n++) y[m * n_out + n] = y[m * n_out + n] + bias[n];
    return 0;
}
