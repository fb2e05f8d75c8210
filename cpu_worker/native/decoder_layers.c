/* A target's decoder layers in one foreign call: a decode step's or a tree's rows through every
 * layer (or a run of them) with the library's own kernels, in the order the Python layers call
 * them. And a CPU draft head's layers (at the end): an EAGLE-3 head's layer in one call
 * (dovetail_eagle3_layer), a DGF or EAGLE-1/2 head's fusion in one (dovetail_draft_fusion), whose
 * layers then take the target's loop (a first layer without an input norm).
 *
 * Why: at a decode step the work between the linear layers is small, but each layer made about a
 * dozen torch ops and half a dozen foreign calls around it (views, slices, the residual adds, the
 * SiLU, the attention output's transpose). On the 1B stand-in that glue was the gap to llama.cpp
 * (docs/kernels.md, "Decoder layers in one call"; python -m tools.bench_layer_loop). Here it is a
 * loop in C.
 *
 * Same bits as the Python layers: every step is the same kernel the module calls (RMSNorm,
 * int8, block, fp32 or bf16 row linear, rotary and cache write, exact attention, SiLU from layer_ops.c), and the
 * steps that are torch's in Python (the residual add, the transpose) are exact. So a row's values
 * depend on nothing else in its call, and a tree node equals its decode step bit for bit, whichever
 * path either took.
 */
#include "dovetail.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A block-quantized layer: its rows' activations quantized per block (dovetail_block_linear's
 * input), then the layer. */
static int block_layer(const dovetail_linear *layer, const float *x, float *y, int64_t rows, int threads) {
    int64_t k = layer->k, blocks = k / 32, planes = layer->planes;
    int8_t *xq = (int8_t *)malloc((size_t)(rows * planes * k));
    float *xd = (float *)malloc((size_t)(rows * blocks) * sizeof(float));
    int32_t *xs = (int32_t *)malloc((size_t)(rows * blocks) * sizeof(int32_t));
    int status = DOVETAIL_NO_MEMORY;
    if (xq != NULL && xd != NULL && xs != NULL) {
        dovetail_quantize_blocks(x, xq, xd, xs, rows, k, (int)planes, threads);
        status = dovetail_block_linear(xq, xd, xs, rows, (int)planes, (const uint8_t *)layer->weight,
                                       layer->block_scales, layer->block_minimums, (int)layer->block_type,
                                       layer->bias, y, layer->n_out, k, threads);
    }
    free(xq);
    free(xd);
    free(xs);
    return status == 0 ? 0 : DOVETAIL_NO_MEMORY;
}

static int linear(const dovetail_linear *layer, const float *x, float *y, int64_t rows, int threads) {
    if (layer->kind == DOVETAIL_LINEAR_BLOCK) return block_layer(layer, x, y, rows, threads);
    if (layer->kind == DOVETAIL_LINEAR_BF16) {
        dovetail_bf16_linear(x, (const uint16_t *)layer->weight, layer->bias, y, rows, layer->n_out, layer->k, threads);
        return 0;
    }
    if (layer->kind != DOVETAIL_LINEAR_FP32) {
        int layout = layer->kind == DOVETAIL_LINEAR_INT8_TILES    ? DOVETAIL_LAYOUT_TILES
                     : layer->kind == DOVETAIL_LINEAR_INT8_PACKED ? DOVETAIL_LAYOUT_PACKED
                                                                  : DOVETAIL_LAYOUT_ROWS;
        return dovetail_int8_forward(x, (const int8_t *)layer->weight, layer->scales, layer->offsets, layer->bias, y,
                                     rows, layer->n_out, layer->k, layout, threads);
    }
    dovetail_fp32_linear(x, (const float *)layer->weight, layer->bias, y, rows, layer->n_out, layer->k, threads);
    return 0;
}

/* qkv [rows, (heads + 2 kv_heads) hd]: each segment's rows rotated, their keys and values written to
 * its cache layer `layer`, its queries attending as the segment says; the heads' outputs merged
 * [rows, heads hd] as o_proj reads them. q and attended: [rows, heads hd] scratch each. */
