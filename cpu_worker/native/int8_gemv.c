/* W8A8 int8 linear for decoding and small trees: y[m, n] = acc[m, n] * x_scale[m] * w_scale[n] (+ bias[n]),
 * acc = sum_k xq[m, k] * w[n, k] accumulated exactly in int32.
 *
 * Why our own: torch's int8 kernels (fbgemm's dynamic linear, weight-only int8pack) stream the
 * weights well below the read bandwidth when decoding one row, llama.cpp's Q8_0 near it. A
 * decode step is a stream over the weights; this kernel reads each weight byte once and reuses a
 * block of 4 weight rows (L1-resident) for every activation row of the call; the weights are
 * [n_out, k] or packed per block (see block_row), or, on CPUs with AMX, in tiles for AMX's tile
 * multiply (see TILE_OUT). On VNNI CPUs calls of 24 rows or more on [n_out, k] weights go to
 * torch's int8 GEMM instead (int8_kernel.py), with the same integers.
 *
 * Row independence (what makes Dovetail lossless at int8): a row's quantization uses only that
 * row, integer sums are exact, and the float epilogue is elementwise (built with
 * -ffp-contract=off, so no fused multiply-add depends on how the compiler vectorised it).
 * The AVX512-VNNI, AVX2 and plain C paths give the same bits for activations u = q + 128 in 1..255
 * (|q| <= 127, which dovetail_quantize_rows guarantees; the AVX2 sign trick cannot negate -128).
 *
 * VNNI multiplies unsigned by signed bytes, so activations are stored as u = q + 128 and the VNNI
 * and plain C paths subtract 128 * sum_k w[n, k] (precomputed per row; the AVX2 path sums q * w
 * directly): |acc| <= K * 255 * 127 fits int32 for K < 66,000.
 *
 * The measurements behind each choice here (layouts, prefetch distances, row passes, the AVX2
 * sign trick): docs/kernels.md, "int8 linear" and "int8 layouts"; python -m tools.bench_int8_kernel.
 */
#include "dovetail.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define DOVETAIL_VNNI 1
#else
#define DOVETAIL_VNNI 0
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#endif

int dovetail_int8_has_vnni(void) { return DOVETAIL_VNNI; }

/* The dot-product path this build runs: AVX512-VNNI (DOVETAIL_SIMD_AVX512), AVX2 or plain C. */
int dovetail_int8_simd(void) {
#if DOVETAIL_VNNI
    return DOVETAIL_SIMD_AVX512;
#elif defined(__AVX2__)
    return DOVETAIL_SIMD_AVX2;
#else
    return DOVETAIL_SIMD_PLAIN;
#endif
}

