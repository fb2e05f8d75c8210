/* Block-quantized linear layers: weights in blocks of 32 along k, each block with its own scale, as
 * llama.cpp's Q8_0 (int8, scale d), Q4_0 (4 bits, q - 8, scale d) and Q4_1 (4 bits, q, scale d and
 * minimum m) hold them; activations quantized per block of 32 as well, to 8 bits (q = round(x / d_x),
 * d_x = max|x| / 127 over the block, one plane) or to 16 (d_x = max|x| / 32512, q = 255 h + l with
 * the digits h and l in [-127, 127], two planes of int8: see dovetail_quantize_blocks).
 * y[m, n] = sum over blocks b of d_w[n, b] d_x[m, b] dot(w, q) (+ m_w[n, b] d_x[m, b] sum(q) for
 * Q4_1) (+ bias[n]); with two planes dot(w, q) = 255 dot(w, h) + dot(w, l), exact in int32.
 *
 * Why 16-bit activations: at 8 bits the activations' rounding is half of what Q8_0 x Q8_0 loses on a
 * real model (SmolLM2-135M-Instruct: KL 0.0046 from fp32 at Q8_0 x Q8_0, 0.0013 with fp32 activations;
 * tools/bench_quality). Two planes of the same int8 dot products keep every SIMD path (VNNI's
 * unsigned x signed bytes, AVX2's pair sums, AMX) exact, at twice the arithmetic per weight byte,
 * which a memory-bound decode hardly sees.
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
 * Dot products: VNNI multiplies unsigned by signed bytes. 4-bit weights go in as their unsigned
 * nibbles q (Q4_0's q - 8 becomes dot(q, x) - 8 sum(x), one integer subtraction a block), so they
 * need no sign work. A signed Q8_0 weight w goes in on the 8-lane paths as |w| against x * sign(w)
 * (x in [-127, 127], which the quantizer guarantees); on AVX-512 the activations are offset to
 * unsigned x + 128 once per call instead, against w as it is, and 128 sum(w) comes off each block's
 * totals: no per-plane sign instruction, which is what a tree's extra rows cost there. AVX2 without VNNI gets the same sums from maddubs (pairs; at
 * most 2 * 128 * 127 in magnitude, no saturation) and madd against ones; for 4-bit weights the pairs
 * (at most 3810) add up in 16 bits over a whole block before one madd widens them.
 *
 * Layout (BlockWeights; GGUF's blocks regrouped at load, every byte kept): outputs in groups of 16,
 * each group one sequential stream of its blocks. In a (group, block), the 32 inputs are 8 chunks of
 * 4; Q8_0 holds 8 vectors of 64 bytes, vector c = chunk c of the 16 outputs side by side (4 bytes an
 * output): AMX's weight tile for the block as it lies (8 rows of 64 bytes), and for VNNI one dpbusd
 * against chunk c of x broadcast adds 4 products to each output's lane (8 lanes a 32-byte half), so a
 * block's totals need no horizontal sum. Q4_0 and Q4_1 hold 4 such vectors, chunk v in the low
 * nibbles and chunk v + 4 in the high ones. Scales (and Q4_1's minimums) are fp16, [groups, k / 32,
 * 16]. A last partial group is padded with zero weights and scales.
 *
 * AMX (Sapphire Rapids on): from a few activation rows up, one TDPBSSD per (group, block) multiplies
 * 16 planes of activations by the block's weight tile into the same integer totals, so a tree of
 * 16 rows costs little more arithmetic time than one row (dovetail_block_amx_from sets where).
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

#define GROUP_ROWS 4 /* activation planes per pass over a group's weights (4 rows of 8 bits, 2 of 16) */
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

/* One block of 32 activations quantized (see dovetail_quantize_blocks): writes the plane(s) at
 * high (and high + k for the low digits), returns the block's scale and sets *sum. */
static inline float quantize_block(const float *in, int8_t *high, int64_t k, int planes, int32_t *sum) {
    const float top = planes == 2 ? 32512.0f : 127.0f;
    float amax = 0.0f;
    for (int j = 0; j < QBLOCK; j++) amax = fabsf(in[j]) > amax ? fabsf(in[j]) : amax;
    float scale = amax / top, inverse = amax > 0.0f ? top / amax : 0.0f;
    int8_t *low = high + k;
    int32_t total = 0;
    for (int j = 0; j < QBLOCK; j++) {
        float v = nearbyintf(in[j] * inverse);
        v = v != v ? 0.0f : v; /* NaN (a NaN or infinite input, or 0 x an inverse that overflowed): 0 */
        v = v > top ? top : (v < -top ? -top : v);
        int32_t value = (int32_t)v;
        total += value;
        if (planes == 2) {
            int32_t h = value >= 0 ? (value + 127) / 255 : -((127 - value) / 255);
            high[j] = (int8_t)h;
            low[j] = (int8_t)(value - 255 * h);
        } else {
            high[j] = (int8_t)value;
        }
    }
    *sum = total;
    return scale;
}

