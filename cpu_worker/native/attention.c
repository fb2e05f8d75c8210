/* Exact attention for decoding and tree verification, fp32: every query row's result is the same
 * bits whether it is one decode step or one node of a tree verified with others.
 *
 * Why our own: a tree node must round exactly as the one-token decode of the same prefix does
 * (DESIGN.md, losslessness). torch's scaled_dot_product_attention rounds a batched, masked call
 * differently from a one-row call, so tree rows used to attend one at a time, each re-reading
 * the whole cached prefix (at a long context, milliseconds per row per 7B layer: docs/kernels.md,
 * "Exact attention"; python -m tools.bench_attention). Here the shared
 * prefix is read once for every row and query head of a KV head, and each row's sums run over
 * its keys in one fixed order (the prefix, then its own path, root first), which is exactly
 * the order a later decode of that node sees them in, as committed slots.
 *
 * Per (row, head): s_j = scale * dot(q, k_j), dot in 8 lanes over head_dim then a fixed tree;
 * m = max_j s_j; p_j = exp(s_j - m) by one polynomial (dovetail_exp, elementwise, so vector and
 * scalar code give the same bits); out = (sum_j p_j v_j, j ascending) * (1 / sum_j p_j, j
 * ascending). Built with -ffp-contract=off: no fused multiply-add changes a rounding.
 */
#include "dovetail.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DOVETAIL_LANES 8

/* exp(x) to ~2 ulp for x <= 0 (softmax arguments), by range reduction x = n ln2 + r and a
 * degree-6 polynomial (Cephes' expf); arguments below -87 give exp(-87) ~ 1.6e-38, not 0
 * (negligible beside the row's largest term, 1). The AVX2 and plain C versions do the same IEEE
 * operations in the same order, so they give the same bits. */
#define EXP_LOW -87.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HIGH 0.693359375f /* ln2 split in two: n * high is exact */
#define EXP_LN2_LOW -2.12194440e-4f
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float dovetail_exp(float x) {
    x = x < EXP_LOW ? EXP_LOW : x;
    float n = floorf(x * EXP_LOG2E + 0.5f);
    float r = (x - n * EXP_LN2_HIGH) - n * EXP_LN2_LOW;
    float p = EXP_POLY[0];
    for (int i = 1; i < 6; i++) p = p * r + EXP_POLY[i];
    p = ((p * r) * r + r) + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#if defined(__AVX2__)
#include <immintrin.h>
static inline __m256 dovetail_exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LOW));
    __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_HIGH))),
                             _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_LOW)));
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_POLY[i]));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

/* s[j] = exp(s[j] - max_j s[j]) over one row's n scores (the max is exact in any order). */
static void softmax_numerators(float *s, int64_t n) {
    float top = -INFINITY;
    int64_t j = 0;
#if defined(__AVX2__)
    __m256 lanes = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(s + j));
    float lane[8];
    _mm256_storeu_ps(lane, lanes);
    for (int l = 0; l < 8; l++) top = lane[l] > top ? lane[l] : top;
#endif
    for (; j < n; j++) top = s[j] > top ? s[j] : top;
    j = 0;
#if defined(__AVX2__)
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, dovetail_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top))));
#endif
    for (; j < n; j++) s[j] = dovetail_exp(s[j] - top);
}

/* x[j] = exp(x[j]) in place for arguments <= 0, the same bits in vector and scalar code (layer_ops.c's
 * SiLU takes its exponentials here, so there is one exp in the library). */
void dovetail_exp_nonpositive(float *x, int64_t n) {
    int64_t j = 0;
#if defined(__AVX2__)
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, dovetail_exp8(_mm256_loadu_ps(x + j)));
#endif
    for (; j < n; j++) x[j] = dovetail_exp(x[j]);
}

static inline float dot_fixed(const float *a, const float *b, int64_t d) {
    float lane[DOVETAIL_LANES] = {0};
    int64_t i = 0;
    for (; i + DOVETAIL_LANES <= d; i += DOVETAIL_LANES)
        for (int l = 0; l < DOVETAIL_LANES; l++) lane[l] += a[i + l] * b[i + l];
    float sum = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
    for (; i < d; i++) sum += a[i] * b[i];
    return sum;
}

/* The same sum for other kernels of the library (layer_ops.c's RMSNorm), so both reduce alike. */
float dovetail_dot_fixed(const float *a, const float *b, int64_t d) { return dot_fixed(a, b, d); }