/* max_i |row[i]| (exact in any order). */
static inline float absolute_max(const float *row, int64_t k) {
    float amax = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        float a = fabsf(row[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* Per-row symmetric quantization: q = round(x * 127 / max|x|) as u8 = q + 128; scale[m] = max|x| / 127. */
void dovetail_quantize_rows(const float *x, uint8_t *xu, float *scale, int64_t rows, int64_t k) {
    for (int64_t m = 0; m < rows; m++) {
        const float *row = x + m * k;
        float amax = absolute_max(row, k);
        float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        scale[m] = amax / 127.0f;
        uint8_t *out = xu + m * k;
        for (int64_t i = 0; i < k; i++) {
            float q = nearbyintf(row[i] * inverse);
            q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
            out[i] = (uint8_t)((int32_t)q + 128);
        }
    }
}

/* [n_rows, k] int8 -> the tile layout (int8_kernel.pack_tiles, TILE_OUT below): four bytes at
 * a time; needs n_rows % 16 == 0 and k % 64 == 0. */
void dovetail_pack_tiles(const int8_t *w, int8_t *tiles, int64_t n_rows, int64_t k, int threads) {
    int64_t blocks = n_rows / 16, chunks = k / 64;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t c = 0; c < chunks; c++) {
            int8_t *tile = tiles + (b * chunks + c) * 1024;
            for (int g = 0; g < 16; g++)
                for (int j = 0; j < 16; j++) memcpy(tile + 64 * g + 4 * j, w + (b * 16 + j) * k + 64 * c + 4 * g, 4);
        }
}

/* 128 * sum_k w[n, k] per output row: the correction for the +128 offset of the activations. */
void dovetail_weight_offsets(const int8_t *w, int32_t *offset, int64_t n_rows, int64_t k) {
    for (int64_t n = 0; n < n_rows; n++) {
        int32_t sum = 0;
        for (int64_t i = 0; i < k; i++) sum += w[n * k + i];
        offset[n] = 128 * sum;
    }
}

/* Two weight layouts. Rows: w[n_out, k] as the model holds it. Packed (packed != 0; needs
 * n_out % 4 == 0 and k % 64 == 0): each block of 4 output rows is one contiguous run of
 * 64-byte chunks, row r's columns [64c, 64c + 64) at 256c + 64r (int8_kernel.pack_blocks).
 * Why packed: a block's 4 rows are then one sequential stream per thread instead of 4 streams
 * that restart every k bytes. Where rows are short the hardware prefetcher never gets going on
 * the latter. The sums are the same integers either way. */

/* Row r (< 4) of a block, from column i (a multiple of 32 in SIMD loops). */
static inline const int8_t *block_row(const int8_t *block, int r, int64_t i, int64_t k, int packed) {
    return packed ? block + ((i >> 6) << 8) + ((int64_t)r << 6) + (i & 63) : block + r * k + i;
}

#ifndef DOVETAIL_PACKED_AHEAD /* bytes; a build flag for tuning (other distances were slower) */
#define DOVETAIL_PACKED_AHEAD 1024
#endif
#if DOVETAIL_VNNI || defined(__AVX2__)
/* Keep more lines in flight than the loads alone ask for. Rows: the next block's four rows, a
 * line ahead each from column i (eight streams instead of four). Packed: the stream's next 4
 * lines, 1 KB ahead.
 * always_inline is load-bearing: as a plain function GCC 12 finds it "looping const" (a prefetch
 * has no semantic effect) and deletes every call, as it did from a6d3fc9 until b3e12a3;
 * tests/unit/test_int8_kernel.py checks the built assembly still prefetches. */
static inline __attribute__((always_inline)) void prefetch_ahead(const int8_t *block, int64_t k, int64_t i,
                                                                 int packed) {
    if (packed) {
        const char *ahead = (const char *)(block + 4 * i + DOVETAIL_PACKED_AHEAD);
        for (int line = 0; line < 4; line++) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    } else {
        for (int r = 4; r < 8; r++) _mm_prefetch((const char *)(block + r * k + i), _MM_HINT_T0);
    }
}
#endif

#if DOVETAIL_VNNI
/* acc for output rows n0..n0+3 (count valid) and one activation row. */
static inline __attribute__((always_inline)) void dot4_impl(const uint8_t *xu, const int8_t *w, int64_t k, int count,
                                                            int32_t out[4], const int packed) {
    __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
    __m512i acc2 = _mm512_setzero_si512(), acc3 = _mm512_setzero_si512();
    int r1 = count > 1 ? 1 : 0, r2 = count > 2 ? 2 : 0, r3 = count > 3 ? 3 : 0;
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        prefetch_ahead(w, k, i, packed);
        __m512i xv = _mm512_loadu_si512((const void *)(xu + i));
        acc0 = _mm512_dpbusd_epi32(acc0, xv, _mm512_loadu_si512((const void *)block_row(w, 0, i, k, packed)));
        acc1 = _mm512_dpbusd_epi32(acc1, xv, _mm512_loadu_si512((const void *)block_row(w, r1, i, k, packed)));
        acc2 = _mm512_dpbusd_epi32(acc2, xv, _mm512_loadu_si512((const void *)block_row(w, r2, i, k, packed)));
        acc3 = _mm512_dpbusd_epi32(acc3, xv, _mm512_loadu_si512((const void *)block_row(w, r3, i, k, packed)));
    }
    if (i < k) { /* rows layout only: packed k is a multiple of 64 */
        __mmask64 mask = (~(__mmask64)0) >> (64 - (k - i));
        __m512i xv = _mm512_maskz_loadu_epi8(mask, xu + i);
        acc0 = _mm512_dpbusd_epi32(acc0, xv, _mm512_maskz_loadu_epi8(mask, w + i));
        acc1 = _mm512_dpbusd_epi32(acc1, xv, _mm512_maskz_loadu_epi8(mask, w + r1 * k + i));
        acc2 = _mm512_dpbusd_epi32(acc2, xv, _mm512_maskz_loadu_epi8(mask, w + r2 * k + i));
        acc3 = _mm512_dpbusd_epi32(acc3, xv, _mm512_maskz_loadu_epi8(mask, w + r3 * k + i));
    }
    out[0] = _mm512_reduce_add_epi32(acc0);
    out[1] = _mm512_reduce_add_epi32(acc1);
    out[2] = _mm512_reduce_add_epi32(acc2);
    out[3] = _mm512_reduce_add_epi32(acc3);
}

/* The same for two activation rows at once: each weight load feeds two products, and eight
 * independent accumulators hide the dot product's latency (trees verify several rows). */
static inline __attribute__((always_inline)) void dot4x2_impl(const uint8_t *xa, const uint8_t *xb, const int8_t *w,
                                                              int64_t k, int count, int prefetch, int32_t out_a[4],
                                                              int32_t out_b[4], const int packed) {
    (void)prefetch; /* the weights come from L1 or L2 */
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512(), a2 = _mm512_setzero_si512();
    __m512i a3 = _mm512_setzero_si512(), b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
    __m512i b2 = _mm512_setzero_si512(), b3 = _mm512_setzero_si512();
    int r1 = count > 1 ? 1 : 0, r2 = count > 2 ? 2 : 0, r3 = count > 3 ? 3 : 0;
    for (int64_t i = 0; i < k; i += 64) {
        __mmask64 mask = k - i >= 64 ? ~(__mmask64)0 : (~(__mmask64)0) >> (64 - (k - i));
        __m512i xva = _mm512_maskz_loadu_epi8(mask, xa + i), xvb = _mm512_maskz_loadu_epi8(mask, xb + i);
        __m512i wv0 = _mm512_maskz_loadu_epi8(mask, block_row(w, 0, i, k, packed));
        __m512i wv1 = _mm512_maskz_loadu_epi8(mask, block_row(w, r1, i, k, packed));
        __m512i wv2 = _mm512_maskz_loadu_epi8(mask, block_row(w, r2, i, k, packed));
        __m512i wv3 = _mm512_maskz_loadu_epi8(mask, block_row(w, r3, i, k, packed));
        a0 = _mm512_dpbusd_epi32(a0, xva, wv0);
        b0 = _mm512_dpbusd_epi32(b0, xvb, wv0);
        a1 = _mm512_dpbusd_epi32(a1, xva, wv1);
        b1 = _mm512_dpbusd_epi32(b1, xvb, wv1);
        a2 = _mm512_dpbusd_epi32(a2, xva, wv2);
        b2 = _mm512_dpbusd_epi32(b2, xvb, wv2);
        a3 = _mm512_dpbusd_epi32(a3, xva, wv3);
        b3 = _mm512_dpbusd_epi32(b3, xvb, wv3);
    }
    out_a[0] = _mm512_reduce_add_epi32(a0);
    out_a[1] = _mm512_reduce_add_epi32(a1);
    out_a[2] = _mm512_reduce_add_epi32(a2);
    out_a[3] = _mm512_reduce_add_epi32(a3);
    out_b[0] = _mm512_reduce_add_epi32(b0);
    out_b[1] = _mm512_reduce_add_epi32(b1);
    out_b[2] = _mm512_reduce_add_epi32(b2);
    out_b[3] = _mm512_reduce_add_epi32(b3);
}

/* The same for three activation rows in one pass. A call of 3 rows took a pair pass and then a
 * second pass over each L1-resident block for the third row, while memory idled; one pass of
 * twelve accumulators costs about what a pair does, and a tree of 3 is what the planner picks
 * most on a CPU. (Four rows in one pass were no faster than two pair passes: the dot products
 * start to count.) */
static inline __attribute__((always_inline)) void dot4x3_impl(const uint8_t *xa, const uint8_t *xb, const uint8_t *xc,
                                                              const int8_t *w, int64_t k, int count, int32_t out_a[4],
                                                              int32_t out_b[4], int32_t out_c[4], const int packed) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512(), a2 = _mm512_setzero_si512();
    __m512i a3 = _mm512_setzero_si512(), b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
    __m512i b2 = _mm512_setzero_si512(), b3 = _mm512_setzero_si512(), c0 = _mm512_setzero_si512();
    __m512i c1 = _mm512_setzero_si512(), c2 = _mm512_setzero_si512(), c3 = _mm512_setzero_si512();
    int r1 = count > 1 ? 1 : 0, r2 = count > 2 ? 2 : 0, r3 = count > 3 ? 3 : 0;
    for (int64_t i = 0; i < k; i += 64) {
        __mmask64 mask = k - i >= 64 ? ~(__mmask64)0 : (~(__mmask64)0) >> (64 - (k - i));
        __m512i xva = _mm512_maskz_loadu_epi8(mask, xa + i), xvb = _mm512_maskz_loadu_epi8(mask, xb + i);
        __m512i xvc = _mm512_maskz_loadu_epi8(mask, xc + i);
        __m512i wv = _mm512_maskz_loadu_epi8(mask, block_row(w, 0, i, k, packed));
        a0 = _mm512_dpbusd_epi32(a0, xva, wv);
        b0 = _mm512_dpbusd_epi32(b0, xvb, wv);
        c0 = _mm512_dpbusd_epi32(c0, xvc, wv);
        wv = _mm512_maskz_loadu_epi8(mask, block_row(w, r1, i, k, packed));
        a1 = _mm512_dpbusd_epi32(a1, xva, wv);
        b1 = _mm512_dpbusd_epi32(b1, xvb, wv);
        c1 = _mm512_dpbusd_epi32(c1, xvc, wv);
        wv = _mm512_maskz_loadu_epi8(mask, block_row(w, r2, i, k, packed));
        a2 = _mm512_dpbusd_epi32(a2, xva, wv);
        b2 = _mm512_dpbusd_epi32(b2, xvb, wv);
        c2 = _mm512_dpbusd_epi32(c2, xvc, wv);
        wv = _mm512_maskz_loadu_epi8(mask, block_row(w, r3, i, k, packed));
        a3 = _mm512_dpbusd_epi32(a3, xva, wv);
        b3 = _mm512_dpbusd_epi32(b3, xvb, wv);
        c3 = _mm512_dpbusd_epi32(c3, xvc, wv);
    }
    out_a[0] = _mm512_reduce_add_epi32(a0);
    out_a[1] = _mm512_reduce_add_epi32(a1);
    out_a[2] = _mm512_reduce_add_epi32(a2);
    out_a[3] = _mm512_reduce_add_epi32(a3);
    out_b[0] = _mm512_reduce_add_epi32(b0);
    out_b[1] = _mm512_reduce_add_epi32(b1);
    out_b[2] = _mm512_reduce_add_epi32(b2);
    out_b[3] = _mm512_reduce_add_epi32(b3);
    out_c[0] = _mm512_reduce_add_epi32(c0);
    out_c[1] = _mm512_reduce_add_epi32(c1);
    out_c[2] = _mm512_reduce_add_epi32(c2);
    out_c[3] = _mm512_reduce_add_epi32(c3);
}
#elif defined(__AVX2__)
/* AVX2 without VNNI, by llama.cpp's sign trick: with the signed q = u - 128 (u ^ 0x80),
 * q * w = |w| * sign(q, w), and _mm256_maddubs_epi16(|w| as u8, sign(q, w)) sums pairs of those
 * exactly in int16 (|q| <= 127, |w| <= 128: 2 * 127 * 128 < 32768), which _mm256_madd_epi16 with
 * ones widens to int32: 32 products in 5 operations per weight load, against 16 in 4 when
 * widening u8 and s8 to int16 for _mm256_madd_epi16. Its sums are of q * w already, so the epilogue skips the offset correction (DOT_SUMS_SIGNED). */
