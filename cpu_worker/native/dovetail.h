/* The native kernel library's interface: every function, struct and constant the kernel files
 * export, declared once. Each .c file includes it, so a declaration that drifts from its definition
 * is a compile error; cpu_worker/native/library.py mirrors it (argtypes, ctypes structs, the
 * constants) and checks the mirror against dovetail_abi() at load.
 *
 * Change a struct, a constant or a signature here and in library.py together, and bump
 * DOVETAIL_ABI_VERSION: a library built from other sources is then rebuilt, or refused with one
 * line saying what differs. */
#ifndef DOVETAIL_H
#define DOVETAIL_H

#include <stdint.h>

#ifndef DOVETAIL_ABI_VERSION /* a build flag only for tests (a deliberately mismatched library) */
#define DOVETAIL_ABI_VERSION 16
#endif

/* ---- constants shared with Python ---- */

/* An int8 weight's layout (dovetail_int8_linear, dovetail_int8_forward; int8_kernel.LAYOUTS). */
#define DOVETAIL_LAYOUT_ROWS 0   /* [n_out, k] as the model holds it */
#define DOVETAIL_LAYOUT_PACKED 1 /* blocks of 4 rows in 64-byte chunks (int8_gemv.c, block_row) */
#define DOVETAIL_LAYOUT_TILES 2  /* blocks of 16 rows in 1 KB tiles (int8_gemv.c, TILE_OUT) */

/* A dovetail_linear's kind (decoder_layers.c). */
#define DOVETAIL_LINEAR_INT8 0        /* int8, DOVETAIL_LAYOUT_ROWS */
#define DOVETAIL_LINEAR_FP32 1        /* fp32 [n_out, k] (dovetail_fp32_linear) */
#define DOVETAIL_LINEAR_INT8_PACKED 2 /* int8, DOVETAIL_LAYOUT_PACKED */
#define DOVETAIL_LINEAR_INT8_TILES 3  /* int8, DOVETAIL_LAYOUT_TILES */
#define DOVETAIL_LINEAR_BLOCK 4       /* block-quantized (dovetail_block_linear) */
#define DOVETAIL_LINEAR_BF16 5        /* bf16 [n_out, k] (dovetail_bf16_linear) */

/* A weight's source dtype (dovetail_quantize_weight_rows). */
#define DOVETAIL_DTYPE_FP32 0
#define DOVETAIL_DTYPE_FP16 1
#define DOVETAIL_DTYPE_BF16 2

/* The dot-product path a build runs (dovetail_int8_simd: 2 is AVX512-VNNI; dovetail_fp32_simd: 2 is
 * AVX-512 with FMA, 1 AVX2 with FMA). */
#define DOVETAIL_SIMD_PLAIN 0
#define DOVETAIL_SIMD_AVX2 1
#define DOVETAIL_SIMD_AVX512 2

/* A block-quantized weight's type (dovetail_block_linear; block_quant.TYPES): llama.cpp's blocks of 32. */
#define DOVETAIL_BLOCK_Q8_0 0 /* int8 values, an fp16 scale */
#define DOVETAIL_BLOCK_Q4_0 1 /* 4-bit values q - 8, an fp16 scale */
#define DOVETAIL_BLOCK_Q4_1 2 /* 4-bit values q, an fp16 scale and an fp16 minimum */

/* A draft head's fusion (dovetail_draft_fusion; gpu_worker/head.py's FUSIONS). */
#define DOVETAIL_FUSION_DGF 0 /* DGF's gate over the features and the normed embedding */
#define DOVETAIL_FUSION_FC 1  /* EAGLE-1/2's fc over [embedding; features] */

/* Statuses of dovetail_int8_forward, dovetail_attention, dovetail_decoder_layers(_capturing),
 * dovetail_eagle3_layer, dovetail_draft_fusion and dovetail_quantize_weight_rows / _blocks (0: done). */
#define DOVETAIL_NO_MEMORY (-1) /* scratch memory could not be allocated */
#define DOVETAIL_BAD_SHAPE (-2) /* a shape, segment count, capture list or fusion kind the call cannot take */

/* ---- structs passed by pointer ---- */

/* One linear layer as its module holds it (native_layers.py fills these). */
typedef struct {
    int64_t kind;           /* DOVETAIL_LINEAR_* */
    const void *weight;     /* [n_out, k], int8, fp32 or bf16; or int8 packed or in tiles */
    const float *scales;    /* int8: per-output-row weight scales */
    const int32_t *offsets; /* int8: 128 * each weight row's sum */
    const float *bias;      /* [n_out] or NULL */
    int64_t n_out, k;
    /* DOVETAIL_LINEAR_BLOCK: weight is the blocks' data, these their fp16 scales (and Q4_1's
     * minimums), the DOVETAIL_BLOCK_* type and the activation planes (1: 8 bits, 2: 16). */
    const uint16_t *block_scales, *block_minimums;
    int64_t block_type, planes;
} dovetail_linear;