static inline void add_scaled(float *acc, const float *v, float p, int64_t d) {
    for (int64_t i = 0; i < d; i++) acc[i] += p * v[i];
}

#define KEY_BLOCK 8 /* keys scored (and values added) together: one L1-resident block for every query */

#if defined(__AVX2__)
/* dot_fixed(q, k[i], d) * scale for 8 keys at once, the same bits (d % 8 == 0): each key's 8 lanes
 * are summed as ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) by a transpose (a 128-bit
 * half added to the other, then two horizontal adds of neighbours), so no lane is reassociated.
 * Why: a tree's queries each scored the whole prefix one key at a time, with a scalar reduction
 * per score, 7x one query's time at T = 16 (docs/kernels.md, "Exact attention"). */
static inline __m256 scores8(const float *q, const float *const k[KEY_BLOCK], int64_t d, float scale) {
    __m256 acc[KEY_BLOCK];
    for (int i = 0; i < KEY_BLOCK; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
        __m256 qv = _mm256_loadu_ps(q + c);
        for (int i = 0; i < KEY_BLOCK; i++)
            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(qv, _mm256_loadu_ps(k[i] + c)));
    }
    __m256 pairs[4]; /* keys 2i and 2i + 1: (l0 + l4, l1 + l5, l2 + l6, l3 + l7) each */
    for (int i = 0; i < 4; i++)
        pairs[i] = _mm256_add_ps(_mm256_permute2f128_ps(acc[2 * i], acc[2 * i + 1], 0x20),
                                 _mm256_permute2f128_ps(acc[2 * i], acc[2 * i + 1], 0x31));
    __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(pairs[0], pairs[1]), _mm256_hadd_ps(pairs[2], pairs[3]));
    /* sums holds keys 0, 2, 4, 6 | 1, 3, 5, 7 */
    sums = _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    return _mm256_mul_ps(sums, _mm256_set1_ps(scale));
}

/* acc[0..d) += p[i] * v[i][0..d) for i = 0..7 in that order, elementwise as add_scaled does it
 * (d % 8 == 0): the accumulator row stays in registers across the block's 8 values. */
static inline void add_scaled8(float *acc, const float *const v[KEY_BLOCK], const float *p, int64_t d) {
    for (int64_t c = 0; c < d; c += 8) {
        __m256 a = _mm256_loadu_ps(acc + c);
        for (int i = 0; i < KEY_BLOCK; i++)
            a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(p[i]), _mm256_loadu_ps(v[i] + c)));
        _mm256_storeu_ps(acc + c, a);
    }
}
#define DOVETAIL_KEY_BLOCKS 1
#else
#define DOVETAIL_KEY_BLOCKS 0
#endif

/* Cache row `slot` of one head as fp32: the row itself (an fp32 cache), or (a bf16 cache) its exact
 * widening into `scratch`. A bf16 value is the top half of an fp32 one, so every later sum sees
 * the same floats whichever kernel call, decode or tree, reads the row. */
static inline const float *cache_row(const void *head, int64_t slot, int64_t head_dim, int bf16, float *scratch) {
    if (!bf16) return (const float *)head + slot * head_dim;
    const uint16_t *row = (const uint16_t *)head + slot * head_dim;
    for (int64_t i = 0; i < head_dim; i++) {
        uint32_t bits = (uint32_t)row[i] << 16;
        memcpy(scratch + i, &bits, sizeof bits);
    }
    return scratch;
}

#if DOVETAIL_KEY_BLOCKS
/* Cache rows [j, j + KEY_BLOCK) of one head as fp32, each bf16 row widened into its own row of scratch. */
static inline void cache_block(const void *head, int64_t j, int64_t head_dim, int bf16, float *scratch,
                               const float *out[KEY_BLOCK]) {
    for (int i = 0; i < KEY_BLOCK; i++) out[i] = cache_row(head, j + i, head_dim, bf16, scratch + i * head_dim);
}
#endif

/* The queries [t0, t1) of kv head g's group (query t = h_in_group * rows + r: the rows of one head
 * are adjacent in q), over the slots dovetail_attention describes. longest: the most slots any row
 * sees. Each query's scores, softmax and sums are its own, so how the group's queries are cut into
 * ranges never changes a bit. Returns 0, or DOVETAIL_NO_MEMORY. */