#define DOT_SUMS_SIGNED 1
static inline int32_t sum_lanes(__m256i v) {
    __m128i half = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0xb1));
    return _mm_cvtsi128_si32(half);
}
static inline __m256i signed_activations(const uint8_t *p) {
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p), _mm256_set1_epi8((char)0x80));
}
static inline __m256i signed_pair_dot(__m256i abs_w, __m256i w, __m256i q) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(q, w)), _mm256_set1_epi16(1));
}
static inline __m256i load_row(const int8_t *block, int r, int64_t i, int64_t k, int packed) {
    return _mm256_loadu_si256((const __m256i *)block_row(block, r, i, k, packed));
}
/* The columns past the last multiple of 32 (rows layout only), by the scalar rule. */
static inline int32_t tail_dot(const uint8_t *xu, const int8_t *row, int64_t from, int64_t k) {
    int32_t sum = 0;
    for (int64_t j = from; j < k; j++) sum += ((int32_t)xu[j] - 128) * (int32_t)row[j];
    return sum;
}
/* Rows past count alias row 0 (their sums are discarded), so the loops have a fixed shape and
 * the accumulators stay in registers (a loop over count kept them in memory: 13 GB/s at 1B). */
static inline __attribute__((always_inline)) void dot4_impl(const uint8_t *xu, const int8_t *w, int64_t k, int count,
                                                            int32_t out[4], const int packed) {
    int r1 = count > 1 ? 1 : 0, r2 = count > 2 ? 2 : 0, r3 = count > 3 ? 3 : 0;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        if ((i & 63) == 0) prefetch_ahead(w, k, i, packed);
        __m256i q = signed_activations(xu + i);
        __m256i w0 = load_row(w, 0, i, k, packed), w1 = load_row(w, r1, i, k, packed);
        __m256i w2 = load_row(w, r2, i, k, packed), w3 = load_row(w, r3, i, k, packed);
        a0 = _mm256_add_epi32(a0, signed_pair_dot(_mm256_abs_epi8(w0), w0, q));
        a1 = _mm256_add_epi32(a1, signed_pair_dot(_mm256_abs_epi8(w1), w1, q));
        a2 = _mm256_add_epi32(a2, signed_pair_dot(_mm256_abs_epi8(w2), w2, q));
        a3 = _mm256_add_epi32(a3, signed_pair_dot(_mm256_abs_epi8(w3), w3, q));
    }
    out[0] = sum_lanes(a0) + tail_dot(xu, w, i, k);
    out[1] = sum_lanes(a1) + tail_dot(xu, w + r1 * k, i, k);
    out[2] = sum_lanes(a2) + tail_dot(xu, w + r2 * k, i, k);
    out[3] = sum_lanes(a3) + tail_dot(xu, w + r3 * k, i, k);
}
/* Two activation rows against the same 4 weight rows: each weight load and |w| feed both. */
#define DOVETAIL_ROW_PAIR_STEP(r, acc_a, acc_b)                                      \
    do {                                                                            \
        __m256i wv = load_row(w, r, i, k, packed);                                  \
        __m256i abs_w = _mm256_abs_epi8(wv);                                        \
        acc_a = _mm256_add_epi32(acc_a, signed_pair_dot(abs_w, wv, qa));            \
        acc_b = _mm256_add_epi32(acc_b, signed_pair_dot(abs_w, wv, qb));            \
    } while (0)