typedef struct {
    const float *input_norm, *post_norm; /* RMSNorm weights [hidden] */
    dovetail_linear qkv, o, gate_up, down;
} dovetail_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, max_len;
    float eps, scale; /* RMSNorm epsilon; attention's 1 / sqrt(head_dim) */
} dovetail_shape;

/* A draft head's EAGLE-3 layer (dovetail_eagle3_layer): q/k/v read [input_norm(e); hidden_norm(g)], 2 hidden
 * wide; gated != 0 adds dgf-eagle3's gate, whose w1 and w2 read hidden and wz 2 hidden. */
typedef struct {
    const float *input_norm, *hidden_norm, *post_norm; /* RMSNorm weights [hidden] */
    dovetail_linear qkv, o, gate_up, down;
    int64_t gated;
    dovetail_linear w1, w2, wz;
} dovetail_eagle3;

/* A draft head's fusion (dovetail_draft_fusion): kind DOVETAIL_FUSION_DGF reads input_norm, w1 and w2
 * (hidden -> hidden) and wz (2 hidden -> hidden); DOVETAIL_FUSION_FC reads fc (2 hidden -> hidden). */
typedef struct {
    int64_t kind;
    const float *input_norm;
    dovetail_linear w1, w2, wz, fc;
} dovetail_fusion;

/* One sequence's rows in a call of dovetail_decoder_layers: its next `rows` rows (after the
 * previous segment's), its cache and how each row attends (see dovetail_decoder_layers; extra NULL:
 * a prompt chunk, attending causally, since ABI 15). */
typedef struct {
    int64_t rows;
    void *keys, *values; /* this sequence's cache at the first layer run [kv_heads, max_len, head_dim] */
    int64_t start, shared;
    const int64_t *extra, *extra_start;
} dovetail_segment;

/* The residual streams dovetail_decoder_layers_capturing copies out: those entering layers[layers[c]] for
 * c < count (increasing), into out [count, rows, hidden]. */
typedef struct {
    int64_t count;
    const int64_t *layers;
    float *out;
} dovetail_capture;

/* What dovetail_abi reports: the version, the size of every struct above, and every constant. New
 * fields go at the end, so an older build's report is a prefix of this one (tools.bench_library_ab
 * reads an older build's layer-loop fields so). */
typedef struct {
    int64_t version;
    int64_t linear_size, layer_size, shape_size, segment_size;
    int64_t layout_rows, layout_packed, layout_tiles;
    int64_t linear_int8, linear_fp32, linear_int8_packed, linear_int8_tiles, linear_block, linear_bf16;
    int64_t dtype_fp32, dtype_fp16, dtype_bf16;
    int64_t simd_plain, simd_avx2, simd_avx512;
    int64_t no_memory, bad_shape;
    int64_t block_q8_0, block_q4_0, block_q4_1;
    int64_t eagle3_size, fusion_size, capture_size, fusion_dgf, fusion_fc; /* since ABI 11-13 */
} dovetail_abi_info;

/* ---- abi.c ---- */

/* Fills *info when size is sizeof(dovetail_abi_info) (nothing otherwise); returns that sizeof. */
int64_t dovetail_abi(dovetail_abi_info *info, int64_t size);

/* ---- int8_gemv.c: the W8A8 int8 linear ---- */

int dovetail_int8_has_vnni(void);
int dovetail_int8_simd(void);
int dovetail_int8_amx_ready(void);
void dovetail_int8_tiles_amx_from(int rows);
void dovetail_quantize_rows(const float *x, uint8_t *xu, float *scale, int64_t rows, int64_t k);
void dovetail_widen_half(const uint16_t *h, float *out, int64_t n);
int dovetail_quantize_weight_rows(const void *w, int dtype, int8_t *q, float *scale, int64_t n_rows, int64_t k,
                                  int threads);
int dovetail_quantize_weight_layout(const void *w, int dtype, int type, uint8_t *data, float *d, float *m,
                                    int64_t n_rows, int64_t k, int threads);
void dovetail_pack_tiles(const int8_t *w, int8_t *tiles, int64_t n_rows, int64_t k, int threads);
void dovetail_weight_offsets(const int8_t *w, int32_t *offset, int64_t n_rows, int64_t k);
int dovetail_int8_linear(const uint8_t *xu, const float *x_scale, const int8_t *w, const float *w_scale,
                         const int32_t *w_offset, const float *bias, float *y, int64_t rows, int64_t n_out,
                         int64_t k, int layout, int threads);