#if defined(__AVX2__)
/* 4 vectors of 8 int32 in [-127, 127] (inputs 0-7, 8-15, 16-23, 24-31) as 32 bytes in input order. */
static inline void store_bytes(int8_t *out, __m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* quantize_block, 8 inputs a vector, the same bits: the same IEEE products and round-to-nearest;
 * a NaN product becomes 0 as there; max|x| by max_ps(|x|, running) skips a NaN as `fabsf(x) > amax`
 * does; h = nearest(v / 255) equals the scalar code's integer division, as v / 255 is never within
 * 1/510 of a half (255 is odd). */
static inline float quantize_block8(const float *in, int8_t *high, int64_t k, int planes, int32_t *sum) {
    const float top = planes == 2 ? 32512.0f : 127.0f;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], running = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(in + 8 * i);
        running = _mm256_max_ps(_mm256_andnot_ps(sign, x[i]), running);
    }
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, running);
    for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
    float scale = amax / top, inverse = amax > 0.0f ? top / amax : 0.0f;
    const __m256 upper = _mm256_set1_ps(top), lower = _mm256_set1_ps(-top), factor = _mm256_set1_ps(inverse);
    __m256i value[4], digit_high[4], digit_low[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        __m256 v = _mm256_round_ps(_mm256_mul_ps(x[i], factor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_andnot_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), v); /* NaN -> 0 */
        v = _mm256_blendv_ps(v, upper, _mm256_cmp_ps(v, upper, _CMP_GT_OQ));
        v = _mm256_blendv_ps(v, lower, _mm256_cmp_ps(v, lower, _CMP_LT_OQ));
        value[i] = _mm256_cvttps_epi32(v);
        total = _mm256_add_epi32(total, value[i]);
        if (planes == 2) {
            __m256 h = _mm256_round_ps(_mm256_div_ps(v, _mm256_set1_ps(255.0f)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            digit_high[i] = _mm256_cvttps_epi32(h);
            digit_low[i] = _mm256_sub_epi32(_mm256_add_epi32(value[i], digit_high[i]), _mm256_slli_epi32(digit_high[i], 8));
        }
    }
    int32_t partial[8];
    _mm256_storeu_si256((__m256i *)partial, total);
    *sum = partial[0] + partial[1] + partial[2] + partial[3] + partial[4] + partial[5] + partial[6] + partial[7];
    if (planes == 2) {
        store_bytes(high, digit_high[0], digit_high[1], digit_high[2], digit_high[3]);
        store_bytes(high + k, digit_low[0], digit_low[1], digit_low[2], digit_low[3]);
    } else {
        store_bytes(high, value[0], value[1], value[2], value[3]);
    }
    return scale;
}
#define QUANTIZE_BLOCK quantize_block8
#else
#define QUANTIZE_BLOCK quantize_block
#endif

/* Below this many activations a call stays on one thread. */
#define QUANTIZE_PARALLEL_MIN 16384

/* Activations: per block of 32 of each row, all zero for a zero block.
 * planes 1: d = max|x| / 127, q = nearbyint(x / d) in [-127, 127]: q[m * k + i].
 * planes 2: d = max|x| / 32512, v = nearbyint(x / d) in [-32512, 32512], written as the balanced
 *   base-255 digits h = nearbyint(v / 255) and l = v - 255 h, both in [-127, 127] (so VNNI's sign
 *   trick applies to each): h at q[(m * 2) * k + i], l at q[(m * 2 + 1) * k + i].
 * sums[m * blocks + b] = the block's sum of q (v for two planes; Q4_1's minimum term). k % 32 == 0.
 * Every block on its own, so the thread count never changes a bit. */
void dovetail_quantize_blocks(const float *x, int8_t *q, float *d, int32_t *sums, int64_t rows, int64_t k,
                              int planes, int threads) {
    int64_t blocks = k / QBLOCK;
#define QUANTIZE_ITEM(item)                                                                                     \
    d[item] = QUANTIZE_BLOCK(x + (item) / blocks * k + (item) % blocks * QBLOCK,                                \
                             q + (item) / blocks * planes * k + (item) % blocks * QBLOCK, k, planes, sums + (item))
    if (rows * k < QUANTIZE_PARALLEL_MIN || threads < 2) { /* no OpenMP region: see layer_ops.c */
        for (int64_t item = 0; item < rows * blocks; item++) QUANTIZE_ITEM(item);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < rows * blocks; item++) QUANTIZE_ITEM(item);
#undef QUANTIZE_ITEM
}

#define GROUP_OUT 16 /* outputs a group */

/* Bytes of one (group, block): 16 outputs x 32 inputs at 8 or 4 bits. */
static inline int64_t group_block_bytes(int type) { return type == BLOCK_Q8_0 ? 16 * QBLOCK : 8 * QBLOCK; }

/* Weight (output o of the group, input kk of the block) as a signed integer (Q4_0: q - 8; Q4_1: q). */
static inline int32_t weight_value(const uint8_t *group_block, int type, int o, int kk) {
    int chunk = kk >> 2, j = kk & 3;
    if (type == BLOCK_Q8_0) return ((const int8_t *)group_block)[chunk * 64 + o * 4 + j];
    uint8_t byte = group_block[(chunk & 3) * 64 + o * 4 + j];
    int32_t q = chunk < 4 ? (byte & 0x0f) : (byte >> 4);
    return type == BLOCK_Q4_0 ? q - 8 : q;
}

#if !BLOCK_SIMD
/* One (row, output) by the reference sequence: the plain C path. xq: the row's planes, k apart. */
static float dot_one(const uint8_t *group, const uint16_t *scales, const uint16_t *minimums, int type, int o,
                     const int8_t *xq, int planes, const float *xd, const int32_t *xs, int64_t k, int64_t blocks) {
    float acc = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * group_block_bytes(type);
        int32_t total = 0;
        for (int p = 0; p < planes; p++) {
            int32_t part = 0;
            for (int kk = 0; kk < QBLOCK; kk++)
                part += weight_value(block, type, o, kk) * (int32_t)xq[p * k + b * QBLOCK + kk];
            total = total * 255 + part; /* two planes: 255 dot(w, h) + dot(w, l) */
        }
        float scale = half_to_float_exact(scales[b * GROUP_OUT + o]) * xd[b];
        float term = (float)total * scale;
        acc = acc + term;
        if (type == BLOCK_Q4_1) {
            float min_scale = half_to_float_exact(minimums[b * GROUP_OUT + o]) * xd[b];
            float min_term = min_scale * (float)xs[b];
            acc = acc + min_term;
        }
    }
    return acc;
}
#endif

