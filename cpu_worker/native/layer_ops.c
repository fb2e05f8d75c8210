/* A decoder layer's small fp32 steps in one call each: RMSNorm, and rotary + KV-cache write.
 *
 * Why our own: at a decode step these are a few thousand floats, and torch runs them as chains
 * of small ops (its CPU rms_norm is ten of them: pow, mean, add, rsqrt, mul, ... at ~2-10 us
 * each; rotary is slice, neg, cat, mul, mul, add, then the cache writes). At the 1B shape that
 * glue was a sixth of a token, beside linears that stream the weights (docs/kernels.md).
 *
 * Every row is computed on its own, in one fixed order (no row's value depends on the others in
 * its call or on the thread count), so a tree node gets the bits its later decode step gets.
 * Built with -ffp-contract=off: no fused multiply-add changes a rounding, so the vector code the
 * compiler makes gives the plain C build's bits.
 */
#include "dovetail.h" /* attention.c's dovetail_dot_fixed (8 lanes, a fixed tree, the tail in order) and
                        * dovetail_exp_nonpositive (vector and scalar code give the same bits) among them */

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Below this many floats a call stays on one thread: waking the pool costs more than it saves.
 * Such a call never enters an OpenMP region at all: even one that an if clause keeps on a single
 * thread costs ~0.45 us to set up, and a decode step makes a few hundred of these calls. */
#define LAYER_OPS_PARALLEL_MIN 65536
/* The same for SiLU, whose exponential and divisions cost ~3 ns a float where RMSNorm's products
 * cost a fraction of one: a tree of 8 rows at SmolLM2-135M's 1536 (12288 floats, ~40 us) spent 8% of
 * its verify pass here on one thread while the other waited. */
#define SILU_PARALLEL_MIN 4096

/* out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)), x and out [rows, dim] (may alias). The
 * sum of squares is attention.c's fixed-order dot product of the row with itself. */
static void rms_norm_row(const float *x, const float *weight, float *out, int64_t r, int64_t dim, float eps) {
    const float *row = x + r * dim;
    float inverse = 1.0f / sqrtf(dovetail_dot_fixed(row, row, dim) / (float)dim + eps);
    float *o = out + r * dim;
    for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (row[i] * inverse);
}

void dovetail_rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim, float eps,
                       int threads) {
    if (rows * dim < LAYER_OPS_PARALLEL_MIN || threads < 2) {
        for (int64_t r = 0; r < rows; r++) rms_norm_row(x, weight, out, r, dim, eps);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x, weight, out, r, dim, eps);
}

/* One head row rotated (Llama's rotate-half rotary): out = x * cos + rotate_half(x) * sin, where
 * rotate_half(x) = [-x2, x1]. The same products and sums as torch's apply_rope, so the same bits. */
