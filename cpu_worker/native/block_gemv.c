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
 * row alone, each block's dot product is an exact integer, and the float arithmetic that follows is
 * one fixed sequence per (row, output) whatever the row count, the row's place in the call or the
 * thread count: lane l (0..7) of a block's integer dot holds its products 4l..4l+3; each block adds
 * float(lane) * (d_w * d_x) to an 8-lane accumulator, blocks in order (multiply, then add: built with
 * -ffp-contract=off); then lanes reduce as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), the Q4_1
 * minimum term (its own running sum, blocks in order) is added, then the bias. Every build (VNNI,
 * AVX2, plain C) computes exactly that sequence, so all give the same bits.
 *
 * Dot products: VNNI multiplies unsigned by signed bytes, so a signed weight block w and activation
 * block x go in as |w| and x * sign(w) (x in [-127, 127], which the quantizer guarantees); Q4_1's
 * weights are unsigned already. AVX2 without VNNI gets the same lane sums from maddubs (pairs; at
 * most 2 * 127 * 128 in magnitude, no saturation) and madd against ones.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QBLOCK 32

enum { BLOCK_Q8_0 = 0, BLOCK_Q4_0 = 1, BLOCK_Q4_1 = 2 };

/* The SIMD path this build runs: 2 VNNI (AVX512-VNNI with VL, or AVX-VNNI), 1 AVX2, 0 plain C. */
int dovetail_block_simd(void) {
#if defined(__AVX2__) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
    return 2;
#elif defined(__AVX2__)
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

/* One block's 32 weights as bytes, with whether they are signed: Q8_0 as stored, Q4_0 as q - 8,
 * Q4_1 as q (unsigned). Q4 blocks hold 16 bytes: element j in the low nibble of byte j, element
 * j + 16 in its high nibble (llama.cpp's order). */
static inline void weight_block_bytes(const uint8_t *blocks, int type, int64_t b, int8_t out[QBLOCK]) {
    if (type == BLOCK_Q8_0) {
        memcpy(out, blocks + b * QBLOCK, QBLOCK);
        return;
    }
    const uint8_t *packed = blocks + b * (QBLOCK / 2);
    int offset = type == BLOCK_Q4_0 ? 8 : 0;
    for (int j = 0; j < QBLOCK / 2; j++) {
        out[j] = (int8_t)((packed[j] & 0x0f) - offset);
        out[j + QBLOCK / 2] = (int8_t)((packed[j] >> 4) - offset);
    }
}

static inline float reduce_lanes(const float lane[8]) {
    return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

/* The plain C twin of the SIMD kernel: the same lanes, the same order. */
static void dot_rows_portable(const uint8_t *w, const uint16_t *wd, const uint16_t *wm, int type, const int8_t *xq,
                              const float *xd, const int32_t *xs, int64_t blocks, int64_t k, int rows, float *out,
                              int64_t out_stride) {
    for (int r = 0; r < rows; r++) {
        float lane[8] = {0}, minimum = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            int8_t wb[QBLOCK];
            weight_block_bytes(w, type, b, wb);
            const int8_t *xb = xq + r * k + b * QBLOCK;
            float scale = half_to_float_exact(wd[b]) * xd[r * blocks + b];
            for (int l = 0; l < 8; l++) {
                int32_t p = 0;
                for (int j = 4 * l; j < 4 * l + 4; j++)
                    p += (type == BLOCK_Q4_1 ? (int32_t)(uint8_t)wb[j] : (int32_t)wb[j]) * (int32_t)xb[j];
                float term = (float)p * scale;
                lane[l] = lane[l] + term;
            }
            if (type == BLOCK_Q4_1) {
                float min_scale = half_to_float_exact(wm[b]) * xd[r * blocks + b];
                float term = min_scale * (float)xs[r * blocks + b];
                minimum = minimum + term;
            }
        }
        out[r * out_stride] = reduce_lanes(lane) + minimum;
    }
}

#if defined(__AVX2__)
static inline __m256i lane_dot(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i load_weight_block(const uint8_t *w, int type, int64_t b) {
    if (type == BLOCK_Q8_0) return _mm256_loadu_si256((const __m256i *)(w + b * QBLOCK));
    __m128i packed = _mm_loadu_si128((const __m128i *)(w + b * (QBLOCK / 2)));
    __m128i mask = _mm_set1_epi8(0x0f);
    __m256i bytes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), _mm_and_si128(packed, mask));
    return type == BLOCK_Q4_0 ? _mm256_sub_epi8(bytes, _mm256_set1_epi8(8)) : bytes;
}

