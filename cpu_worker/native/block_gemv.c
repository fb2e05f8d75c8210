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
 * Dot products: VNNI multiplies unsigned by signed bytes, so a signed weight w and activation x go
 * in as |w| and x * sign(w) (x in [-127, 127], which the quantizer guarantees); Q4_1's weights are
 * unsigned already. AVX2 without VNNI gets the same sums from maddubs (pairs; at most 2 * 128 * 127
 * in magnitude, no saturation) and madd against ones.
 *
 * Layout (BlockWeights; GGUF's blocks regrouped at load, every byte kept): outputs in groups of 8,
 * each group one sequential stream of its blocks. In a (group, block), the 32 inputs are 8 chunks of
 * 4; Q8_0 holds 8 vectors of 32 bytes, vector c = chunk c of the 8 outputs side by side (4 bytes an
 * output), so one dpbusd against chunk c of x broadcast adds 4 products to each output's lane and a
 * block's 8 totals need no horizontal sum. Q4_0 and Q4_1 hold 4 such vectors, chunk v in the low
 * nibbles and chunk v + 4 in the high ones. Scales (and Q4_1's minimums) are fp16, [groups, k / 32, 8].
 * A last partial group is padded with zero weights and scales.
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

/* Bytes of one (group, block): 8 outputs x 32 inputs at 8 or 4 bits. */
static inline int64_t group_block_bytes(int type) { return type == BLOCK_Q8_0 ? 8 * QBLOCK : 4 * QBLOCK; }

/* Weight (output o of the group, input kk of the block) as a signed integer (Q4_0: q - 8; Q4_1: q). */
static inline int32_t weight_value(const uint8_t *group_block, int type, int o, int kk) {
    int chunk = kk >> 2, j = kk & 3;
    if (type == BLOCK_Q8_0) return ((const int8_t *)group_block)[chunk * 32 + o * 4 + j];
    uint8_t byte = group_block[(chunk & 3) * 32 + o * 4 + j];
    int32_t q = chunk < 4 ? (byte & 0x0f) : (byte >> 4);
    return type == BLOCK_Q4_0 ? q - 8 : q;
}

#if !BLOCK_SIMD
/* One (row, output) by the reference sequence: the plain C path. */
static float dot_one(const uint8_t *group, const uint16_t *scales, const uint16_t *minimums, int type, int o,
                     const int8_t *xq, const float *xd, const int32_t *xs, int64_t blocks) {
    float acc = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * group_block_bytes(type);
        int32_t total = 0;
        for (int kk = 0; kk < QBLOCK; kk++) total += weight_value(block, type, o, kk) * (int32_t)xq[b * QBLOCK + kk];
        float scale = half_to_float_exact(scales[b * 8 + o]) * xd[b];
        float term = (float)total * scale;
        acc = acc + term;
        if (type == BLOCK_Q4_1) {
            float min_scale = half_to_float_exact(minimums[b * 8 + o]) * xd[b];
            float min_term = min_scale * (float)xs[b];
            acc = acc + min_term;
        }
    }
    return acc;
}
#endif

#if BLOCK_SIMD
/* acc + the 8 lanes' sums of 4 products u[4l..4l+3] * s[4l..4l+3] (u unsigned, s signed). */
static inline __m256i add_lane_dots(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

#define GROUP_ROWS 4 /* activation rows per pass over a group's weights */
#ifndef BLOCK_AHEAD /* bytes; a build flag for tuning */
#define BLOCK_AHEAD 2048
#endif
#define ALWAYS_INLINE inline __attribute__((always_inline))

/* Block totals of 8 outputs for `rows` (a constant after inlining: the sums stay in registers)
 * rows, chunk by chunk; even and odd chunks in separate sums (integers: the same totals), so two
 * dot products are in flight per row instead of a chain of eight. */
static ALWAYS_INLINE void block_totals(const uint8_t *block, int type, const int8_t *const x[GROUP_ROWS],
                                       const int rows, __m256i totals[GROUP_ROWS]) {
    __m256i even[GROUP_ROWS], odd[GROUP_ROWS];
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm256_setzero_si256();
    const __m256i mask = _mm256_set1_epi8(0x0f), eight = _mm256_set1_epi8(8);
    for (int c = 0; c < 8; c++) {
        __m256i w;
        if (type == BLOCK_Q8_0) {
            w = _mm256_loadu_si256((const __m256i *)(block + 32 * c));
        } else {
            __m256i packed = _mm256_loadu_si256((const __m256i *)(block + 32 * (c & 3)));
            w = _mm256_and_si256(c < 4 ? packed : _mm256_srli_epi16(packed, 4), mask);
            if (type == BLOCK_Q4_0) w = _mm256_sub_epi8(w, eight);
        }
        __m256i magnitude = type == BLOCK_Q4_1 ? w : _mm256_sign_epi8(w, w);
        for (int r = 0; r < rows; r++) {
            int32_t four;
            memcpy(&four, x[r] + 4 * c, 4);
            __m256i input = _mm256_set1_epi32(four);
            if (type != BLOCK_Q4_1) input = _mm256_sign_epi8(input, w);
            if (c & 1)
                odd[r] = add_lane_dots(odd[r], magnitude, input);
            else
                even[r] = add_lane_dots(even[r], magnitude, input);
        }
    }
    for (int r = 0; r < rows; r++) totals[r] = _mm256_add_epi32(even[r], odd[r]);
}

/* One group of 8 outputs for `rows` (constant after inlining) rows: out[r * 8 + lane]. */
static ALWAYS_INLINE void dot_group_rows(const uint8_t *group, const uint16_t *scales, const uint16_t *minimums,
                                         int type, const int8_t *xq, const float *xd, const int32_t *xs,
                                         const int rows, int64_t k, int64_t blocks, float *out) {
    __m256 acc[GROUP_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    const int64_t bytes = group_block_bytes(type);
    for (int64_t b = 0; b < blocks; b++) {
        /* Keep more lines of the group's stream in flight than the loads alone ask for (as
         * int8_gemv.c does): BLOCK_AHEAD bytes ahead, every line of this block's bytes. */
        for (int64_t line = 0; line < bytes; line += 64)
            _mm_prefetch((const char *)(group + b * bytes + BLOCK_AHEAD + line), _MM_HINT_T0);
        const int8_t *x[GROUP_ROWS];
        for (int r = 0; r < rows; r++) x[r] = xq + r * k + b * QBLOCK;
        __m256i totals[GROUP_ROWS];
        block_totals(group + b * bytes, type, x, rows, totals);
        __m256 weight_scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + b * 8)));
        for (int r = 0; r < rows; r++) {
            __m256 x_scale = _mm256_set1_ps(xd[r * blocks + b]);
            __m256 term = _mm256_mul_ps(_mm256_cvtepi32_ps(totals[r]), _mm256_mul_ps(weight_scale, x_scale));
            acc[r] = _mm256_add_ps(acc[r], term);
            if (type == BLOCK_Q4_1) {
                __m256 weight_min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(minimums + b * 8)));
                __m256 min_term = _mm256_mul_ps(_mm256_mul_ps(weight_min, x_scale),
                                                _mm256_set1_ps((float)xs[r * blocks + b]));
                acc[r] = _mm256_add_ps(acc[r], min_term);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

/* dot_group_rows for each type and row count as constants (the compiler specializes every one). */
static ALWAYS_INLINE void dot_group_typed(const uint8_t *group, const uint16_t *scales, const uint16_t *minimums,
                                          const int type, const int8_t *xq, const float *xd, const int32_t *xs,
                                          int rows, int64_t k, int64_t blocks, float *out) {
    switch (rows) {
    case 1: dot_group_rows(group, scales, minimums, type, xq, xd, xs, 1, k, blocks, out); break;
    case 2: dot_group_rows(group, scales, minimums, type, xq, xd, xs, 2, k, blocks, out); break;
    case 3: dot_group_rows(group, scales, minimums, type, xq, xd, xs, 3, k, blocks, out); break;
    default: dot_group_rows(group, scales, minimums, type, xq, xd, xs, 4, k, blocks, out); break;
    }
}

static void dot_group(const uint8_t *group, const uint16_t *scales, const uint16_t *minimums, int type,
                      const int8_t *xq, const float *xd, const int32_t *xs, int rows, int64_t k, int64_t blocks,
                      float *out) {
    if (type == BLOCK_Q8_0)
        dot_group_typed(group, scales, minimums, BLOCK_Q8_0, xq, xd, xs, rows, k, blocks, out);
    else if (type == BLOCK_Q4_0)
        dot_group_typed(group, scales, minimums, BLOCK_Q4_0, xq, xd, xs, rows, k, blocks, out);
    else
        dot_group_typed(group, scales, minimums, BLOCK_Q4_1, xq, xd, xs, rows, k, blocks, out);
}
#endif

/* y[rows, n_out] for activations quantized by dovetail_quantize_blocks. Weights, scales and
 * minimums (Q4_1 only) in the layout above; bias may be NULL. Returns -1 for an unknown type or a k
 * that is not a multiple of 32. */
int dovetail_block_linear(const int8_t *xq, const float *xd, const int32_t *xs, int64_t rows, const uint8_t *w,
                          const uint16_t *scales, const uint16_t *minimums, int type, const float *bias, float *y,
                          int64_t n_out, int64_t k, int threads) {
    if (k % QBLOCK != 0 || type < BLOCK_Q8_0 || type > BLOCK_Q4_1) return -1;
    if (type == BLOCK_Q4_1 && minimums == NULL) return -1;
    int64_t blocks = k / QBLOCK, groups = (n_out + 7) / 8, group_bytes = blocks * group_block_bytes(type);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = w + g * group_bytes;
        const uint16_t *group_scales = scales + g * blocks * 8;
        const uint16_t *group_mins = minimums ? minimums + g * blocks * 8 : NULL;
        int count = n_out - g * 8 < 8 ? (int)(n_out - g * 8) : 8;
        for (int64_t m = 0; m < rows; m += 4) {
            int chunk = rows - m < 4 ? (int)(rows - m) : 4;
            float out[4 * 8];
#if BLOCK_SIMD
            dot_group(group, group_scales, group_mins, type, xq + m * k, xd + m * blocks, xs + m * blocks, chunk, k,
                      blocks, out);
#else
            for (int r = 0; r < chunk; r++)
                for (int o = 0; o < count; o++)
                    out[8 * r + o] = dot_one(group, group_scales, group_mins, type, o, xq + (m + r) * k,
                                             xd + (m + r) * blocks, xs + (m + r) * blocks, blocks);
#endif
            for (int r = 0; r < chunk; r++)
                for (int o = 0; o < count; o++) {
                    float value = out[8 * r + o];
                    y[(m + r) * n_out + g * 8 + o] = bias ? value + bias[g * 8 + o] : value;
                }
        }
    }
    return 0;
}