static inline __attribute__((always_inline)) void dot4x2_impl(const uint8_t *xa, const uint8_t *xb, const int8_t *w,
                                                              int64_t k, int count, int prefetch, int32_t out_a[4],
                                                              int32_t out_b[4], const int packed) {
    int rows[4] = {0, count > 1 ? 1 : 0, count > 2 ? 2 : 0, count > 3 ? 3 : 0};
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        if (prefetch && (i & 63) == 0) prefetch_ahead(w, k, i, packed);
        __m256i qa = signed_activations(xa + i), qb = signed_activations(xb + i);
        DOVETAIL_ROW_PAIR_STEP(rows[0], a0, b0);
        DOVETAIL_ROW_PAIR_STEP(rows[1], a1, b1);
        DOVETAIL_ROW_PAIR_STEP(rows[2], a2, b2);
        DOVETAIL_ROW_PAIR_STEP(rows[3], a3, b3);
    }
    __m256i acc_a[4] = {a0, a1, a2, a3}, acc_b[4] = {b0, b1, b2, b3};
    for (int r = 0; r < 4; r++) {
        out_a[r] = sum_lanes(acc_a[r]) + tail_dot(xa, w + rows[r] * k, i, k);
        out_b[r] = sum_lanes(acc_b[r]) + tail_dot(xb, w + rows[r] * k, i, k);
    }
}
#undef DOVETAIL_ROW_PAIR_STEP
#else
static inline __attribute__((always_inline)) void dot4_impl(const uint8_t *xu, const int8_t *w, int64_t k, int count,
                                                            int32_t out[4], const int packed) {
    for (int r = 0; r < 4; r++) {
        int32_t sum = 0;
        if (r < count) {
            for (int64_t i = 0; i < k; i += 64) {
                const int8_t *chunk = block_row(w, r, i, k, packed);
                for (int64_t j = 0; j < 64 && i + j < k; j++) sum += (int32_t)xu[i + j] * (int32_t)chunk[j];
            }
        }
        out[r] = sum;
    }
}
static inline __attribute__((always_inline)) void dot4x2_impl(const uint8_t *xa, const uint8_t *xb, const int8_t *w,
                                                              int64_t k, int count, int prefetch, int32_t out_a[4],
                                                              int32_t out_b[4], const int packed) {
    (void)prefetch;
    dot4_impl(xa, w, k, count, out_a, packed);
    dot4_impl(xb, w, k, count, out_b, packed);
}
#endif

