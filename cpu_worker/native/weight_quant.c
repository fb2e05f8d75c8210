/* Load-time weight quantizers: a checkpoint's fp32, fp16 or bf16 rows into per-row int8
 * (dovetail_quantize_weight_rows) or into llama.cpp's blocks in the block kernel's layout
 * (dovetail_quantize_weight_layout). Each keeps the arithmetic of the torch ops it replaced, bit for
 * bit (tests/unit/test_int8_kernel.py, test_block_quant.py), on every build; what they buy is time:
 * a 7B load is a pass over 13 GB of fp16, and these run once per weight at memory speed.
 */
#include "dovetail.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* An fp16 value as fp32, exactly (normal, subnormal, zero, inf and nan alike): the plain C
 * twin of F16C's conversion, so every build widens a checkpoint's weights to the same floats. */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13); /* rebias 15 -> 127 */
    } else {
        float value = (float)mantissa * 5.9604644775390625e-8f; /* mantissa * 2^-24: exact (zero included) */
        memcpy(&bits, &value, sizeof bits);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* k values of a row stored as fp16 or bf16 (DOVETAIL_DTYPE_*) into fp32, exactly. */
static void widen_row(const uint16_t *row, int dtype, int64_t k, float *out) {
    int64_t i = 0;
    if (dtype == DOVETAIL_DTYPE_BF16) {
        for (; i < k; i++) {
            uint32_t bits = (uint32_t)row[i] << 16;
            memcpy(out + i, &bits, sizeof bits);
        }
        return;
    }
#if defined(__F16C__)
    for (; i + 8 <= k; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + i))));
#endif
    for (; i < k; i++) out[i] = half_to_float(row[i]);
}

/* fp16 rows as fp32 (tests: every one of the 65536 values against torch's conversion). */
void dovetail_widen_half(const uint16_t *h, float *out, int64_t n) { widen_row(h, DOVETAIL_DTYPE_FP16, n, out); }

/* Runs body(row, n, context) on every row of w [n_rows, k] as fp32, on `threads` threads: fp32 rows
 * as they lie, fp16 and bf16 rows widened a row at a time into a buffer of the thread's (exactly, as
 * torch widens them: converting a 7B model to fp32 first was 4.4 s of its 32 s load). Returns
 * DOVETAIL_NO_MEMORY if a row buffer could not be allocated. */
typedef void (*row_body)(const float *row, int64_t n, void *context);

static int for_each_wide_row(const void *w, int dtype, int64_t n_rows, int64_t k, int threads, row_body body,
                             void *context) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(|| : failed)
    {
        float *wide = dtype == DOVETAIL_DTYPE_FP32 ? NULL : (float *)malloc((size_t)k * sizeof(float));
        if (dtype != DOVETAIL_DTYPE_FP32 && wide == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < n_rows; n++) {
            if (dtype != DOVETAIL_DTYPE_FP32 && wide == NULL) continue;
            const float *row = (const float *)w + n * k;
            if (dtype != DOVETAIL_DTYPE_FP32) {
                widen_row((const uint16_t *)w + n * k, dtype, k, wide);
                row = wide;
            }
            body(row, n, context);
        }
        free(wide);
    }
    return failed ? DOVETAIL_NO_MEMORY : 0;
}

typedef struct {
    int8_t *q;
    float *scale;
    int64_t k;
} per_row_output;

static void quantize_per_row(const float *row, int64_t n, void *context) {
    per_row_output *o = (per_row_output *)context;
    float amax = 0.0f;
    for (int64_t i = 0; i < o->k; i++) amax = fabsf(row[i]) > amax ? fabsf(row[i]) : amax;
    float s = amax / 127.0f;
    s = s < 1e-12f ? 1e-12f : s;
    o->scale[n] = s;
    float inverse = 1.0f / s;
    int8_t *out = o->q + n * o->k;
    for (int64_t i = 0; i < o->k; i++) {
        float v = nearbyintf(row[i] * inverse);
        out[i] = (int8_t)(v > 127.0f ? 127.0f : (v < -128.0f ? -128.0f : v));
    }
}

/* Load time: symmetric per-row int8 weights, as torch.quantize_per_channel gives them (it is
 * 10x slower: half of a 7B target's load). scale[n] = max|w[n]| / 127 in fp32, at least 1e-12;
 * q = nearbyint(w * (1 / scale)) clamped to [-128, 127], fbgemm's Quantize arithmetic (checked
 * against torch in tests/unit/test_int8_kernel.py). w: [n_rows, k], fp32, or fp16 or bf16 as a
 * checkpoint stores it (dtype: DOVETAIL_DTYPE_*, for_each_wide_row). Returns DOVETAIL_NO_MEMORY if
 * a row buffer could not be allocated. */
