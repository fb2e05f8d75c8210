/* fp32 rows: y[m, n] = dot(x[m], w[n]) (+ bias[n]), each row's bits independent of its call-mates;
 * the weights fp32 (dovetail_fp32_linear) or bf16 (dovetail_bf16_linear), the activations fp32.
 *
 * Why: an fp32 target's tree rows must round exactly as a one-row decode does (DESIGN.md,
 * losslessness); F.linear picks another kernel for one row than for T rows, and MKL's packed
 * sgemm keeps rows independent only on some CPUs (cpu_worker/fp32_packed.py).
 *
 * The order: every (m, n) is one chain of F32_LANES partial sums over k, one vector step at a
 * time (a fused multiply-add where the CPU has FMA, else a multiply then an add), then those
 * lanes summed in a fixed halving tree, then the tail of k in order, then the bias. Which rows
 * share a call, how they are grouped and how many threads run only decide which chains run side
 * by side, never the order inside one. Built with -ffp-contract=off, so the plain C path's
 * multiply and add stay two roundings whatever the compiler schedules.
 *
 * The speed: a decode step is a stream over the weights, a tree verification the same stream
 * with more arithmetic per byte. Threads split the output rows in blocks of 4 weight rows; a
 * block is streamed from memory once (the next block is prefetched while this one is used), in
 * chunks of F32_CHUNK floats that stay in L1 while up to F32_GROUP activation rows at a time run
 * over them, their accumulators kept in registers and parked between chunks. Measured against MKL
 * and F.linear: docs/kernels.md, "fp32 row kernel" (python -m tools.bench_fp32_kernel).
 *
 * bf16 weights: each weight vector is widened to fp32 as it is loaded (exactly: a bf16 is the top half
 * of an fp32), then used as above. So the bf16 kernel's bits are the fp32 kernel's on the widened
 * weights, and a bf16 target streams half of fp32's bytes with fp32's arithmetic on its activations,
 * on any CPU (no bf16 instructions needed). */