#ifndef DOT_SUMS_SIGNED
#define DOT_SUMS_SIGNED 0 /* the dot kernels sum u * w */
#endif

/* Each dot kernel is written once with `packed` a parameter (always inlined) and called where it
 * is a constant, so each layout gets its own loop with the addressing folded in. */
static void dot4(const uint8_t *xu, const int8_t *w, int64_t k, int count, int32_t out[4], int packed) {
    if (packed) {
#if DOVETAIL_VNNI
        /* VNNI, packed: the pair loop with the row as both operands. Its eight accumulators
         * stream a one-row call faster than dot4_impl's four (with or without its prefetches),
         * at the speed of a sum() of the bytes; the extra products are free where memory is
         * the bound. [N, K] rows keep dot4_impl, whose
         * prefetch of the next block's rows pays there at k = 2048. */
        int32_t twin[4];
        dot4x2_impl(xu, xu, w, k, count, 0, out, twin, 1);
#else
        dot4_impl(xu, w, k, count, out, 1);
#endif
    } else {
        dot4_impl(xu, w, k, count, out, 0);
    }
}
static void dot4x2(const uint8_t *xa, const uint8_t *xb, const int8_t *w, int64_t k, int count, int prefetch,
                   int32_t out_a[4], int32_t out_b[4], int packed) {
    if (packed)
        dot4x2_impl(xa, xb, w, k, count, prefetch, out_a, out_b, 1);
    else
        dot4x2_impl(xa, xb, w, k, count, prefetch, out_a, out_b, 0);
}

#if DOVETAIL_VNNI
static void dot4x3(const uint8_t *xa, const uint8_t *xb, const uint8_t *xc, const int8_t *w, int64_t k, int count,
                   int32_t out_a[4], int32_t out_b[4], int32_t out_c[4], int packed) {
    if (packed)
        dot4x3_impl(xa, xb, xc, w, k, count, out_a, out_b, out_c, 1);
    else
        dot4x3_impl(xa, xb, xc, w, k, count, out_a, out_b, out_c, 0);
}
#endif

/* ---- The tile layout (layout 2): AMX tiles, or VNNI on the same bytes ----
 * Each block of 16 output rows is one contiguous run of 1 KB tiles, one per 64 columns: byte
 * 64g + 4j + b of tile c holds w[16 * block + j, 64c + 4g + b] (g < 16 groups of 4 columns, j < 16
 * rows, b < 4); int8_kernel.pack_tiles. That is the B operand of AMX's TDPBUSD as one tile load
 * reads it, and for VNNI each 64-byte line is the 4-column dot of 16 output rows against one
 * broadcast group of 4 activation bytes: a block's 16 sums in one register. Needs n_out % 16 == 0
 * and k % 64 == 0. The integer sums are those of the other layouts, so are the bits.
 * Why: with AMX (Sapphire Rapids on), one TDPBUSD multiplies up to 16 activation rows by a 1 KB
 * tile in about the time VNNI takes for one row, so a tree of 16 rows streams its weights at
 * nearly the cost of a decode step, where the GEMV's cost grows with every pair of rows and
 * torch's int8 GEMM repacks its weight every call. */
#define TILE_OUT 16
#define TILE_BYTES 1024
static int tiles_amx_min_rows = 1; /* calls of fewer rows take the VNNI loop (dovetail_int8_tiles_amx_from) */