static inline float reduce_vector(__m256 v) {
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l + l+4 */
    __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));                       /* (0+4)+(2+6), (1+5)+(3+7) */
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

#define MAX_GROUP 4
/* Up to MAX_GROUP activation rows against one weight row: each weight block is loaded once. */
static void dot_rows_simd(const uint8_t *w, const uint16_t *wd, const uint16_t *wm, int type, const int8_t *xq,
                          const float *xd, const int32_t *xs, int64_t blocks, int64_t k, int rows, float *out,
                          int64_t out_stride) {
    __m256 acc[MAX_GROUP];
    float minimum[MAX_GROUP];
    for (int r = 0; r < rows; r++) {
        acc[r] = _mm256_setzero_ps();
        minimum[r] = 0.0f;
    }
    for (int64_t b = 0; b < blocks; b++) {
        __m256i wb = load_weight_block(w, type, b);
        __m256i magnitude = type == BLOCK_Q4_1 ? wb : _mm256_sign_epi8(wb, wb);
        float weight_scale = half_to_float_exact(wd[b]);
        for (int r = 0; r < rows; r++) {
            __m256i xb = _mm256_loadu_si256((const __m256i *)(xq + r * k + b * QBLOCK));
            __m256i signed_x = type == BLOCK_Q4_1 ? xb : _mm256_sign_epi8(xb, wb);
            float scale = weight_scale * xd[r * blocks + b];
            __m256 term = _mm256_mul_ps(_mm256_cvtepi32_ps(lane_dot(magnitude, signed_x)), _mm256_set1_ps(scale));
            acc[r] = _mm256_add_ps(acc[r], term);
            if (type == BLOCK_Q4_1) {
                float min_scale = half_to_float_exact(wm[b]) * xd[r * blocks + b];
                float min_term = min_scale * (float)xs[r * blocks + b];
                minimum[r] = minimum[r] + min_term;
            }
        }
    }
    for (int r = 0; r < rows; r++) out[r * out_stride] = reduce_vector(acc[r]) + minimum[r];
}
#endif

/* y[rows, n_out] for activations quantized by dovetail_quantize_blocks. Weights: per output row,
 * k / 32 blocks of 32 bytes (Q8_0) or 16 bytes (Q4_0, Q4_1), scales[n_out, k / 32] and (Q4_1)
 * minimums[n_out, k / 32] as fp16 bits. bias may be NULL. Returns -1 for an unknown type or a k
 * that is not a multiple of 32. */
int dovetail_block_linear(const int8_t *xq, const float *xd, const int32_t *xs, int64_t rows, const uint8_t *w,
                          const uint16_t *scales, const uint16_t *minimums, int type, const float *bias, float *y,
                          int64_t n_out, int64_t k, int threads) {
    if (k % QBLOCK != 0 || type < BLOCK_Q8_0 || type > BLOCK_Q4_1) return -1;
    if (type == BLOCK_Q4_1 && minimums == NULL) return -1;
    int64_t blocks = k / QBLOCK, row_bytes = type == BLOCK_Q8_0 ? k : k / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const uint8_t *wn = w + n * row_bytes;
        const uint16_t *dn = scales + n * blocks, *mn = minimums ? minimums + n * blocks : NULL;
        for (int64_t m = 0; m < rows; m += 4) {
            int group = rows - m < 4 ? (int)(rows - m) : 4;
#if defined(__AVX2__)
            dot_rows_simd(wn, dn, mn, type, xq + m * k, xd + m * blocks, xs + m * blocks, blocks, k, group,
                          y + m * n_out + n, n_out);
#else
            dot_rows_portable(wn, dn, mn, type, xq + m * k, xd + m * blocks, xs + m * blocks, blocks, k, group,
                              y + m * n_out + n, n_out);
#endif
            if (bias)
                for (int r = 0; r < group; r++) y[(m + r) * n_out + n] = y[(m + r) * n_out + n] + bias[n];
        }
    }
    return 0;
}