static int attend_queries(const float *q, const void *keys, const void *values, int bf16, int64_t max_len,
                          int64_t shared, const int64_t *extra, const int64_t *extra_start, float *out,
                          int64_t rows, int64_t group, int64_t head_dim, float scale, int64_t longest, int64_t g,
                          int64_t t0, int64_t t1) {
    int64_t count = t1 - t0;
    size_t element = bf16 ? sizeof(uint16_t) : sizeof(float);
    float *scores = (float *)malloc((size_t)(count * longest) * sizeof(float));
    float *acc = (float *)calloc((size_t)(count * head_dim), sizeof(float));
    float *row = (float *)malloc((size_t)(KEY_BLOCK * head_dim) * sizeof(float)); /* bf16 rows widened */
    if (scores == NULL || acc == NULL || row == NULL) {
        free(scores);
        free(acc);
        free(row);
        return DOVETAIL_NO_MEMORY;
    }
    const char *k_head = (const char *)keys + (size_t)(g * max_len * head_dim) * element;
    const char *v_head = (const char *)values + (size_t)(g * max_len * head_dim) * element;
    /* local query u is the group's query t0 + u */
    const float *q_range = q + (g * group * rows + t0) * head_dim;
    float *out_range = out + (g * group * rows + t0) * head_dim;
    /* Shared slots [0, blocked) go KEY_BLOCK at a time (the vector path), the rest one by one:
     * the same bits either way. Each is read once for every query of the range. */
    int64_t blocked = DOVETAIL_KEY_BLOCKS && head_dim % 8 == 0 ? shared / KEY_BLOCK * KEY_BLOCK : 0;
#if DOVETAIL_KEY_BLOCKS
    for (int64_t j = 0; j < blocked; j += KEY_BLOCK) {
        const float *k[KEY_BLOCK];
        cache_block(k_head, j, head_dim, bf16, row, k);
        for (int64_t u = 0; u < count; u++)
            _mm256_storeu_ps(scores + u * longest + j, scores8(q_range + u * head_dim, k, head_dim, scale));
    }
#endif
    for (int64_t j = blocked; j < shared; j++) {
        const float *k = cache_row(k_head, j, head_dim, bf16, row);
        for (int64_t u = 0; u < count; u++) scores[u * longest + j] = dot_fixed(q_range + u * head_dim, k, head_dim) * scale;
    }
    for (int64_t u = 0; u < count; u++) {
        int64_t r = (t0 + u) % rows;
        for (int64_t e = extra_start[r]; e < extra_start[r + 1]; e++)
            scores[u * longest + shared + e - extra_start[r]] =
                dot_fixed(q_range + u * head_dim, cache_row(k_head, shared + extra[e], head_dim, bf16, row),
                          head_dim) * scale;
    }
    /* Softmax numerators in place; the denominators later, in the same ascending order. */
    for (int64_t u = 0; u < count; u++) {
        int64_t r = (t0 + u) % rows;
        softmax_numerators(scores + u * longest, shared + extra_start[r + 1] - extra_start[r]);
    }
#if DOVETAIL_KEY_BLOCKS
    for (int64_t j = 0; j < blocked; j += KEY_BLOCK) {
        const float *v[KEY_BLOCK];
        cache_block(v_head, j, head_dim, bf16, row, v);
        for (int64_t u = 0; u < count; u++) add_scaled8(acc + u * head_dim, v, scores + u * longest + j, head_dim);
    }
#endif
    for (int64_t j = blocked; j < shared; j++) {
        const float *v = cache_row(v_head, j, head_dim, bf16, row);
        for (int64_t u = 0; u < count; u++) add_scaled(acc + u * head_dim, v, scores[u * longest + j], head_dim);
    }
    for (int64_t u = 0; u < count; u++) {
        int64_t r = (t0 + u) % rows, n = shared + extra_start[r + 1] - extra_start[r];
        const float *s = scores + u * longest;
        for (int64_t e = extra_start[r]; e < extra_start[r + 1]; e++)
            add_scaled(acc + u * head_dim, cache_row(v_head, shared + extra[e], head_dim, bf16, row),
                       s[shared + e - extra_start[r]], head_dim);
        float total = 0.0f;
        for (int64_t j = 0; j < n; j++) total += s[j];
        float inverse = 1.0f / total;
        float *o = out_range + u * head_dim;
        for (int64_t i = 0; i < head_dim; i++) o[i] = acc[u * head_dim + i] * inverse;
    }
    free(scores);
    free(acc);
    free(row);
    return 0;
}

