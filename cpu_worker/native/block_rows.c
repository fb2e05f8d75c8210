/* A GGUF table's rows widened to fp32 on lookup (a quantized model's token embedding, kept as the
 * file stores it: cpu_worker/model/embedding.py).
 *
 * Why here: a decode step looks up one row, and gguf's numpy dequantizer spent ~0.15 ms on it in
 * array splits and views, 3% of a SmolLM2-135M step on two cores. Same values as
 * gguf.quants.dequantize, in the same float operations: Q8_0 q * d, Q4_0 d * (q - 8), Q4_1
 * (d * q) + m, with d and m widened from fp16 exactly (built with -ffp-contract=off: no fused
 * multiply-add).
 *
 * GGUF's blocks of 32 values: Q8_0 an fp16 d and 32 int8; Q4_0 d and 16 bytes, value j the low
 * nibble of byte j and value j + 16 its high nibble; Q4_1 d, m and the same 16 bytes. */
#include "dovetail.h"

#include <string.h>

#define ROW_BLOCK 32

static float widened(const uint8_t *half) {
    uint16_t bits;
    float value;
    memcpy(&bits, half, sizeof bits);
    dovetail_widen_half(&bits, &value, 1);
    return value;
}

static void dequantize_block(const uint8_t *block, int type, float *out) {
    float d = widened(block);
    if (type == DOVETAIL_BLOCK_Q8_0) {
        const int8_t *q = (const int8_t *)(block + 2);
        for (int j = 0; j < ROW_BLOCK; j++) out[j] = (float)q[j] * d;
        return;
    }
    const uint8_t *q = block + (type == DOVETAIL_BLOCK_Q4_1 ? 4 : 2);
    if (type == DOVETAIL_BLOCK_Q4_0) {
        for (int j = 0; j < ROW_BLOCK / 2; j++) {
            out[j] = d * (float)((q[j] & 0x0f) - 8);
            out[j + ROW_BLOCK / 2] = d * (float)((q[j] >> 4) - 8);
        }
        return;
    }
    float m = widened(block + 2);
    for (int j = 0; j < ROW_BLOCK / 2; j++) {
        out[j] = d * (float)(q[j] & 0x0f) + m;
        out[j + ROW_BLOCK / 2] = d * (float)(q[j] >> 4) + m;
    }
}

/* Block bytes of a type (GGUF's sizes), 0 for a type this file does not read. */
static int64_t block_bytes(int type) {
    switch (type) {
    case DOVETAIL_BLOCK_Q8_0: return 2 + ROW_BLOCK;
    case DOVETAIL_BLOCK_Q4_0: return 2 + ROW_BLOCK / 2;
    case DOVETAIL_BLOCK_Q4_1: return 4 + ROW_BLOCK / 2;
    default: return 0;
    }
}

/* out[i] [width] = row ids[i] of table [rows, width / 32 blocks] of `type`. The caller checks
 * the ids. Returns 0, or DOVETAIL_BAD_SHAPE for an unknown type or a width that is not whole
 * blocks. */
int dovetail_dequantize_rows(const uint8_t *table, int type, int64_t width, const int64_t *ids, int64_t count,
                             float *out) {
    int64_t bytes = block_bytes(type), blocks = width / ROW_BLOCK;
    if (bytes == 0 || width <= 0 || width % ROW_BLOCK != 0) return DOVETAIL_BAD_SHAPE;
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = table + ids[i] * blocks * bytes;
        for (int64_t b = 0; b < blocks; b++) dequantize_block(row + b * bytes, type, out + i * width + b * ROW_BLOCK);
    }
    return 0;
}