int dovetail_quantize_weight_rows(const void *w, int dtype, int8_t *q, float *scale, int64_t n_rows, int64_t k,
                                  int threads) {
    per_row_output output = {q, scale, k};
    return for_each_wide_row(w, dtype, n_rows, k, threads, quantize_per_row, &output);
}

/* One block of 32 by llama.cpp's reference arithmetic (dovetail_quantize_weight_layout says how):
 * the stored integers into q, the scale into *scale, Q4_1's minimum into *minimum. */
static void quantize_block_plain(const float *x, int type, int32_t q[32], float *scale, float *minimum) {
    float d, inverse;
    if (type == DOVETAIL_BLOCK_Q8_0) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        d = amax / 127.0f;
        inverse = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; i++) q[i] = (int32_t)roundf(x[i] * inverse);
    } else if (type == DOVETAIL_BLOCK_Q4_0) {
        int at = 0;
        for (int i = 1; i < 32; i++) at = fabsf(x[i]) > fabsf(x[at]) ? i : at;
        d = x[at] / -8.0f;
        inverse = d != 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; i++) {
            float v = truncf(x[i] * inverse + 8.5f);
            q[i] = (int32_t)(v > 15.0f ? 15.0f : v);
        }
    } else {
        float low = x[0], high = x[0];
        for (int i = 1; i < 32; i++) {
            low = x[i] < low ? x[i] : low;
            high = x[i] > high ? x[i] : high;
        }
        d = (high - low) / 15.0f;
        inverse = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; i++) {
            float v = truncf((x[i] - low) * inverse + 0.5f);
            q[i] = (int32_t)(v > 15.0f ? 15.0f : v);
        }
        *minimum = low;
    }
    *scale = d;
}

#if defined(__AVX2__)
/* quantize_block_plain 8 lanes at a time, every step the same float operation (multiply, then add:
 * -ffp-contract=off), so the same bits. Blocks where a reduction's answer could depend on the order
 * of its inputs (a NaN; Q4_1's minimum or maximum a zero, whose sign the scan order picks) go to the
 * plain loop. Out-of-range conversions give INT_MIN on both paths (cvttps2dq and cvttss2si alike). */