#if BLOCK_SIMD
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define BLOCK_VNNI8 1 /* dpbusd on 8 lanes */
#else
#define BLOCK_VNNI8 0
#endif

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

#ifndef BLOCK_AHEAD /* bytes; a build flag for tuning */
#define BLOCK_AHEAD 2048
#endif
#define ALWAYS_INLINE inline __attribute__((always_inline))

/* A block's totals for the group's 16 outputs (low: outputs 0-7, high: 8-15, a lane each) and
 * `rows` planes (a constant after inlining: the sums stay in registers), from Q8_0 weights by the
 * sign trick, chunk by chunk. Both halves in one pass, so each plane's 4 inputs are broadcast once
 * per chunk. */
static ALWAYS_INLINE void q8_block_totals(const uint8_t *block, const int8_t *const x[GROUP_ROWS], const int rows,
                                          __m256i low[GROUP_ROWS], __m256i high[GROUP_ROWS]) {
    for (int r = 0; r < rows; r++) low[r] = high[r] = _mm256_setzero_si256();
#pragma GCC unroll 2 /* fully unrolled, GCC reorders the sums into a tree of temporaries that spill */
    for (int c = 0; c < 8; c++) {
        __m256i w_low = _mm256_loadu_si256((const __m256i *)(block + 64 * c));
        __m256i w_high = _mm256_loadu_si256((const __m256i *)(block + 64 * c + 32));
        __m256i magnitude_low = _mm256_sign_epi8(w_low, w_low), magnitude_high = _mm256_sign_epi8(w_high, w_high);
        for (int r = 0; r < rows; r++) {
            int32_t four;
            memcpy(&four, x[r] + 4 * c, 4);
            __m256i input = _mm256_set1_epi32(four);
            low[r] = add_lane_dots(low[r], magnitude_low, _mm256_sign_epi8(input, w_low));
            high[r] = add_lane_dots(high[r], magnitude_high, _mm256_sign_epi8(input, w_high));
        }
    }
}

/* The same for 4-bit weights, taken as the unsigned nibbles q in [0, 15] for Q4_0 too (its
 * q - 8 is the caller's: dot(q - 8, x) = dot(q, x) - 8 sum(x)), so no sign trick: one product
 * instruction per chunk and plane. Chunk v sits in the low nibbles of vector v, chunk v + 4 in the
 * high ones. Without VNNI, maddubs' pair sums (at most 2 * 15 * 127 = 3810) add up in 16 bits over
 * the block's 8 chunks (at most 30480 < 32767) and are widened once, by one madd against ones. */
static ALWAYS_INLINE void nibble_block_totals(const uint8_t *block, const int8_t *const x[GROUP_ROWS],
                                              const int rows, __m256i low[GROUP_ROWS], __m256i high[GROUP_ROWS]) {
    for (int r = 0; r < rows; r++) low[r] = high[r] = _mm256_setzero_si256();
    const __m256i mask = _mm256_set1_epi8(0x0f);
#pragma GCC unroll 1 /* unrolled, GCC reorders the sums into a tree of temporaries that spill */
    for (int v = 0; v < 4; v++) {
        __m256i packed_low = _mm256_loadu_si256((const __m256i *)(block + 64 * v));
        __m256i packed_high = _mm256_loadu_si256((const __m256i *)(block + 64 * v + 32));
        __m256i w[4] = {_mm256_and_si256(packed_low, mask), _mm256_and_si256(packed_high, mask),
                        _mm256_and_si256(_mm256_srli_epi16(packed_low, 4), mask),
                        _mm256_and_si256(_mm256_srli_epi16(packed_high, 4), mask)};
        for (int r = 0; r < rows; r++) {
            int32_t four_first, four_second; /* inputs of chunk v, then of chunk v + 4 */
            memcpy(&four_first, x[r] + 4 * v, 4);
            memcpy(&four_second, x[r] + 4 * (v + 4), 4);
            __m256i first = _mm256_set1_epi32(four_first), second = _mm256_set1_epi32(four_second);
#if BLOCK_VNNI8
            low[r] = add_lane_dots(add_lane_dots(low[r], w[0], first), w[2], second);
            high[r] = add_lane_dots(add_lane_dots(high[r], w[1], first), w[3], second);
#else
            low[r] = _mm256_add_epi16(low[r], _mm256_add_epi16(_mm256_maddubs_epi16(w[0], first),
                                                               _mm256_maddubs_epi16(w[2], second)));
            high[r] = _mm256_add_epi16(high[r], _mm256_add_epi16(_mm256_maddubs_epi16(w[1], first),
                                                                 _mm256_maddubs_epi16(w[3], second)));
#endif
        }
    }
#if !BLOCK_VNNI8
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rows; r++) {
        low[r] = _mm256_madd_epi16(low[r], ones);
        high[r] = _mm256_madd_epi16(high[r], ones);
    }