#include "dovetail.h"

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define F32_LANES 16
#define F32_GROUP 4 /* 16 accumulators of the 32 zmm registers (6 rows a group: no faster) */
typedef __m512 f32_vector;
static inline f32_vector vector_load(const float *p) { return _mm512_loadu_ps(p); }
static inline f32_vector vector_madd(f32_vector sum, f32_vector a, f32_vector b) { return _mm512_fmadd_ps(a, b, sum); }
static inline f32_vector vector_zero(void) { return _mm512_setzero_ps(); }
static inline f32_vector vector_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define F32_LANES 8
#define F32_GROUP 2 /* 8 accumulators of the 16 ymm registers */
typedef __m256 f32_vector;
static inline f32_vector vector_load(const float *p) { return _mm256_loadu_ps(p); }
static inline f32_vector vector_madd(f32_vector sum, f32_vector a, f32_vector b) { return _mm256_fmadd_ps(a, b, sum); }
static inline f32_vector vector_zero(void) { return _mm256_setzero_ps(); }
static inline f32_vector vector_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#else
#define F32_LANES 4
#define F32_GROUP 2
typedef float f32_vector __attribute__((vector_size(16)));
static inline f32_vector vector_load(const float *p) {
    f32_vector v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline f32_vector vector_madd(f32_vector sum, f32_vector a, f32_vector b) { return sum + a * b; }
static inline f32_vector vector_zero(void) { return (f32_vector){0}; }
typedef uint16_t u16_vector __attribute__((vector_size(16)));
static inline f32_vector vector_load_bf16(const uint16_t *p) {
    /* The 4 values into the low half, then interleaved with zeros: each becomes the top half of a
     * 32-bit lane (little-endian: x86, ARM), as SSE2's punpcklwd or NEON's zip does, in whole-vector ops. */
    u16_vector half = {0}, zero = {0};
    memcpy(&half, p, F32_LANES * sizeof *p);
#if defined(__clang__)
    u16_vector spread = __builtin_shufflevector(zero, half, 0, 8, 1, 9, 2, 10, 3, 11);
#else
    u16_vector spread = __builtin_shuffle(zero, half, (u16_vector){0, 8, 1, 9, 2, 10, 3, 11});
#endif
    f32_vector v;
    memcpy(&v, &spread, sizeof v);
    return v;
}
#endif

static inline float widen_bf16(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float widened;
    memcpy(&widened, &bits, sizeof widened);
    return widened;
}

/* Element i of a weight row, fp32 or bf16 (bf16: a constant where inlined). */
static inline __attribute__((always_inline)) f32_vector weight_vector(const void *row, int64_t i, int bf16) {
    return bf16 ? vector_load_bf16((const uint16_t *)row + i) : vector_load((const float *)row + i);
}

static inline __attribute__((always_inline)) float weight_value(const void *row, int64_t i, int bf16) {
    return bf16 ? widen_bf16(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

#define F32_BLOCK 4       /* weight rows a block */
#define F32_CHUNK 256     /* floats of k a chunk: 4 weight rows x 1 KB stay in L1 (larger chunks: slower) */
#define F32_MAX_GROUPED 64 /* activation rows whose accumulators are parked at once (16 KB of stack) */

/* Which kernel this build runs: AVX-512 with FMA, AVX2 with FMA, or plain C (4 lanes). */
int dovetail_fp32_simd(void) {
#if defined(__AVX512F__)
    return DOVETAIL_SIMD_AVX512;
#elif defined(__AVX2__) && defined(__FMA__)
    return DOVETAIL_SIMD_AVX2;
#else
    return DOVETAIL_SIMD_PLAIN;
#endif
}

static inline float vector_sum(f32_vector v) {
    float lane[F32_LANES];
    memcpy(lane, &v, sizeof lane);
    for (int width = F32_LANES / 2; width > 0; width /= 2)
        for (int i = 0; i < width; i++) lane[i] += lane[i + width];
    return lane[0];
}

/* rows_here (a constant where inlined) activation rows against the block's weight rows over
 * k in [i0, i1), continuing the chains in sums. prefetch: also fetch the next block's lines.
 * bf16: the weight rows are bf16 (a constant where inlined). */
static inline __attribute__((always_inline)) void run_chunk(const float *x, int rows_here, int64_t k,
                                                             const void *const weight_rows[F32_BLOCK], int bf16,
                                                             int64_t i0, int64_t i1, f32_vector sums[][F32_BLOCK],
                                                             int prefetch) {
    const int64_t element = bf16 ? 2 : 4, line = 64 / element; /* bytes a weight, weights a cache line */
    f32_vector acc[F32_GROUP][F32_BLOCK];
    for (int m = 0; m < rows_here; m++)
        for (int r = 0; r < F32_BLOCK; r++) acc[m][r] = sums[m][r];
    for (int64_t i = i0; i < i1; i += F32_LANES) {
        f32_vector w[F32_BLOCK];
        for (int r = 0; r < F32_BLOCK; r++) w[r] = weight_vector(weight_rows[r], i, bf16);
        if (prefetch && i % line == 0) /* one 64-byte line of each next row; the block's rows are consecutive */
            for (int r = 0; r < F32_BLOCK; r++)
                __builtin_prefetch((const char *)weight_rows[0] + ((F32_BLOCK + r) * k + i) * element, 0, 3);
        for (int m = 0; m < rows_here; m++) {
            f32_vector xv = vector_load(x + m * k + i);
            for (int r = 0; r < F32_BLOCK; r++) acc[m][r] = vector_madd(acc[m][r], xv, w[r]);
        }
    }
    for (int m = 0; m < rows_here; m++)
        for (int r = 0; r < F32_BLOCK; r++) sums[m][r] = acc[m][r];
}

/* Rows [0, rows) (at most F32_MAX_GROUPED) of x against one block, in groups of F32_GROUP, the
 * remainder as one smaller group, each a separately inlined copy with its own constant count. */
static inline __attribute__((always_inline)) void run_block_rows(const float *x, int64_t rows, int64_t k,
                                                                  const void *const weight_rows[F32_BLOCK], int bf16,
                                                                  int64_t i0, int64_t i1,
                                                                  f32_vector sums[][F32_BLOCK], int prefetch) {
    int64_t m = 0;
    for (; m + F32_GROUP <= rows; m += F32_GROUP)
        run_chunk(x + m * k, F32_GROUP, k, weight_rows, bf16, i0, i1, sums + m, prefetch && m == 0);
    int first = prefetch && m == 0;
    switch (rows - m) {
#if F32_GROUP > 3
    case 3: run_chunk(x + m * k, 3, k, weight_rows, bf16, i0, i1, sums + m, first); break;
#endif
#if F32_GROUP > 2
    case 2: run_chunk(x + m * k, 2, k, weight_rows, bf16, i0, i1, sums + m, first); break;
#endif
    case 1: run_chunk(x + m * k, 1, k, weight_rows, bf16, i0, i1, sums + m, first); break;
    default: break;
    }
}

/* One block of F32_BLOCK output rows: y[:, n0 .. n0 + 4) from every row of x (bf16: a constant
 * where inlined, the weights' element type). */
static inline __attribute__((always_inline)) void linear_block(const float *x, const void *w, int bf16,
                                                                const float *bias, float *y, int64_t rows,
                                                                int64_t n_out, int64_t k, int64_t block,
                                                                int64_t blocks) {
    const int64_t element = bf16 ? 2 : 4;
    int64_t k_vectors = k / F32_LANES * F32_LANES;
    int64_t n0 = block * F32_BLOCK;
    int count = (int)(n_out - n0 < F32_BLOCK ? n_out - n0 : F32_BLOCK);
    const void *weight_rows[F32_BLOCK];
    for (int r = 0; r < F32_BLOCK; r++) /* extras alias the first row */
        weight_rows[r] = (const char *)w + (n0 + (r < count ? r : 0)) * k * element;
    int prefetch = block + 1 < blocks;
    f32_vector sums[F32_MAX_GROUPED][F32_BLOCK];
    for (int64_t m0 = 0; m0 < rows; m0 += F32_MAX_GROUPED) {
        int64_t rows_here = rows - m0 < F32_MAX_GROUPED ? rows - m0 : F32_MAX_GROUPED;
        const float *xm = x + m0 * k;
        for (int64_t m = 0; m < rows_here; m++)
            for (int r = 0; r < F32_BLOCK; r++) sums[m][r] = vector_zero();
        for (int64_t i0 = 0; i0 < k_vectors; i0 += F32_CHUNK) {
            int64_t i1 = i0 + F32_CHUNK < k_vectors ? i0 + F32_CHUNK : k_vectors;
            run_block_rows(xm, rows_here, k, weight_rows, bf16, i0, i1, sums, prefetch && m0 == 0);
        }
        for (int64_t m = 0; m < rows_here; m++) {
            float *out = y + (m0 + m) * n_out + n0;
            for (int r = 0; r < count; r++) {
                float sum = vector_sum(sums[m][r]);
                for (int64_t j = k_vectors; j < k; j++) sum += xm[m * k + j] * weight_value(weight_rows[r], j, bf16);
                out[r] = bias ? sum + bias[n0 + r] : sum;
            }
        }
    }
}

/* y[rows, n_out] from x[rows, k] and w[n_out, k] (row-major fp32), bias optional. */
void dovetail_fp32_linear(const float *x, const float *w, const float *bias, float *y, int64_t rows,
                          int64_t n_out, int64_t k, int threads) {
    int64_t blocks = (n_out + F32_BLOCK - 1) / F32_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < blocks; block++) linear_block(x, w, 0, bias, y, rows, n_out, k, block, blocks);
}

/* The same from bf16 weights w[n_out, k] (raw bf16 bits): the fp32 kernel's bits on the widened weights. */
void dovetail_bf16_linear(const float *x, const uint16_t *w, const float *bias, float *y, int64_t rows,
                          int64_t n_out, int64_t k, int threads) {
    int64_t blocks = (n_out + F32_BLOCK - 1) / F32_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < blocks; block++) linear_block(x, w, 1, bias, y, rows, n_out, k, block, blocks);
}