void dovetail_int8_tiles_amx_from(int rows) { tiles_amx_min_rows = rows; }

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && DOVETAIL_VNNI
#define DOVETAIL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
static int amx_permission = 0; /* 0: not asked yet, 1: granted, -1: refused */
/* Linux hands out AMX state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA). */
int dovetail_int8_amx_ready(void) {
    if (amx_permission == 0) amx_permission = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return amx_permission == 1;
}
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* tmm0, tmm1: two blocks' int32 sums (rows x 16); tmm2: activations (rows x 64 u8); tmm3, tmm4:
 * the two blocks' weight tiles. Per thread: the configuration is thread state. */
static void amx_configure(int rows) {
    amx_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 5; t++) {
        config.rows[t] = (uint8_t)(t < 3 ? rows : 16);
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

#ifndef DOVETAIL_TILES_AHEAD /* bytes of a block's stream prefetched ahead of the tile loads */
#define DOVETAIL_TILES_AHEAD 1024
#endif
#ifndef DOVETAIL_TILES_LINES
#define DOVETAIL_TILES_LINES 16
#endif
static inline __attribute__((always_inline)) void prefetch_tile(const int8_t *tile) {
    for (int line = 0; line < DOVETAIL_TILES_LINES; line++) _mm_prefetch((const char *)(tile + 64 * line), _MM_HINT_T0);
}
/* y for output blocks b0 (and b0 + 1 when two) over every activation group of 16 rows; xu holds
 * groups * 16 rows (padded). */
static inline void amx_block_pair(const uint8_t *xu, int64_t rows, const int8_t *w, int64_t k, int64_t b0, int two,
                                  int32_t sums[2][TILE_OUT * TILE_OUT], const float *x_scale, const float *w_scale,
                                  const int32_t *w_offset, const float *bias, float *y, int64_t n_out) {
    const int8_t *w0 = w + b0 * TILE_OUT * k, *w1 = w0 + TILE_OUT * k;
    int64_t chunks = k / 64;
    for (int64_t m0 = 0; m0 < rows; m0 += TILE_OUT) {
        const uint8_t *a = xu + m0 * k;
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            for (int64_t c = 0; c < chunks; c++) {
                prefetch_tile(w0 + c * TILE_BYTES + DOVETAIL_TILES_AHEAD);
                prefetch_tile(w1 + c * TILE_BYTES + DOVETAIL_TILES_AHEAD);
                _tile_loadd(2, a + 64 * c, k);
                _tile_loadd(3, w0 + c * TILE_BYTES, 64);
                _tile_loadd(4, w1 + c * TILE_BYTES, 64);
                _tile_dpbusd(0, 2, 3);
                _tile_dpbusd(1, 2, 4);
            }
        } else {
            for (int64_t c = 0; c < chunks; c++) {
                prefetch_tile(w0 + c * TILE_BYTES + DOVETAIL_TILES_AHEAD);
                _tile_loadd(2, a + 64 * c, k);
                _tile_loadd(3, w0 + c * TILE_BYTES, 64);
                _tile_dpbusd(0, 2, 3);
            }
        }
        _tile_stored(0, sums[0], 64);
        if (two) _tile_stored(1, sums[1], 64);
        int64_t m_end = rows < m0 + TILE_OUT ? rows : m0 + TILE_OUT;
        for (int s = 0; s <= two; s++)
            for (int64_t m = m0; m < m_end; m++) {
                int64_t n0 = (b0 + s) * TILE_OUT;
                const int32_t *acc = sums[s] + (m - m0) * TILE_OUT;
                float *out = y + m * n_out + n0;
                for (int j = 0; j < TILE_OUT; j++) { /* store_row's arithmetic, in its order */
                    float value = (float)(acc[j] - w_offset[n0 + j]) * x_scale[m] * w_scale[n0 + j];
                    out[j] = bias ? value + bias[n0 + j] : value;
                }
            }
    }
}

/* Returns -1 when a padded copy of the activations could not be allocated. */
static int tiles_linear_amx(const uint8_t *xu, const float *x_scale, const int8_t *w, const float *w_scale,
                            const int32_t *w_offset, const float *bias, float *y, int64_t rows, int64_t n_out,
                            int64_t k, int threads) {
    /* A tile's rows are fixed per configuration: above 16 rows every group is 16, the last
     * padded with zeros (u = 128) whose sums are never stored. */
    uint8_t *padded = NULL;
    if (rows > TILE_OUT && rows % TILE_OUT != 0) {
        int64_t full = (rows + TILE_OUT - 1) / TILE_OUT * TILE_OUT;
        padded = (uint8_t *)malloc((size_t)(full * k));
        if (padded == NULL) return -1;
        memcpy(padded, xu, (size_t)(rows * k));
        memset(padded + rows * k, 128, (size_t)((full - rows) * k));
        xu = padded;
    }
    int tile_rows = rows < TILE_OUT ? (int)rows : TILE_OUT;
    int64_t blocks = n_out / TILE_OUT, pairs = (blocks + 1) / 2;
#pragma omp parallel num_threads(threads)
    {
        int32_t sums[2][TILE_OUT * TILE_OUT];
        amx_configure(tile_rows);
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < pairs; pair++)
            amx_block_pair(xu, rows, w, k, 2 * pair, 2 * pair + 1 < blocks, sums, x_scale, w_scale, w_offset, bias,
                           y, n_out);
        _tile_release();
    }
    free(padded);
    return 0;
}
#else
#define DOVETAIL_AMX 0
int dovetail_int8_amx_ready(void) { return 0; }
#endif