#endif
}

/* Two planes' totals into one: 255 dot(w, h) + dot(w, l) = (dot(w, h) << 8) - dot(w, h) + dot(w, l). */
static ALWAYS_INLINE __m256i join_planes(__m256i high_digit, __m256i low_digit) {
    return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(high_digit, 8), high_digit), low_digit);
}

/* acc + one block's terms for 8 outputs of a row: float(T) * (d_w * d_x), then for Q4_1
 * (m_w * d_x) * float(S); the sequence every path keeps. */
static ALWAYS_INLINE __m256 add_block_terms(__m256 acc, __m256i totals, __m256 weight_scale, __m256 weight_min,
                                            int type, float x_scale_value, int32_t x_sum) {
    __m256 x_scale = _mm256_set1_ps(x_scale_value);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(totals), _mm256_mul_ps(weight_scale, x_scale)));
    if (type == BLOCK_Q4_1)
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(weight_min, x_scale), _mm256_set1_ps((float)x_sum)));
    return acc;
}

/* 8 fp16 values as fp32. */
static ALWAYS_INLINE __m256 load_halves(const uint16_t *values) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)values));
}

/* One group of 16 outputs for `rows` rows of `planes` planes each (both constant after inlining):
 * out[r * 16 + lane]. */
static ALWAYS_INLINE void dot_group_rows(const uint8_t *group, const uint16_t *scales, const uint16_t *minimums,
                                         int type, const int8_t *xq, const int planes, const float *xd,
                                         const int32_t *xs, const int rows, int64_t k, int64_t blocks, float *out) {
    __m256 acc_low[GROUP_ROWS], acc_high[GROUP_ROWS];
    for (int r = 0; r < rows; r++) acc_low[r] = acc_high[r] = _mm256_setzero_ps();
    const int64_t bytes = group_block_bytes(type);
    for (int64_t b = 0; b < blocks; b++) {
        /* Keep more lines of the group's stream in flight than the loads alone ask for (as
         * int8_gemv.c does): BLOCK_AHEAD bytes ahead, every line of this block's bytes. */
        for (int64_t line = 0; line < bytes; line += 64)
            _mm_prefetch((const char *)(group + b * bytes + BLOCK_AHEAD + line), _MM_HINT_T0);
        const int8_t *x[GROUP_ROWS];
        for (int p = 0; p < rows * planes; p++) x[p] = xq + p * k + b * QBLOCK;
        __m256i low[GROUP_ROWS], high[GROUP_ROWS];
        if (type == BLOCK_Q8_0)
            q8_block_totals(group + b * bytes, x, rows * planes, low, high);
        else
            nibble_block_totals(group + b * bytes, x, rows * planes, low, high);
        /* The block's weight scales (and Q4_1's minimums), once for every row. */
        const __m256 scale_low = load_halves(scales + b * GROUP_OUT);
        const __m256 scale_high = load_halves(scales + b * GROUP_OUT + 8);
        __m256 min_low = _mm256_setzero_ps(), min_high = _mm256_setzero_ps();
        if (type == BLOCK_Q4_1) {
            min_low = load_halves(minimums + b * GROUP_OUT);
            min_high = load_halves(minimums + b * GROUP_OUT + 8);
        }
        for (int r = 0; r < rows; r++) {
            __m256i total_low = planes == 2 ? join_planes(low[2 * r], low[2 * r + 1]) : low[r];
            __m256i total_high = planes == 2 ? join_planes(high[2 * r], high[2 * r + 1]) : high[r];
            if (type == BLOCK_Q4_0) { /* the nibbles were q: dot(q - 8, x) = dot(q, x) - 8 sum(x) */
                __m256i correction = _mm256_set1_epi32(8 * xs[r * blocks + b]);
                total_low = _mm256_sub_epi32(total_low, correction);
                total_high = _mm256_sub_epi32(total_high, correction);
            }
            acc_low[r] = add_block_terms(acc_low[r], total_low, scale_low, min_low, type, xd[r * blocks + b],
                                         xs[r * blocks + b]);
            acc_high[r] = add_block_terms(acc_high[r], total_high, scale_high, min_high, type, xd[r * blocks + b],
                                          xs[r * blocks + b]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(out + GROUP_OUT * r, acc_low[r]);
        _mm256_storeu_ps(out + GROUP_OUT * r + 8, acc_high[r]);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define BLOCK_ZMM 1 /* 16 outputs a register: one dpbusd per chunk and plane where 8 lanes take two */
#define ZMM_PLANES 8 /* activation planes a pass (8 rows of 8 bits, 4 of 16): 32 registers hold their sums */

/* A block's integer totals for all 16 outputs (a register each) and `planes` activation planes,
 * with no per-plane sign work: 4-bit weights go in as their unsigned nibbles q against the signed
 * activations; for Q4_0, dot(q - 8, x) = dot(q, x) - 8 sum(x), so each row's last plane (the one
 * that joins the total last) starts from starts[row * starts_stride] = -8 sum(x). Q8_0's signed
 * weights meet the activations offset to unsigned bytes, x + 128 (the caller's copy,
 * offset_activations), and the block's 128 sum(w) per output, one dpbusd against ones a chunk for
 * every plane, comes off at the end. Two chains of sums (chunks v and v + 4 of the nibbles, or two
 * neighbouring Q8_0 chunks) so consecutive dpbusd never wait on each other. */
static ALWAYS_INLINE void block_totals_zmm(const uint8_t *block, int type, const int8_t *const x[ZMM_PLANES],
                                           const int planes, const int row_planes, const int32_t *starts,
                                           int64_t starts_stride, __m512i totals[ZMM_PLANES]) {
    __m512i first[ZMM_PLANES], second[ZMM_PLANES];
    for (int p = 0; p < planes; p++) first[p] = second[p] = _mm512_setzero_si512();
    if (type == BLOCK_Q4_0) /* each row's last plane starts from the row's -8 sum(x) (see q4_0_starts) */
        for (int p = row_planes - 1; p < planes; p += row_planes)
            first[p] = _mm512_set1_epi32(starts[(p / row_planes) * starts_stride]);
    __m512i weight_sums = _mm512_setzero_si512();
    const __m512i mask = _mm512_set1_epi8(0x0f), ones = _mm512_set1_epi8(1);
    for (int v = 0; v < 4; v++) {
        __m512i w_first, w_second;
        int chunk_first, chunk_second;
        if (type == BLOCK_Q8_0) {
            chunk_first = 2 * v;
            chunk_second = 2 * v + 1;
            w_first = _mm512_loadu_si512((const void *)(block + 64 * chunk_first));
            w_second = _mm512_loadu_si512((const void *)(block + 64 * chunk_second));
            weight_sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(weight_sums, ones, w_first), ones, w_second);
        } else {
            chunk_first = v;
            chunk_second = v + 4;
            __m512i packed = _mm512_loadu_si512((const void *)(block + 64 * v));
            w_first = _mm512_and_si512(packed, mask);
            w_second = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
        }
        for (int p = 0; p < planes; p++) {
            int32_t four_first, four_second;
            memcpy(&four_first, x[p] + 4 * chunk_first, 4);
            memcpy(&four_second, x[p] + 4 * chunk_second, 4);
            __m512i input_first = _mm512_set1_epi32(four_first), input_second = _mm512_set1_epi32(four_second);
            if (type == BLOCK_Q8_0) { /* unsigned activations x + 128, signed weights */
                first[p] = _mm512_dpbusd_epi32(first[p], input_first, w_first);
                second[p] = _mm512_dpbusd_epi32(second[p], input_second, w_second);
            } else { /* unsigned nibbles, signed activations */
                first[p] = _mm512_dpbusd_epi32(first[p], w_first, input_first);
                second[p] = _mm512_dpbusd_epi32(second[p], w_second, input_second);
            }
        }
    }
    const __m512i offset = _mm512_slli_epi32(weight_sums, 7); /* 128 sum(w): Q8_0's activation offset */
    for (int p = 0; p < planes; p++) {
        totals[p] = _mm512_add_epi32(first[p], second[p]);
        if (type == BLOCK_Q8_0) totals[p] = _mm512_sub_epi32(totals[p], offset);
    }
}

/* dot_group_rows with 16 lanes a register and up to ZMM_PLANES planes a pass: the same integers,
 * the same float sequence per lane. */
static ALWAYS_INLINE void dot_group_rows_zmm(const uint8_t *group, const uint16_t *scales, const uint16_t *minimums,
                                             int type, const int8_t *xq, const int planes, const float *xd,
                                             const int32_t *xs, const int rows, int64_t k, int64_t blocks,
                                             float *out) {
    __m512 acc[ZMM_PLANES];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const int64_t bytes = group_block_bytes(type);
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t line = 0; line < bytes; line += 64)
            _mm_prefetch((const char *)(group + b * bytes + BLOCK_AHEAD + line), _MM_HINT_T0);
        const int8_t *x[ZMM_PLANES];
        for (int p = 0; p < rows * planes; p++) x[p] = xq + p * k + b * QBLOCK;
        __m512i totals[ZMM_PLANES];
        block_totals_zmm(group + b * bytes, type, x, rows * planes, planes, xs + b, blocks, totals);
        if (planes == 2)
            for (int r = 0; r < rows; r++)
                totals[r] = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(totals[2 * r], 8), totals[2 * r]),
                                             totals[2 * r + 1]);
        __m512 weight_scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + b * GROUP_OUT)));
        __m512 weight_min = _mm512_setzero_ps();
        if (type == BLOCK_Q4_1)
            weight_min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(minimums + b * GROUP_OUT)));
        for (int r = 0; r < rows; r++) {
            __m512 x_scale = _mm512_set1_ps(xd[r * blocks + b]);
            __m512 term = _mm512_mul_ps(_mm512_cvtepi32_ps(totals[r]), _mm512_mul_ps(weight_scale, x_scale));
            acc[r] = _mm512_add_ps(acc[r], term);
            if (type == BLOCK_Q4_1) {
                __m512 min_term = _mm512_mul_ps(_mm512_mul_ps(weight_min, x_scale),
                                                _mm512_set1_ps((float)xs[r * blocks + b]));
                acc[r] = _mm512_add_ps(acc[r], min_term);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + GROUP_OUT * r, acc[r]);
}
#define PASS_PLANES ZMM_PLANES
#define DOT_GROUP_ROWS dot_group_rows_zmm
#else
#define DOT_GROUP_ROWS dot_group_rows
#define PASS_PLANES GROUP_ROWS
#endif