/* q, out: [heads, rows, head_dim], fp32. keys, values: one layer's cache, [kv_heads, max_len,
 * head_dim], fp32 or (bf16 != 0) bf16; either way the arithmetic is fp32.
 * Row r attends to slots [0, shared) and then to shared + extra[e] for e in extra_start[r] ..
 * extra_start[r + 1] - 1, in that order (a decode: rows = 1, shared = its length, no extra slots;
 * a tree: shared = the committed prefix, the tree's rows at the slots after it in node order,
 * extra = each node's path of node indices, root first). Returns 0, or DOVETAIL_NO_MEMORY if scratch
 * memory could not be allocated.
 * Work split: all kv heads' queries in one line, each thread an equal stretch of it (a kv head's
 * keys read once for each stretch that holds some of its queries). Why not a kv head a thread: a
 * model with 3 kv heads (SmolLM2-135M) on 2 threads left one thread idle a third of the time. */
int dovetail_attention(const float *q, const void *keys, const void *values, int bf16, int64_t max_len,
                       int64_t shared, const int64_t *extra, const int64_t *extra_start, float *out, int64_t rows,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, int threads) {
    int64_t group = heads / kv_heads, queries = group * rows, all = kv_heads * queries;
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t n = shared + extra_start[r + 1] - extra_start[r];
        longest = n > longest ? n : longest;
    }
    int failed = 0, parts = threads > 0 ? threads : 1;
#pragma omp parallel for num_threads(parts) schedule(static, 1) reduction(|| : failed)
    for (int64_t part = 0; part < parts; part++) {
        int64_t from = all * part / parts, to = all * (part + 1) / parts;
        while (from < to && !failed) { /* the stretch's pieces, one kv head at a time */
            int64_t g = from / queries, t0 = from % queries;
            int64_t t1 = to - g * queries < queries ? to - g * queries : queries;
            failed = attend_queries(q, keys, values, bf16, max_len, shared, extra, extra_start, out, rows, group,
                                    head_dim, scale, longest, g, t0, t1) != 0;
            from = g * queries + t1;
        }
    }
    return failed ? DOVETAIL_NO_MEMORY : 0;
}

#define CAUSAL_TILE 32 /* prompt rows per work item: their queries, scores and sums stay in L2 */

/* One thread's scratch for causal tiles, sized once for the longest tile of the call (a tile's
 * scores are queries x keys: allocating them per tile, megabytes at a long prompt, cost a fresh
 * mapping and its page faults every time). */
typedef struct {
    float *scores; /* group * CAUSAL_TILE rows of up to start + rows keys */
    float *acc;    /* group * CAUSAL_TILE rows of head_dim */
    float *row;    /* KEY_BLOCK cache rows widened from bf16 */
} causal_scratch;

/* The scores, softmax and output of one kv head's queries for prompt rows [r0, r1), row r over
 * slots [0, start + r + 1): per row, exactly the sums dovetail_attention makes for a decode of
 * that row (scores8 and dot_fixed, add_scaled8 and add_scaled give the same bits, so which keys
 * go in blocks does not matter, only their order, ascending). */
