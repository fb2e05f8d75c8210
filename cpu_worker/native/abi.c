/* The library's report of its interface (dovetail.h), which library.py compares with its ctypes
 * mirror at load: a library built from other sources than the Python beside it (a stale cache, a
 * hand-built copy) then shows up as a rebuild or a one-line error, never as a call that reads a
 * struct at the wrong offsets. */
#include "dovetail.h"

#include <string.h>

int64_t dovetail_abi(dovetail_abi_info *info, int64_t size) {
    if (size != (int64_t)sizeof(dovetail_abi_info)) return (int64_t)sizeof(dovetail_abi_info);
    memset(info, 0, sizeof *info);
    info->version = DOVETAIL_ABI_VERSION;
    info->linear_size = sizeof(dovetail_linear);
    info->layer_size = sizeof(dovetail_layer);
    info->shape_size = sizeof(dovetail_shape);
    info->segment_size = sizeof(dovetail_segment);
    info->eagle3_size = sizeof(dovetail_eagle3);
    info->fusion_size = sizeof(dovetail_fusion);
    info->capture_size = sizeof(dovetail_capture);
    info->layout_rows = DOVETAIL_LAYOUT_ROWS;
    info->layout_packed = DOVETAIL_LAYOUT_PACKED;
    info->layout_tiles = DOVETAIL_LAYOUT_TILES;
    info->linear_int8 = DOVETAIL_LINEAR_INT8;
    info->linear_fp32 = DOVETAIL_LINEAR_FP32;
    info->linear_int8_packed = DOVETAIL_LINEAR_INT8_PACKED;
    info->linear_int8_tiles = DOVETAIL_LINEAR_INT8_TILES;
    info->linear_block = DOVETAIL_LINEAR_BLOCK;
    info->linear_bf16 = DOVETAIL_LINEAR_BF16;
    info->dtype_fp32 = DOVETAIL_DTYPE_FP32;
    info->dtype_fp16 = DOVETAIL_DTYPE_FP16;
    info->dtype_bf16 = DOVETAIL_DTYPE_BF16;
    info->simd_plain = DOVETAIL_SIMD_PLAIN;
    info->simd_avx2 = DOVETAIL_SIMD_AVX2;
    info->simd_avx512 = DOVETAIL_SIMD_AVX512;
    info->no_memory = DOVETAIL_NO_MEMORY;
    info->bad_shape = DOVETAIL_BAD_SHAPE;
    info->block_q8_0 = DOVETAIL_BLOCK_Q8_0;
    info->block_q4_0 = DOVETAIL_BLOCK_Q4_0;
    info->block_q4_1 = DOVETAIL_BLOCK_Q4_1;
    info->fusion_dgf = DOVETAIL_FUSION_DGF;
    info->fusion_fc = DOVETAIL_FUSION_FC;
    return (int64_t)sizeof(dovetail_abi_info);
}