/* dot_group_rows for each type, plane count and row count as constants (the compiler specializes
 * every one): up to PASS_PLANES planes a pass. */
#define ROWS_CASE(n, planes)                                                                  \
    case n: DOT_GROUP_ROWS(group, scales, minimums, type, xq, planes, xd, xs, n, k, blocks, out); break;
static ALWAYS_INLINE void dot_group_typed(const uint8_t *group, const uint16_t *scales, const uint16_t *minimums,
                                          const int type, const int8_t *xq, int planes, const float *xd,
                                          const int32_t *xs, int rows, int64_t k, int64_t blocks, float *out) {
    if (planes == 2) {
        switch (rows) {
        ROWS_CASE(1, 2)
#if PASS_PLANES >= 8
        ROWS_CASE(2, 2)
        ROWS_CASE(3, 2)
        default: DOT_GROUP_ROWS(group, scales, minimums, type, xq, 2, xd, xs, 4, k, blocks, out); break;
#else
        default: DOT_GROUP_ROWS(group, scales, minimums, type, xq, 2, xd, xs, 2, k, blocks, out); break;
#endif
        }
        return;
    }
    switch (rows) {
    ROWS_CASE(1, 1)
    ROWS_CASE(2, 1)
    ROWS_CASE(3, 1)
#if PASS_PLANES >= 8
    ROWS_CASE(4, 1)
    ROWS_CASE(5, 1)
    ROWS_CASE(6, 1)
    ROWS_CASE(7, 1)
    default: DOT_GROUP_ROWS(group, scales, minimums, type, xq, 1, xd, xs, 8, k, blocks, out); break;
#else
    default: DOT_GROUP_ROWS(group, scales, minimums, type, xq, 1, xd, xs, 4, k, blocks, out); break;
#endif
    }
}
#undef ROWS_CASE