static inline void rotate(const float *x, const float *cos, const float *sin, float *out, int64_t head_dim) {
    int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i++) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
    for (int64_t i = half; i < head_dim; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

/* fp32 -> bf16 rounded to nearest even, as torch's conversion rounds (NaN stays a NaN). */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (x != x) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* One head row into cache slot `slot` of a fp32 or (bf16 != 0) bf16 cache. */
static inline void store_row(void *cache, int64_t slot, const float *row, int64_t head_dim, int bf16) {
    if (!bf16) {
        memcpy((float *)cache + slot, row, (size_t)head_dim * sizeof(float));
        return;
    }
    uint16_t *out = (uint16_t *)cache + slot;
    for (int64_t i = 0; i < head_dim; i++) out[i] = to_bf16(row[i]);
}

/* Row r of dovetail_rope_qkv. */
static void rope_row(const float *qkv, const float *cos, const float *sin, float *q, void *keys, void *values,
                     int bf16, int64_t r, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     int64_t max_len, int64_t start) {
    int64_t width = (heads + 2 * kv_heads) * head_dim;
    const float *row = qkv + r * width, *c = cos + r * head_dim, *s = sin + r * head_dim;
    float rotated[head_dim];
    for (int64_t h = 0; h < heads; h++) rotate(row + h * head_dim, c, s, q + (h * rows + r) * head_dim, head_dim);
    for (int64_t g = 0; g < kv_heads; g++) {
        int64_t slot = (g * max_len + start + r) * head_dim;
        if (bf16) {
            rotate(row + (heads + g) * head_dim, c, s, rotated, head_dim);
            store_row(keys, slot, rotated, head_dim, bf16);
        } else {
            rotate(row + (heads + g) * head_dim, c, s, (float *)keys + slot, head_dim); /* straight into the cache */
        }
        store_row(values, slot, row + (heads + kv_heads + g) * head_dim, head_dim, bf16);
    }
}

/* The fused q/k/v projection's output split for attention. qkv: [rows, (heads + 2 kv_heads),
 * head_dim], heads first, then keys, then values; cos/sin: [rows, head_dim] (each row's
 * position). Writes the rotated queries to q [heads, rows, head_dim], and each row's rotated
 * keys and its values to slot start + r of one layer's cache, keys/values [kv_heads, max_len,
 * head_dim], fp32 or (bf16 != 0) bf16, rounded as torch rounds a copy into it. */
void dovetail_rope_qkv(const float *qkv, const float *cos, const float *sin, float *q, void *keys, void *values,
                       int bf16, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_len,
                       int64_t start, int threads) {
    int64_t width = (heads + 2 * kv_heads) * head_dim;
    if (rows * width < LAYER_OPS_PARALLEL_MIN || threads < 2) {
        for (int64_t r = 0; r < rows; r++)
            rope_row(qkv, cos, sin, q, keys, values, bf16, r, rows, heads, kv_heads, head_dim, max_len, start);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        rope_row(qkv, cos, sin, q, keys, values, bf16, r, rows, heads, kv_heads, head_dim, max_len, start);
}

/* out[r] = silu(gate[r]) * up[r], rows of `width`: gate row r at gate + r * stride, up's likewise
 * (the fused gate/up projection's halves: stride 2 * width; separate tensors: width), out
 * [rows, width]. silu(g) = g * sigmoid(g), with sigmoid from e = exp(-|g|) (never overflows):
 * 1 / (1 + e) for g >= 0, e / (1 + e) below. Elementwise, so a row's bits depend on nothing else
 * in its call. */
#define SILU_CHUNK 256
/* Chunk t of dovetail_silu_mul: row t / chunks, its floats from (t % chunks) * SILU_CHUNK. */
static void silu_chunk(const float *gate, const float *up, int64_t stride, float *out, int64_t width, int64_t chunks,
                       int64_t t) {
    int64_t r = t / chunks, from = (t % chunks) * SILU_CHUNK;
    int64_t n = width - from < SILU_CHUNK ? width - from : SILU_CHUNK;
    const float *g = gate + r * stride + from, *u = up + r * stride + from;
    float e[SILU_CHUNK];
    for (int64_t i = 0; i < n; i++) e[i] = -fabsf(g[i]);
    dovetail_exp_nonpositive(e, n);
    float *o = out + r * width + from;
    /* sigmoid = 1 / (1 + e) for g >= 0, e / (1 + e) below: the numerator picked, then one division,
     * the same IEEE operations as a branch on each side, and a loop the compiler vectorizes. */
    for (int64_t i = 0; i < n; i++) {
        float numerator = g[i] >= 0.0f ? 1.0f : e[i];
        o[i] = (g[i] * (numerator / (1.0f + e[i]))) * u[i];
    }
}

void dovetail_silu_mul(const float *gate, const float *up, int64_t stride, float *out, int64_t rows, int64_t width,
                       int threads) {
    int64_t chunks = (width + SILU_CHUNK - 1) / SILU_CHUNK;
    if (rows * width < SILU_PARALLEL_MIN || threads < 2) {
        for (int64_t t = 0; t < rows * chunks; t++) silu_chunk(gate, up, stride, out, width, chunks, t);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < rows * chunks; t++) silu_chunk(gate, up, stride, out, width, chunks, t);
}