static int attend_segments(const float *qkv, const float *cos, const float *sin, const dovetail_segment *segments,
                           int64_t segment_count, int64_t layer, const dovetail_shape *shape, int bf16, float *q,
                           float *attended, float *merged, int threads) {
    int64_t heads = shape->heads, kv_heads = shape->kv_heads, head_dim = shape->head_dim;
    int64_t attention = heads * head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim;
    size_t layer_bytes = (size_t)(kv_heads * shape->max_len * head_dim) * (bf16 ? 2 : 4);
    int64_t first = 0;
    for (int64_t s = 0; s < segment_count; s++) {
        const dovetail_segment *segment = segments + s;
        int64_t n = segment->rows;
        void *layer_keys = (char *)segment->keys + layer * layer_bytes;
        void *layer_values = (char *)segment->values + layer * layer_bytes;
        float *segment_q = q + first * attention, *segment_attended = attended + first * attention;
        dovetail_rope_qkv(qkv + first * qkv_width, cos + first * head_dim, sin + first * head_dim, segment_q,
                          layer_keys, layer_values, bf16, n, heads, kv_heads, head_dim, shape->max_len,
                          segment->start, threads);
        int status = segment->extra == NULL /* a prompt chunk: row r attends to slots [0, start + r] */
                         ? dovetail_attention_causal(segment_q, layer_keys, layer_values, bf16, shape->max_len,
                                                     segment->start, segment_attended, n, heads, kv_heads, head_dim,
                                                     shape->scale, threads)
                         : dovetail_attention(segment_q, layer_keys, layer_values, bf16, shape->max_len,
                                              segment->shared, segment->extra, segment->extra_start,
                                              segment_attended, n, heads, kv_heads, head_dim, shape->scale, threads);
        if (status != 0) return DOVETAIL_NO_MEMORY;
        for (int64_t h = 0; h < heads; h++) /* [heads, n, hd] -> [n, heads * hd], as o_proj reads it */
            for (int64_t r = 0; r < n; r++)
                memcpy(merged + (first + r) * attention + h * head_dim, segment_attended + (h * n + r) * head_dim,
                       (size_t)head_dim * sizeof(float));
        first += n;
    }
    return 0;
}

/* x += down(silu(gate) * up) of post_norm(x); gate_up [rows, 2 intermediate], the others [rows, hidden]
 * or [rows, intermediate] scratch. */
static int mlp_residual(float *x, const float *post_norm, const dovetail_linear *gate_up_layer,
                        const dovetail_linear *down, const dovetail_shape *shape, int64_t rows, float *normed,
                        float *gate_up, float *activated, float *projected, int threads) {
    int64_t hidden = shape->hidden, intermediate = shape->intermediate;
    dovetail_rms_norm(x, post_norm, normed, rows, hidden, shape->eps, threads);
    if (linear(gate_up_layer, normed, gate_up, rows, threads) != 0) return DOVETAIL_NO_MEMORY;
    dovetail_silu_mul(gate_up, gate_up + intermediate, 2 * intermediate, activated, rows, intermediate, threads);
    if (linear(down, activated, projected, rows, threads) != 0) return DOVETAIL_NO_MEMORY;
    for (int64_t i = 0; i < rows * hidden; i++) x[i] = x[i] + projected[i];
    return 0;
}

static int64_t counted_rows(const dovetail_segment *segments, int64_t segment_count) {
    int64_t total = 0;
    for (int64_t s = 0; s < segment_count; s++) total += segments[s].rows;
    return total;
}

/* Floats of scratch `dovetail_decoder_layers` needs for `rows` rows. */
int64_t dovetail_decoder_scratch(const dovetail_shape *shape, int64_t rows) {
    int64_t attention = shape->heads * shape->head_dim;
    int64_t qkv = (shape->heads + 2 * shape->kv_heads) * shape->head_dim;
    return rows * (2 * shape->hidden + qkv + 3 * attention + 3 * shape->intermediate);
}