static void dot_group(const uint8_t *group, const uint16_t *scales, const uint16_t *minimums, int type,
                      const int8_t *xq, int planes, const float *xd, const int32_t *xs, int rows, int64_t k,
                      int64_t blocks, float *out) {
    if (type == BLOCK_Q8_0)
        dot_group_typed(group, scales, minimums, BLOCK_Q8_0, xq, planes, xd, xs, rows, k, blocks, out);
    else if (type == BLOCK_Q4_0)
        dot_group_typed(group, scales, minimums, BLOCK_Q4_0, xq, planes, xd, xs, rows, k, blocks, out);
    else
        dot_group_typed(group, scales, minimums, BLOCK_Q4_1, xq, planes, xd, xs, rows, k, blocks, out);
}
#endif

#if BLOCK_SIMD && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define BLOCK_AMX 1
/* ---- AMX: one TDPBSSD per (group, block) for up to 16 planes of activations ---- */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} block_tile_config;

/* tmm0, tmm1: two sets of 16 planes' totals (16 x 16 int32); tmm2, tmm3: their activations (16
 * planes x 32 bytes: one block); tmm4: the block's weights (8 rows of 64 bytes, K = 32). Thread
 * state: every thread configures its own. */
static void block_amx_configure(void) {
    block_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 4; t++) {
        config.rows[t] = 16;
        config.colsb[t] = t < 2 ? 64 : 32;
    }
    config.rows[4] = 8;
    config.colsb[4] = 64;
    _tile_loadconfig(&config);
}

/* A 4-bit (group, block) as AMX's weight tile: 8 rows of 64 signed bytes (Q4_0: q - 8). */
static inline void unpack_nibbles(const uint8_t *block, int type, int8_t *tile) {
    const __m512i mask = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(8);
    for (int v = 0; v < 4; v++) {
        __m512i packed = _mm512_loadu_si512((const void *)(block + 64 * v));
        __m512i low = _mm512_and_si512(packed, mask), high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
        if (type == BLOCK_Q4_0) {
            low = _mm512_sub_epi8(low, eight);
            high = _mm512_sub_epi8(high, eight);
        }
        _mm512_storeu_si512((void *)(tile + 64 * v), low);
        _mm512_storeu_si512((void *)(tile + 64 * (v + 4)), high);
    }
}

/* acc[r] (16 lanes) + block b's terms for `count` rows whose plane totals are sums[r * planes + p]:
 * the reference sequence, 16 outputs side by side. */