static void quantize_block(const float *x, int type, int32_t q[32], float *scale, float *minimum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], low = _mm256_loadu_ps(x), high = low, amax = _mm256_setzero_ps();
    int unordered = 0;
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        unordered |= _mm256_movemask_ps(_mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        low = _mm256_min_ps(low, v[j]);
        high = _mm256_max_ps(high, v[j]);
    }
    if (unordered) {
        quantize_block_plain(x, type, q, scale, minimum);
        return;
    }
    float lanes[8], reduced = 0.0f;
    const __m256 fifteen = _mm256_set1_ps(15.0f);
    __m256 inverse, offset = _mm256_setzero_ps(), shift = _mm256_setzero_ps();
    if (type == DOVETAIL_BLOCK_Q8_0 || type == DOVETAIL_BLOCK_Q4_0) {
        _mm256_storeu_ps(lanes, amax);
        reduced = lanes[0];
        for (int i = 1; i < 8; i++) reduced = lanes[i] > reduced ? lanes[i] : reduced;
    }
    if (type == DOVETAIL_BLOCK_Q8_0) {
        float d = reduced / 127.0f;
        *scale = d;
        inverse = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    } else if (type == DOVETAIL_BLOCK_Q4_0) {
        unsigned first = 0; /* the first input of the largest magnitude sets the sign */
        for (int j = 3; j >= 0; j--)
            first = first << 8 | (unsigned)_mm256_movemask_ps(
                _mm256_cmp_ps(_mm256_andnot_ps(sign, v[j]), _mm256_set1_ps(reduced), _CMP_EQ_OQ));
        float d = x[__builtin_ctz(first)] / -8.0f;
        *scale = d;
        inverse = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        offset = _mm256_set1_ps(8.5f);
    } else {
        float lo[8], hi[8];
        _mm256_storeu_ps(lo, low);
        _mm256_storeu_ps(hi, high);
        float least = lo[0], most = hi[0];
        for (int i = 1; i < 8; i++) {
            least = lo[i] < least ? lo[i] : least;
            most = hi[i] > most ? hi[i] : most;
        }
        if (least == 0.0f || most == 0.0f) {
            quantize_block_plain(x, type, q, scale, minimum);
            return;
        }
        float d = (most - least) / 15.0f;
        *scale = d;
        *minimum = least;
        inverse = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        offset = _mm256_set1_ps(0.5f);
        shift = _mm256_set1_ps(least);
    }
    for (int j = 0; j < 4; j++) {
        __m256 r;
        if (type == DOVETAIL_BLOCK_Q8_0) { /* roundf: truncate, then away from zero on a fraction >= 1/2 */
            __m256 product = _mm256_mul_ps(v[j], inverse);
            __m256 whole = _mm256_round_ps(product, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            __m256 fraction = _mm256_andnot_ps(sign, _mm256_sub_ps(product, whole)); /* exact */
            __m256 up = _mm256_cmp_ps(fraction, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
            __m256 away = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(product, sign));
            r = _mm256_add_ps(whole, _mm256_and_ps(up, away));
        } else { /* min(trunc((x - m) * (1 / d) + offset), 15); min(15, NaN) keeps the NaN, as the C does */
            __m256 scaled = _mm256_mul_ps(type == DOVETAIL_BLOCK_Q4_1 ? _mm256_sub_ps(v[j], shift) : v[j], inverse);
            r = _mm256_round_ps(_mm256_add_ps(scaled, offset), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            r = _mm256_min_ps(fifteen, r);
        }
        _mm256_storeu_si256((__m256i *)(q + 8 * j), _mm256_cvttps_epi32(r));
    }
}
#else
#define quantize_block quantize_block_plain
#endif

typedef struct {
    int type;
    uint8_t *data;
    float *d, *m;
    int64_t k;
} layout_output;

/* One row's blocks, each written where the kernel reads it (block_gemv.c's layout): row n is lane
 * n % 16 of group n / 16; in a (group, block), chunk c of 4 inputs holds the 16 lanes' 4 bytes side
 * by side, 64 bytes a chunk; 4-bit values pair chunk v (low nibble) with chunk v + 4 (high). */
static void quantize_row_layout(const float *row, int64_t n, void *context) {
    layout_output *o = (layout_output *)context;
    int64_t blocks = o->k / 32, block_bytes = o->type == DOVETAIL_BLOCK_Q8_0 ? 512 : 256;
    uint8_t *group = o->data + (n / 16) * blocks * block_bytes + (n % 16) * 4;
    for (int64_t b = 0; b < blocks; b++) {
        int32_t q[32];
        quantize_block(row + 32 * b, o->type, q, o->d + n * blocks + b, o->m + n * blocks + b);
        uint8_t *lane = group + b * block_bytes;
        if (o->type == DOVETAIL_BLOCK_Q8_0)
            for (int c = 0; c < 8; c++)
                for (int j = 0; j < 4; j++) lane[64 * c + j] = (uint8_t)(int8_t)q[4 * c + j];
        else
            for (int v = 0; v < 4; v++)
                for (int j = 0; j < 4; j++) lane[64 * v + j] = (uint8_t)(q[4 * v + j] | (q[4 * v + 16 + j] << 4));
    }
}

/* Load time: llama.cpp's reference block quantizers (quantize_row_q8_0/q4_0/q4_1_ref) on blocks
 * of 32, the same float32 arithmetic step by step as block_quant.BlockWeights._torch_quantize_rows
 * (tests/unit/test_block_quant.py holds them to the same bits): per block, Q8_0 d = max|x| / 127,
 * q = roundf(x * (1 / d)); Q4_0 d = x[first argmax |x|] / -8, q = min(trunc(x * (1 / d) + 8.5), 15);
 * Q4_1 d = (max - min) / 15, m = min, q = min(trunc((x - m) * (1 / d) + 0.5), 15); 1 / d taken as 0
 * where d is 0. The integers go straight into the kernel's layout (block_quant.interleave's bytes),
 * so a load makes no int16 copy, no GGUF-ordered copy and no regrouping pass. w: [n_rows, k] (dtype
 * DOVETAIL_DTYPE_*, for_each_wide_row), k % 32 == 0; data: [ceil(n_rows / 16), k / 32, 512 (Q8_0)
 * or 256] bytes, the lanes of a last partial group left as they are (the caller zeroes them);
 * d, m: [n_rows, k / 32] (m: Q4_1 only, else unused). */
int dovetail_quantize_weight_layout(const void *w, int dtype, int type, uint8_t *data, float *d, float *m,
                                    int64_t n_rows, int64_t k, int threads) {
    layout_output output = {type, data, d, m, k};
    return for_each_wide_row(w, dtype, n_rows, k, threads, quantize_row_layout, &output);
}