/* The layer loop of dovetail_decoder_layers; capture (NULL: none) as dovetail_decoder_layers_capturing. */
static int run_layers(float *x, const dovetail_layer *layers, int64_t count, const dovetail_shape *shape,
                      const float *cos, const float *sin, const dovetail_segment *segments, int64_t segment_count,
                      int bf16, int64_t rows, float *scratch, const dovetail_capture *capture, int threads) {
    int64_t hidden = shape->hidden, attention = shape->heads * shape->head_dim;
    int64_t qkv_width = (shape->heads + 2 * shape->kv_heads) * shape->head_dim;
    if (segment_count < 1 || counted_rows(segments, segment_count) != rows) return DOVETAIL_BAD_SHAPE;
    float *normed = scratch;                                                  /* [rows, hidden] */
    float *qkv = normed + rows * hidden;                                      /* [rows, (heads + 2 kv) hd] */
    float *q = qkv + rows * qkv_width;                /* per segment [heads, its rows, hd], in order */
    float *attended = q + rows * attention;           /* the same */
    float *merged = attended + rows * attention;                              /* [rows, heads hd] */
    float *projected = merged + rows * attention;                             /* [rows, hidden] */
    float *gate_up = projected + rows * hidden;                               /* [rows, 2 intermediate] */
    float *activated = gate_up + rows * 2 * shape->intermediate;              /* [rows, intermediate] */
    int64_t captured = 0;
    for (int64_t l = 0; l < count; l++) {
        const dovetail_layer *layer = layers + l;
        if (capture != NULL && captured < capture->count && capture->layers[captured] == l) {
            memcpy(capture->out + captured * rows * hidden, x, (size_t)(rows * hidden) * sizeof(float));
            captured++;
        }
        if (layer->input_norm != NULL)
            dovetail_rms_norm(x, layer->input_norm, normed, rows, hidden, shape->eps, threads);
        else /* a draft head's first layer: attention reads the fused rows as they are */
            memcpy(normed, x, (size_t)(rows * hidden) * sizeof(float));
        if (linear(&layer->qkv, normed, qkv, rows, threads) != 0) return DOVETAIL_NO_MEMORY;
        if (attend_segments(qkv, cos, sin, segments, segment_count, l, shape, bf16, q, attended, merged,
                            threads) != 0)
            return DOVETAIL_NO_MEMORY;
        if (linear(&layer->o, merged, projected, rows, threads) != 0) return DOVETAIL_NO_MEMORY;
        for (int64_t i = 0; i < rows * hidden; i++) x[i] = x[i] + projected[i];
        if (mlp_residual(x, layer->post_norm, &layer->gate_up, &layer->down, shape, rows, normed, gate_up,
                         activated, projected, threads) != 0)
            return DOVETAIL_NO_MEMORY;
    }
    return 0;
}

/* x [rows, hidden]: the residual stream entering layers[0], replaced by the one leaving
 * layers[count - 1]. The rows are segment_count sequences' (segments[s].rows each, in order; one
 * for a decode step or a tree, several when sequences are verified together): every linear layer
 * takes all of them in one call (a row's bits never depend on its call-mates), while each segment
 * rotates, writes and attends over its own cache. A segment's rows sit at its cache slots start..
 * (rotated by their rows of cos/sin [rows, head_dim]); its row r attends to slots [0, shared) then
 * shared + extra[e] for e in extra_start[r] .. extra_start[r + 1] - 1 (dovetail_attention: a decode
 * has shared = start + 1 and no extra slots, a tree shared = start and each node's path), or, where
 * extra is NULL (a prompt chunk), to slots [0, start + r] (dovetail_attention_causal; shared unused).
 * keys/values: the segment's cache at the first of these layers [kv_heads, max_len, head_dim]
 * (fp32, or bf16 when bf16 != 0), the next layers' following contiguously. scratch:
 * dovetail_decoder_scratch floats. A layer whose input_norm is NULL (a draft head's first) attends over
 * x itself. Returns 0, DOVETAIL_BAD_SHAPE when the segments' rows do not add up to rows, or
 * DOVETAIL_NO_MEMORY when a kernel could not allocate its scratch. */