static void causal_tile(const float *q_group, const void *k_head, const void *v_head, int bf16, int64_t start,
                        int64_t r0, int64_t r1, int64_t rows, int64_t group, int64_t head_dim, float scale,
                        float *out_group, const causal_scratch *scratch) {
    int64_t count = r1 - r0, longest = start + r1, queries = group * count;
    float *scores = scratch->scores, *acc = scratch->acc, *row = scratch->row;
    memset(acc, 0, (size_t)(queries * head_dim) * sizeof(float));
    /* local query u = h * count + (r - r0); its head-major index in q is h * rows + r */
#define CAUSAL_Q(u) (q_group + (((u) / count) * rows + r0 + (u) % count) * head_dim)
#define CAUSAL_KEYS(u) (start + r0 + (u) % count + 1)
    int blocks = DOVETAIL_KEY_BLOCKS && head_dim % 8 == 0;
#if DOVETAIL_KEY_BLOCKS
    for (int64_t j = 0; blocks && j + KEY_BLOCK <= longest; j += KEY_BLOCK) {
        const float *k[KEY_BLOCK];
        cache_block(k_head, j, head_dim, bf16, row, k);
        for (int64_t u = 0; u < queries; u++)
            if (j + KEY_BLOCK <= CAUSAL_KEYS(u))
                _mm256_storeu_ps(scores + u * longest + j, scores8(CAUSAL_Q(u), k, head_dim, scale));
    }
#endif
    for (int64_t u = 0; u < queries; u++) {
        int64_t n = CAUSAL_KEYS(u), tail = blocks ? n / KEY_BLOCK * KEY_BLOCK : 0;
        for (int64_t t = tail; t < n; t++)
            scores[u * longest + t] = dot_fixed(CAUSAL_Q(u), cache_row(k_head, t, head_dim, bf16, row), head_dim) * scale;
        softmax_numerators(scores + u * longest, n);
    }
#if DOVETAIL_KEY_BLOCKS
    for (int64_t j = 0; blocks && j + KEY_BLOCK <= longest; j += KEY_BLOCK) {
        const float *v[KEY_BLOCK];
        cache_block(v_head, j, head_dim, bf16, row, v);
        for (int64_t u = 0; u < queries; u++)
            if (j + KEY_BLOCK <= CAUSAL_KEYS(u)) add_scaled8(acc + u * head_dim, v, scores + u * longest + j, head_dim);
    }
#endif
    for (int64_t u = 0; u < queries; u++) {
        int64_t n = CAUSAL_KEYS(u), tail = blocks ? n / KEY_BLOCK * KEY_BLOCK : 0;
        const float *s = scores + u * longest;
        for (int64_t t = tail; t < n; t++) add_scaled(acc + u * head_dim, cache_row(v_head, t, head_dim, bf16, row), s[t], head_dim);
        float total = 0.0f;
        for (int64_t t = 0; t < n; t++) total += s[t];
        float inverse = 1.0f / total;
        float *o = out_group + (CAUSAL_Q(u) - q_group);
        for (int64_t i = 0; i < head_dim; i++) o[i] = acc[u * head_dim + i] * inverse;
    }
#undef CAUSAL_Q
#undef CAUSAL_KEYS
}

/* A prompt chunk's causal attention: q, out [heads, rows, head_dim], row r at slot start + r
 * attending to slots [0, start + r + 1) of the cache (its own rows already written there).
 * Each row gets the bits dovetail_attention gives that row as a one-token decode, so a prompt's
 * attention does not depend on how it was cut into chunks: a chunk of any size (one row, a
 * batch's share, a whole prompt) rounds alike. Work items: (kv head, CAUSAL_TILE rows), handed
 * out dynamically (the last tiles see more keys). Returns 0 or DOVETAIL_NO_MEMORY. */
int dovetail_attention_causal(const float *q, const void *keys, const void *values, int bf16, int64_t max_len,
                              int64_t start, float *out, int64_t rows, int64_t heads, int64_t kv_heads,
                              int64_t head_dim, float scale, int threads) {
    int64_t group = heads / kv_heads, tiles = (rows + CAUSAL_TILE - 1) / CAUSAL_TILE;
    int64_t tile_queries = group * (rows < CAUSAL_TILE ? rows : CAUSAL_TILE);
    size_t element = bf16 ? sizeof(uint16_t) : sizeof(float);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(|| : failed)
    {
        causal_scratch scratch = {
            (float *)malloc((size_t)(tile_queries * (start + rows)) * sizeof(float)),
            (float *)malloc((size_t)(tile_queries * head_dim) * sizeof(float)),
            (float *)malloc((size_t)(KEY_BLOCK * head_dim) * sizeof(float))};
        int mine = scratch.scores == NULL || scratch.acc == NULL || scratch.row == NULL;
        /* every thread takes part in the loop (a worksharing construct), skipping items if it has no memory */
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < kv_heads * tiles; item++) {
            if (mine) continue;
            /* the last tiles first: they are the longest, so the short ones even out the end */
            int64_t g = item % kv_heads, tile = tiles - 1 - item / kv_heads;
            int64_t r0 = tile * CAUSAL_TILE, r1 = r0 + CAUSAL_TILE < rows ? r0 + CAUSAL_TILE : rows;
            const char *k_head = (const char *)keys + (size_t)(g * max_len * head_dim) * element;
            const char *v_head = (const char *)values + (size_t)(g * max_len * head_dim) * element;
            causal_tile(q + g * group * rows * head_dim, k_head, v_head, bf16, start, r0, r1, rows, group, head_dim,
                        scale, out + g * group * rows * head_dim, &scratch);
        }
        free(scratch.scores);
        free(scratch.acc);
        free(scratch.row);
        failed = failed || mine;
    }
    return failed ? DOVETAIL_NO_MEMORY : 0;
}