static inline void amx_accumulate(const int32_t *sums, int planes, int count, const uint16_t *scales,
                                  const uint16_t *minimums, int type, const float *xd, const int32_t *xs,
                                  int64_t blocks, int64_t b, __m512 *acc) {
    __m512 weight_scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + b * GROUP_OUT)));
    __m512 weight_min = _mm512_setzero_ps();
    if (type == BLOCK_Q4_1)
        weight_min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(minimums + b * GROUP_OUT)));
    for (int r = 0; r < count; r++) {
        __m512i total = _mm512_loadu_si512((const void *)(sums + r * planes * GROUP_OUT));
        if (planes == 2) {
            __m512i low = _mm512_loadu_si512((const void *)(sums + (2 * r + 1) * GROUP_OUT));
            total = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(total, 8), total), low);
        }
        __m512 x_scale = _mm512_set1_ps(xd[r * blocks + b]);
        __m512 term = _mm512_mul_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(weight_scale, x_scale));
        acc[r] = _mm512_add_ps(acc[r], term);
        if (type == BLOCK_Q4_1) {
            __m512 min_term = _mm512_mul_ps(_mm512_mul_ps(weight_min, x_scale), _mm512_set1_ps((float)xs[r * blocks + b]));
            acc[r] = _mm512_add_ps(acc[r], min_term);
        }
    }
}

#define AMX_PLANES 32 /* planes a pass: two activation tiles against one weight tile */

/* One group of 16 outputs for `count` rows (count * planes <= AMX_PLANES) of the padded planes xq:
 * out[r * 16 + lane]. */
static void amx_group_rows(const uint8_t *group, const uint16_t *scales, const uint16_t *minimums, int type,
                           const int8_t *xq, int planes, const float *xd, const int32_t *xs, int count, int64_t k,
                           int64_t blocks, float *out) {
    __m512 acc[AMX_PLANES];
    for (int r = 0; r < count; r++) acc[r] = _mm512_setzero_ps();
    /* Two sets of totals: block b's tiles are stored while block b - 1's totals are scaled, so the
     * vector loads never wait on the tile store just issued. */
    int32_t sums[2][AMX_PLANES * GROUP_OUT] __attribute__((aligned(64)));
    int8_t tile[8 * 64] __attribute__((aligned(64)));
    const int two = count * planes > 16;
    const int64_t bytes = group_block_bytes(type);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = group + b * bytes;
        int32_t *totals = sums[b & 1];
        for (int64_t line = 0; line < bytes; line += 64)
            _mm_prefetch((const char *)(block + BLOCK_AHEAD + line), _MM_HINT_T0);
        if (type == BLOCK_Q8_0) {
            _tile_loadd(4, block, 64);
        } else {
            unpack_nibbles(block, type, tile);
            _tile_loadd(4, tile, 64);
        }
        _tile_zero(0);
        _tile_loadd(2, xq + b * QBLOCK, k);
        _tile_dpbssd(0, 2, 4);
        _tile_stored(0, totals, 64);
        if (two) {
            _tile_zero(1);
            _tile_loadd(3, xq + 16 * k + b * QBLOCK, k);
            _tile_dpbssd(1, 3, 4);
            _tile_stored(1, totals + 16 * GROUP_OUT, 64);
        }
        if (b > 0)
            amx_accumulate(sums[(b - 1) & 1], planes, count, scales, minimums, type, xd, xs, blocks, b - 1, acc);
    }
    amx_accumulate(sums[(blocks - 1) & 1], planes, count, scales, minimums, type, xd, xs, blocks, blocks - 1, acc);
    for (int r = 0; r < count; r++) _mm512_storeu_ps(out + GROUP_OUT * r, acc[r]);
}

static int block_amx_min_planes = 8; /* calls of fewer planes (rows x planes) take the VNNI loop */
int dovetail_block_amx_ready(void) { return dovetail_int8_amx_ready(); }
#else
#define BLOCK_AMX 0
int dovetail_block_amx_ready(void) { return 0; }
#endif

/* Calls of at least `planes` activation planes (rows x 1 or 2) take the AMX path where the build
 * and the CPU have one (benchmarks and tests move it; the bits are the same either way). */
void dovetail_block_amx_from(int planes) {
#if BLOCK_AMX
    block_amx_min_planes = planes;
#else
    (void)planes;
#endif
}

/* One group's outputs for rows m .. m + count (count * planes within a pass): into out[r * 16 + o]. */
static void group_rows(const uint8_t *group, const uint16_t *scales, const uint16_t *minimums, int type,
                       const int8_t *xq, int planes, const float *xd, const int32_t *xs, int count, int use_amx,
                       int64_t k, float *out) {
    int64_t blocks = k / QBLOCK;
#if BLOCK_AMX
    if (use_amx) {
        amx_group_rows(group, scales, minimums, type, xq, planes, xd, xs, count, k, blocks, out);
        return;
    }
#endif
    (void)use_amx;
#if BLOCK_SIMD
    dot_group(group, scales, minimums, type, xq, planes, xd, xs, count, k, blocks, out);
#else
    for (int r = 0; r < count; r++)
        for (int o = 0; o < GROUP_OUT; o++)
            out[GROUP_OUT * r + o] = dot_one(group, scales, minimums, type, o, xq + r * planes * k, planes,
                                             xd + r * blocks, xs + r * blocks, k, blocks);
#endif
}