int dovetail_int8_forward(const float *x, const int8_t *w, const float *w_scale, const int32_t *w_offset,
                          const float *bias, float *y, int64_t rows, int64_t n_out, int64_t k, int layout,
                          int threads);

/* ---- fp32_rows.c: the fp32 row kernel, on fp32 or bf16 weights ---- */

int dovetail_fp32_simd(void);
void dovetail_fp32_linear(const float *x, const float *w, const float *bias, float *y, int64_t rows,
                          int64_t n_out, int64_t k, int threads);
void dovetail_bf16_linear(const float *x, const uint16_t *w, const float *bias, float *y, int64_t rows,
                          int64_t n_out, int64_t k, int threads);

/* ---- attention.c: exact attention, and the library's one exp and one fixed-order dot ---- */

void dovetail_exp_nonpositive(float *x, int64_t n);
float dovetail_dot_fixed(const float *a, const float *b, int64_t d);
int dovetail_attention(const float *q, const void *keys, const void *values, int bf16, int64_t max_len,
                       int64_t shared, const int64_t *extra, const int64_t *extra_start, float *out, int64_t rows,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, int threads);
int dovetail_attention_causal(const float *q, const void *keys, const void *values, int bf16, int64_t max_len,
                              int64_t start, float *out, int64_t rows, int64_t heads, int64_t kv_heads,
                              int64_t head_dim, float scale, int threads);

/* ---- layer_ops.c: a decoder layer's small steps ---- */

void dovetail_rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim, float eps,
                       int threads);
void dovetail_rope_qkv(const float *qkv, const float *cos, const float *sin, float *q, void *keys, void *values,
                       int bf16, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_len,
                       int64_t start, int threads);
void dovetail_silu_mul(const float *gate, const float *up, int64_t stride, float *out, int64_t rows, int64_t width,
                       int threads);

/* ---- block_gemv.c: linears on block-quantized weights (Q8_0, Q4_0, Q4_1) ---- */

int dovetail_block_simd(void);
int dovetail_block_amx_ready(void);
void dovetail_block_amx_from(int planes);
void dovetail_quantize_blocks(const float *x, int8_t *q, float *d, int32_t *sums, int64_t rows, int64_t k,
                              int planes, int threads);
int dovetail_block_linear(const int8_t *xq, const float *xd, const int32_t *xs, int64_t rows, int planes,
                          const uint8_t *w, const uint16_t *scales, const uint16_t *minimums, int type,
                          const float *bias, float *y, int64_t n_out, int64_t k, int threads);

/* ---- block_rows.c: a GGUF table's rows (Q8_0, Q4_0, Q4_1 blocks) widened to fp32 ---- */

int dovetail_dequantize_rows(const uint8_t *table, int type, int64_t width, const int64_t *ids, int64_t count,
                             float *out);

/* ---- decoder_layers.c: a target's decoder layers in one call; a draft head's EAGLE-3 layer, its fusion ---- */

int64_t dovetail_decoder_scratch(const dovetail_shape *shape, int64_t rows);
int dovetail_decoder_layers(float *x, const dovetail_layer *layers, int64_t count, const dovetail_shape *shape,
                            const float *cos, const float *sin, const dovetail_segment *segments,
                            int64_t segment_count, int bf16, int64_t rows, float *scratch, int threads);
int dovetail_decoder_layers_capturing(float *x, const dovetail_layer *layers, int64_t count,
                                      const dovetail_shape *shape, const float *cos, const float *sin,
                                      const dovetail_segment *segments, int64_t segment_count, int bf16, int64_t rows,
                                      float *scratch, const dovetail_capture *capture, int threads);
int dovetail_decoder_finish(const float *x, const float *norm_weight, float eps, const dovetail_linear *head,
                            int64_t rows, int64_t hidden, const int64_t *picked, int64_t count, float *features,
                            float *logits, int threads); /* since ABI 16 */
int64_t dovetail_eagle3_scratch(const dovetail_shape *shape, int64_t rows);
int dovetail_eagle3_layer(float *x, const float *embedded, const dovetail_eagle3 *layer, const dovetail_shape *shape,
                          const float *cos, const float *sin, const dovetail_segment *segments,
                          int64_t segment_count, int bf16, int64_t rows, float *scratch, int threads);
int64_t dovetail_fusion_scratch(int64_t hidden, int64_t rows);
int dovetail_draft_fusion(float *x, const float *features, const float *embedded, const dovetail_fusion *fusion,
                          int64_t hidden, float eps, int64_t rows, float *scratch, int threads);

#endif