#if DOVETAIL_VNNI
/* Up to 4 activation rows against one block of the tile layout: each 64-byte weight line feeds
 * every row's broadcast 4 bytes; four accumulators per row hide the dot product's latency. */
static inline __attribute__((always_inline)) void tiles_dot_vnni(const uint8_t *xu, int64_t k, const int8_t *block,
                                                                 const int count, int32_t out[4][TILE_OUT]) {
    __m512i acc[4][4];
    for (int m = 0; m < 4; m++)
        for (int a = 0; a < 4; a++) acc[m][a] = _mm512_setzero_si512();
    for (int64_t c = 0; c < k / 64; c++) {
        const int8_t *tile = block + c * TILE_BYTES;
        for (int g = 0; g < 16; g++) {
            __m512i wv = _mm512_loadu_si512((const void *)(tile + 64 * g));
            for (int m = 0; m < count; m++) {
                int32_t group;
                memcpy(&group, xu + m * k + 64 * c + 4 * g, sizeof group);
                acc[m][g & 3] = _mm512_dpbusd_epi32(acc[m][g & 3], _mm512_set1_epi32(group), wv);
            }
        }
    }
    for (int m = 0; m < count; m++) {
        __m512i total = _mm512_add_epi32(_mm512_add_epi32(acc[m][0], acc[m][1]),
                                         _mm512_add_epi32(acc[m][2], acc[m][3]));
        _mm512_storeu_si512((void *)out[m], total);
    }
}
#endif

/* The sums of `count` (<= 4) rows against one block of the tile layout. */
static void tiles_dot(const uint8_t *xu, int64_t k, const int8_t *block, int count, int32_t out[4][TILE_OUT]) {
#if DOVETAIL_VNNI
    switch (count) { /* a constant count per copy, so the row loop unrolls */
    case 1: tiles_dot_vnni(xu, k, block, 1, out); return;
    case 2: tiles_dot_vnni(xu, k, block, 2, out); return;
    case 3: tiles_dot_vnni(xu, k, block, 3, out); return;
    default: tiles_dot_vnni(xu, k, block, 4, out); return;
    }
#else
    for (int m = 0; m < count; m++)
        for (int j = 0; j < TILE_OUT; j++) {
            int32_t sum = 0;
            for (int64_t c = 0; c < k / 64; c++)
                for (int g = 0; g < 16; g++)
                    for (int b = 0; b < 4; b++)
                        sum += (int32_t)xu[m * k + 64 * c + 4 * g + b] *
                               (int32_t)block[c * TILE_BYTES + 64 * g + 4 * j + b];
            out[m][j] = sum;
        }
#endif
}

/* The tile layout without AMX (or below tiles_amx_min_rows): blocks split over threads, rows in fours. */
static void tiles_linear_dot(const uint8_t *xu, const float *x_scale, const int8_t *w, const float *w_scale,
                             const int32_t *w_offset, const float *bias, float *y, int64_t rows, int64_t n_out,
                             int64_t k, int threads) {
    int64_t blocks = n_out / TILE_OUT;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        int64_t n0 = block * TILE_OUT;
        int32_t sums[4][TILE_OUT];
        for (int64_t m0 = 0; m0 < rows; m0 += 4) {
            int count = (int)(rows - m0 < 4 ? rows - m0 : 4);
            tiles_dot(xu + m0 * k, k, w + n0 * k, count, sums);
            for (int m = 0; m < count; m++) {
                float *out = y + (m0 + m) * n_out + n0;
                for (int j = 0; j < TILE_OUT; j++) { /* store_row's arithmetic, in its order */
                    float value = (float)(sums[m][j] - w_offset[n0 + j]) * x_scale[m0 + m] * w_scale[n0 + j];
                    out[j] = bias ? value + bias[n0 + j] : value;
                }
            }
        }
    }
}

static int tiles_linear(const uint8_t *xu, const float *x_scale, const int8_t *w, const float *w_scale,
                        const int32_t *w_offset, const float *bias, float *y, int64_t rows, int64_t n_out, int64_t k,
                        int threads) {
#if DOVETAIL_AMX
    if (rows >= tiles_amx_min_rows && dovetail_int8_amx_ready())
        return tiles_linear_amx(xu, x_scale, w, w_scale, w_offset, bias, y, rows, n_out, k, threads);
#endif
    tiles_linear_dot(xu, x_scale, w, w_scale, w_offset, bias, y, rows, n_out, k, threads);
    return 0;
}