int dovetail_decoder_layers(float *x, const dovetail_layer *layers, int64_t count, const dovetail_shape *shape,
                            const float *cos, const float *sin, const dovetail_segment *segments,
                            int64_t segment_count, int bf16, int64_t rows, float *scratch, int threads) {
    return run_layers(x, layers, count, shape, cos, sin, segments, segment_count, bf16, rows, scratch, NULL, threads);
}

/* dovetail_decoder_layers, also copying the residual stream entering each of capture->layers
 * (indices into layers, increasing, each < count) to capture->out [capture->count, rows, hidden], in
 * order: an EAGLE-3 target's feature rows in the same call (before, one call per stretch between
 * them). Returns DOVETAIL_BAD_SHAPE, too, for capture layers that are not increasing and in range. */
int dovetail_decoder_layers_capturing(float *x, const dovetail_layer *layers, int64_t count,
                                      const dovetail_shape *shape, const float *cos, const float *sin,
                                      const dovetail_segment *segments, int64_t segment_count, int bf16, int64_t rows,
                                      float *scratch, const dovetail_capture *capture, int threads) {
    for (int64_t c = 0; c < capture->count; c++) {
        int64_t layer = capture->layers[c];
        if (layer < 0 || layer >= count || (c > 0 && layer <= capture->layers[c - 1])) return DOVETAIL_BAD_SHAPE;
    }
    return run_layers(x, layers, count, shape, cos, sin, segments, segment_count, bf16, rows, scratch, capture,
                      threads);
}

/* A model's steps after its layers, in the same call as far as Python is concerned: features [rows, hidden] =
 * RMSNorm(x) (norm_weight, eps: the final norm, every row), then logits [count, head->n_out] = head(features[
 * picked[i]]) for the count rows picked. The same kernels the Python modules call, so the same bits; what
 * it spares is their Python, which a step runs with caches the weights just swept (~0.2 ms a step on the
 * 135M target). Returns 0, DOVETAIL_BAD_SHAPE (a picked row outside [0, rows), a head not reading hidden
 * values) or DOVETAIL_NO_MEMORY. */
int dovetail_decoder_finish(const float *x, const float *norm_weight, float eps, const dovetail_linear *head,
                            int64_t rows, int64_t hidden, const int64_t *picked, int64_t count, float *features,
                            float *logits, int threads) {
    if (head->k != hidden || count < 1) return DOVETAIL_BAD_SHAPE;
    int contiguous = 1; /* the picked rows are rows[first .. first + count): no copy */
    for (int64_t i = 0; i < count; i++) {
        if (picked[i] < 0 || picked[i] >= rows) return DOVETAIL_BAD_SHAPE;
        contiguous = contiguous && picked[i] == picked[0] + i;
    }
    dovetail_rms_norm(x, norm_weight, features, rows, hidden, eps, threads);
    if (contiguous) return linear(head, features + picked[0] * hidden, logits, count, threads);
    float *gathered = (float *)malloc((size_t)(count * hidden) * sizeof(float));
    if (gathered == NULL) return DOVETAIL_NO_MEMORY;
    for (int64_t i = 0; i < count; i++)
        memcpy(gathered + i * hidden, features + picked[i] * hidden, (size_t)hidden * sizeof(float));
    int status = linear(head, gathered, logits, count, threads);
    free(gathered);
    return status;
}

/* ---- a draft head's EAGLE-3 layer (gpu_worker/eagle3.py) ---- */

/* Floats of scratch `dovetail_eagle3_layer` needs for `rows` rows. */
int64_t dovetail_eagle3_scratch(const dovetail_shape *shape, int64_t rows) {
    int64_t attention = shape->heads * shape->head_dim;
    int64_t qkv = (shape->heads + 2 * shape->kv_heads) * shape->head_dim;
    /* b, a, the 2 hidden join, projected and the gate's 2 hidden spare: 7 hidden a row */
    return rows * (7 * shape->hidden + qkv + 3 * attention + 3 * shape->intermediate);
}

/* sigmoid(v) from e = exp(-|v|), which never overflows; e: [n] scratch. */
static void sigmoid_rows(const float *v, float *out, float *e, int64_t n) {
    for (int64_t i = 0; i < n; i++) e[i] = v[i] >= 0.0f ? -v[i] : v[i];
    dovetail_exp_nonpositive(e, n);
    for (int64_t i = 0; i < n; i++) out[i] = v[i] >= 0.0f ? 1.0f / (1.0f + e[i]) : e[i] / (1.0f + e[i]);
}