/* y for groups [g0, g1) of 16 outputs: every pass of rows through each group's stream. */
static void linear_groups(const int8_t *xq, const float *xd, const int32_t *xs, int64_t rows, int planes,
                          const uint8_t *w, const uint16_t *scales, const uint16_t *minimums, int type,
                          const float *bias, float *y, int64_t n_out, int64_t k, int64_t g, int use_amx) {
    int64_t blocks = k / QBLOCK;
    const uint8_t *group = w + g * blocks * group_block_bytes(type);
    const uint16_t *group_scales = scales + g * blocks * GROUP_OUT;
    const uint16_t *group_mins = minimums ? minimums + g * blocks * GROUP_OUT : NULL;
    int outputs = n_out - g * GROUP_OUT < GROUP_OUT ? (int)(n_out - g * GROUP_OUT) : GROUP_OUT;
#if BLOCK_AMX
    const int step = use_amx ? AMX_PLANES / planes : PASS_PLANES / planes; /* rows a pass */
    float out[AMX_PLANES * GROUP_OUT];
#elif BLOCK_SIMD
    const int step = PASS_PLANES / planes;
    float out[PASS_PLANES * GROUP_OUT];
#else
    const int step = GROUP_ROWS / planes;
    float out[GROUP_ROWS * GROUP_OUT];
#endif
    for (int64_t m = 0; m < rows; m += step) {
        int count = rows - m < step ? (int)(rows - m) : step;
        group_rows(group, group_scales, group_mins, type, xq + m * planes * k, planes, xd + m * blocks,
                   xs + m * blocks, count, use_amx, k, out);
        for (int r = 0; r < count; r++)
            for (int o = 0; o < outputs; o++) {
                float value = out[GROUP_OUT * r + o];
                y[(m + r) * n_out + g * GROUP_OUT + o] = bias ? value + bias[g * GROUP_OUT + o] : value;
            }
    }
}

#if BLOCK_ZMM
/* A copy of the activation planes as unsigned bytes x + 128 (x XOR 0x80), for Q8_0's dpbusd; NULL
 * when out of memory. */
static int8_t *offset_activations(const int8_t *xq, int64_t count) {
    int8_t *offset = (int8_t *)malloc((size_t)count);
    if (offset == NULL) return NULL;
    for (int64_t i = 0; i < count; i++) offset[i] = (int8_t)((uint8_t)xq[i] ^ 0x80u);
    return offset;
}

/* Q4_0's -8 sum(x) per row and block (what dot(q - 8, x) needs beside dot(q, x)), for
 * block_totals_zmm to start from; NULL when out of memory. */
static int32_t *q4_0_starts(const int32_t *xs, int64_t count) {
    int32_t *starts = (int32_t *)malloc((size_t)count * sizeof *starts);
    if (starts == NULL) return NULL;
    for (int64_t i = 0; i < count; i++) starts[i] = -8 * xs[i];
    return starts;
}
#endif

/* y[rows, n_out] for activations quantized by dovetail_quantize_blocks with `planes` planes (1 or
 * 2). Weights, scales and minimums (Q4_1 only) in the layout above; bias may be NULL. Returns -1
 * for an unknown type or plane count, or a k that is not a multiple of 32, DOVETAIL_NO_MEMORY when
 * a scratch copy (AMX's padded activations, the AVX-512 path's offset ones or Q4_0 starts) could not
 * be allocated. */
int dovetail_block_linear(const int8_t *xq, const float *xd, const int32_t *xs, int64_t rows, int planes,
                          const uint8_t *w, const uint16_t *scales, const uint16_t *minimums, int type,
                          const float *bias, float *y, int64_t n_out, int64_t k, int threads) {
    if (k % QBLOCK != 0 || type < BLOCK_Q8_0 || type > BLOCK_Q4_1 || planes < 1 || planes > 2) return -1;
    if (type == BLOCK_Q4_1 && minimums == NULL) return -1;
    int64_t groups = (n_out + GROUP_OUT - 1) / GROUP_OUT;
    int use_amx = 0;
    int8_t *padded = NULL;
#if BLOCK_AMX
    use_amx = rows * planes >= block_amx_min_planes && dovetail_block_amx_ready();
    if (use_amx && (rows * planes) % 16 != 0) { /* activation tiles are 16 planes tall: pad with zeros */
        int64_t planes_total = rows * planes, full = (planes_total + 15) / 16 * 16;
        padded = (int8_t *)calloc((size_t)(full * k), 1);
        if (padded == NULL) return DOVETAIL_NO_MEMORY;
        memcpy(padded, xq, (size_t)(planes_total * k));
        xq = padded;
    }
#endif
#if BLOCK_ZMM
    int8_t *offset = NULL;
    if (type == BLOCK_Q8_0 && !use_amx) { /* block_totals_zmm takes Q8_0's activations as x + 128 */
        offset = offset_activations(xq, rows * planes * k);
        if (offset == NULL) {
            free(padded);
            return DOVETAIL_NO_MEMORY;
        }
        xq = offset;
    }
    int32_t *starts = NULL;
    if (type == BLOCK_Q4_0 && !use_amx) { /* block_totals_zmm's Q4_0 sums start from -8 sum(x) */
        starts = q4_0_starts(xs, rows * (k / QBLOCK));
        if (starts == NULL) {
            free(padded);
            return DOVETAIL_NO_MEMORY;
        }
        xs = starts;
    }
#endif
#pragma omp parallel num_threads(threads)
    {
#if BLOCK_AMX
        if (use_amx) block_amx_configure();
#endif
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++)
            linear_groups(xq, xd, xs, rows, planes, w, scales, minimums, type, bias, y, n_out, k, g, use_amx);
#if BLOCK_AMX
        if (use_amx) _tile_release();
#endif
    }
    free(padded);
#if BLOCK_ZMM
    free(offset);
    free(starts);
#endif
    return 0;
}