/* acc[r] - w_offset[n0 + r] is sum q * w; w_offset NULL: acc is that sum already. */
static inline void store_row(const int32_t acc[4], int64_t m, int64_t n0, int count, const float *x_scale,
                             const float *w_scale, const int32_t *w_offset, const float *bias, float *y,
                             int64_t n_out) {
    float *out = y + m * n_out + n0;
    for (int r = 0; r < count; r++) {
        int32_t sum = w_offset ? acc[r] - w_offset[n0 + r] : acc[r];
        float value = (float)sum * x_scale[m] * w_scale[n0 + r];
        out[r] = bias ? value + bias[n0 + r] : value;
    }
}

/* y[rows, n_out] from u8 activations xu[rows, k] (each in 1..255: q + 128 with |q| <= 127) and
 * int8 weights w in `layout`: DOVETAIL_LAYOUT_ROWS [n_out, k], _PACKED (see block_row) or _TILES
 * (see TILE_OUT). Threads split the output rows in blocks; each block's weights are read from memory
 * once for all rows. Returns 0; -1 (nothing computed) for a shape the layout cannot hold; -3
 * when scratch memory could not be allocated. */
int dovetail_int8_linear(const uint8_t *xu, const float *x_scale, const int8_t *w, const float *w_scale,
                         const int32_t *w_offset, const float *bias, float *y, int64_t rows, int64_t n_out,
                         int64_t k, int layout, int threads) {
    if (rows <= 0) return 0; /* nothing to compute (and no tile configuration of zero rows) */
    if (layout == DOVETAIL_LAYOUT_TILES) {
        if (n_out % TILE_OUT != 0 || k % 64 != 0) return -1;
        return tiles_linear(xu, x_scale, w, w_scale, w_offset, bias, y, rows, n_out, k, threads) == 0 ? 0 : -3;
    }
    int packed = layout == DOVETAIL_LAYOUT_PACKED;
    if (packed && (n_out % 4 != 0 || k % 64 != 0)) return -1;
    int64_t blocks = (n_out + 3) / 4;
    const int32_t *offset = DOT_SUMS_SIGNED ? NULL : w_offset;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        int64_t n0 = block * 4;
        const int8_t *weights = w + n0 * k; /* both layouts: a block is 4 * k bytes */
        int count = (int)(n_out - n0 < 4 ? n_out - n0 : 4);
        int32_t acc[4], acc_b[4];
        int64_t m = 0;
#if DOVETAIL_VNNI
        if (rows % 2 == 1 && rows >= 3) { /* three rows in one pass, the rest in pairs */
            int32_t acc_c[4];
            dot4x3(xu, xu + k, xu + 2 * k, weights, k, count, acc, acc_b, acc_c, packed);
            store_row(acc, 0, n0, count, x_scale, w_scale, offset, bias, y, n_out);
            store_row(acc_b, 1, n0, count, x_scale, w_scale, offset, bias, y, n_out);
            store_row(acc_c, 2, n0, count, x_scale, w_scale, offset, bias, y, n_out);
            m = 3;
        }
#endif
        for (; m + 2 <= rows; m += 2) {
            dot4x2(xu + m * k, xu + (m + 1) * k, weights, k, count, m == 0, acc, acc_b, packed);
            store_row(acc, m, n0, count, x_scale, w_scale, offset, bias, y, n_out);
            store_row(acc_b, m + 1, n0, count, x_scale, w_scale, offset, bias, y, n_out);
        }
        if (m < rows) {
            dot4(xu + m * k, weights, k, count, acc, packed);
            store_row(acc, m, n0, count, x_scale, w_scale, offset, bias, y, n_out);
        }
    }
    return 0;
}

/* One call per layer from Python: quantize the rows, then the linear (a decode step makes
 * hundreds of these calls, so fewer foreign calls and tensors per call matter). `layout` as
 * dovetail_int8_linear's. Returns 0, DOVETAIL_NO_MEMORY if scratch memory could not be allocated,
 * or DOVETAIL_BAD_SHAPE for a shape the layout cannot hold. */
int dovetail_int8_forward(const float *x, const int8_t *w, const float *w_scale, const int32_t *w_offset,
                          const float *bias, float *y, int64_t rows, int64_t n_out, int64_t k, int layout,
                          int threads) {
    uint8_t stack_rows[4 * 16384];
    float stack_scales[4];
    int small = rows <= 4 && k <= 16384;
    uint8_t *xu = small ? stack_rows : (uint8_t *)malloc((size_t)(rows * k));
    float *x_scale = small ? stack_scales : (float *)malloc((size_t)rows * sizeof(float));
    if (xu == NULL || x_scale == NULL) {
        if (!small) {
            free(xu);
            free(x_scale);
        }
        return DOVETAIL_NO_MEMORY;
    }
    dovetail_quantize_rows(x, xu, x_scale, rows, k);
    int status = dovetail_int8_linear(xu, x_scale, w, w_scale, w_offset, bias, y, rows, n_out, k, layout, threads);
    if (!small) {
        free(xu);
        free(x_scale);
    }
    return status == 0 ? 0 : (status == -1 ? DOVETAIL_BAD_SHAPE : DOVETAIL_NO_MEMORY);
}