/* DGF's gate (Dovetail's fusion, also dgf-eagle3's): x += z * h1 + (1 - z) * h2 with h1 = a W_1,
 * h2 = silu(b W_2), z = sigmoid([h1; h2] W_z); a, b [rows, hidden]; h [rows, 2 hidden], z and e
 * [rows, hidden] scratch. */
static int gate_residual(float *x, const float *a, const float *b, const dovetail_linear *w1, const dovetail_linear *w2,
                         const dovetail_linear *wz, int64_t hidden, int64_t rows, float *h, float *z, float *e,
                         int threads) {
    float *h1 = z, *h2 = e; /* staged here, then joined in h */
    if (linear(w1, a, h1, rows, threads) != 0 || linear(w2, b, h2, rows, threads) != 0) return DOVETAIL_NO_MEMORY;
    for (int64_t r = 0; r < rows; r++) {
        memcpy(h + r * 2 * hidden, h1 + r * hidden, (size_t)hidden * sizeof(float));
        memcpy(h + r * 2 * hidden + hidden, h2 + r * hidden, (size_t)hidden * sizeof(float));
    }
    for (int64_t r = 0; r < rows; r++) { /* h2 = silu(b W_2) = v * sigmoid(v), in place */
        float *v = h + r * 2 * hidden + hidden;
        sigmoid_rows(v, z, e, hidden);
        for (int64_t i = 0; i < hidden; i++) v[i] = v[i] * z[i];
    }
    if (linear(wz, h, z, rows, threads) != 0) return DOVETAIL_NO_MEMORY;
    sigmoid_rows(z, z, e, rows * hidden);
    for (int64_t r = 0; r < rows; r++) {
        const float *g1 = h + r * 2 * hidden, *g2 = g1 + hidden, *zr = z + r * hidden;
        float *xr = x + r * hidden;
        for (int64_t i = 0; i < hidden; i++) xr[i] = (xr[i] + zr[i] * g1[i]) + (1.0f - zr[i]) * g2[i];
    }
    return 0;
}

/* Joins two [rows, hidden] blocks row by row into [rows, 2 hidden]: [first; second]. */
static void join_rows(const float *first, const float *second, float *joined, int64_t hidden, int64_t rows) {
    for (int64_t r = 0; r < rows; r++) {
        memcpy(joined + r * 2 * hidden, first + r * hidden, (size_t)hidden * sizeof(float));
        memcpy(joined + r * 2 * hidden + hidden, second + r * hidden, (size_t)hidden * sizeof(float));
    }
}

/* The EAGLE-3 layer of a draft head: x [rows, hidden] holds g (the rows' features, already through
 * fc) and is replaced by the layer's output
 *     x = g + Attn([input_norm(e); hidden_norm(g)]) (+ the gate for dgf-eagle3)
 *     out = x + MLP(post_norm(x))
 * with e the rows' token embeddings [rows, hidden]; q/k/v read the 2 hidden-wide join. Segments,
 * cos/sin, bf16 and the status as for dovetail_decoder_layers (the keys and values of segments[s]
 * are the head's cache layer 0); scratch: dovetail_eagle3_scratch floats. The draft only proposes
 * (the target verifies every token), so nothing here needs the Python layer's bits; each row still
 * depends on nothing else in its call. */
int dovetail_eagle3_layer(float *x, const float *embedded, const dovetail_eagle3 *layer, const dovetail_shape *shape,
                          const float *cos, const float *sin, const dovetail_segment *segments,
                          int64_t segment_count, int bf16, int64_t rows, float *scratch, int threads) {
    int64_t hidden = shape->hidden, attention = shape->heads * shape->head_dim;
    int64_t qkv_width = (shape->heads + 2 * shape->kv_heads) * shape->head_dim;
    if (segment_count < 1 || counted_rows(segments, segment_count) != rows) return DOVETAIL_BAD_SHAPE;
    float *b = scratch;                                   /* [rows, hidden]: input_norm(e) */
    float *a = b + rows * hidden;                         /* [rows, hidden]: hidden_norm(g) */
    float *joined = a + rows * hidden;                    /* [rows, 2 hidden]: [b; a], then the gate's [h1; h2] */
    float *qkv = joined + rows * 2 * hidden;              /* [rows, (heads + 2 kv) hd] */
    float *q = qkv + rows * qkv_width;                    /* [rows, heads hd] */
    float *attended = q + rows * attention;               /* [rows, heads hd] */
    float *merged = attended + rows * attention;          /* [rows, heads hd] */
    float *projected = merged + rows * attention;         /* [rows, hidden] */
    float *gate_up = projected + rows * hidden;           /* [rows, 2 intermediate] */
    float *activated = gate_up + rows * 2 * shape->intermediate; /* [rows, intermediate] */
    float *spare = activated + rows * shape->intermediate;       /* [rows, 2 hidden] */
    dovetail_rms_norm(embedded, layer->input_norm, b, rows, hidden, shape->eps, threads);
    dovetail_rms_norm(x, layer->hidden_norm, a, rows, hidden, shape->eps, threads);
    join_rows(b, a, joined, hidden, rows);
    if (linear(&layer->qkv, joined, qkv, rows, threads) != 0) return DOVETAIL_NO_MEMORY;
    if (attend_segments(qkv, cos, sin, segments, segment_count, 0, shape, bf16, q, attended, merged, threads) != 0)
        return DOVETAIL_NO_MEMORY;
    if (linear(&layer->o, merged, projected, rows, threads) != 0) return DOVETAIL_NO_MEMORY;
    for (int64_t i = 0; i < rows * hidden; i++) x[i] = x[i] + projected[i];
    if (layer->gated && gate_residual(x, a, b, &layer->w1, &layer->w2, &layer->wz, hidden, rows, joined, spare,
                                      spare + rows * hidden, threads) != 0)
        return DOVETAIL_NO_MEMORY;
    return mlp_residual(x, layer->post_norm, &layer->gate_up, &layer->down, shape, rows, b, gate_up, activated,
                        projected, threads);
}

/* ---- a draft head's fusion (gpu_worker/head.py): the rows its first decoder layer reads ---- */

/* Floats of scratch `dovetail_draft_fusion` needs for `rows` rows of `hidden`. */
int64_t dovetail_fusion_scratch(int64_t hidden, int64_t rows) { return rows * 5 * hidden; }

/* x [rows, hidden] = the fusion of features [rows, hidden] (the target's) and embedded [rows, hidden]
 * (the tokens'): DGF's gate z * h1 + (1 - z) * h2 over features and input_norm(embedded)
 * (DOVETAIL_FUSION_DGF), or fc([embedded; features]) (DOVETAIL_FUSION_FC, EAGLE-1/2). scratch:
 * dovetail_fusion_scratch floats. Returns 0, DOVETAIL_BAD_SHAPE for an unknown kind, or DOVETAIL_NO_MEMORY. */
int dovetail_draft_fusion(float *x, const float *features, const float *embedded, const dovetail_fusion *fusion,
                          int64_t hidden, float eps, int64_t rows, float *scratch, int threads) {
    if (fusion->kind == DOVETAIL_FUSION_FC) {
        join_rows(embedded, features, scratch, hidden, rows);
        return linear(&fusion->fc, scratch, x, rows, threads) == 0 ? 0 : DOVETAIL_NO_MEMORY;
    }
    if (fusion->kind != DOVETAIL_FUSION_DGF) return DOVETAIL_BAD_SHAPE;
    float *b = scratch, *h = b + rows * hidden, *z = h + rows * 2 * hidden, *e = z + rows * hidden;
    dovetail_rms_norm(embedded, fusion->input_norm, b, rows, hidden, eps, threads);
    memset(x, 0, (size_t)(rows * hidden) * sizeof(float)); /* 0 + z * h1 is z * h1 exactly */
    return gate_residual(x, features, b, &fusion->w1, &fusion->w2, &fusion->wz, hidden, rows, h, z, e, threads);
}
