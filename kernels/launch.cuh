// launch.cuh — the kernels' launch constants, in one place: the kernels size their loops and
// shared memory by them, and backends/cuda/launches.py reads this file to size grids, blocks
// and scratch the same way (no Python copy to drift).
#pragma once

// attention.cu
#define ATT_SPLIT_TILE 256  // positions a block of attn_exact_scores_q8 scores
#define ATT_PV_STAGE 128  // producer threads of attn_exact_pv_q8 (two warps of consumers besides)
#define ATT_PV_THREADS (64 + ATT_PV_STAGE)
#define ATT_FAST_TILE 32  // positions a part block of the fast flash decoding takes
#define ATT_FAST_WARPS 8  // query heads a part block works on at once

// gemv.cuh
#define GEMV_ROWS1 4  // rows a warp of the q4_0 dense GEMVs at M = 1
#define EXPERT_ROWS 4  // rows a warp of gemv_q4_experts_*

// moe.cuh
#define MOE_MAX_EXPERTS 992  // router_*: one a thread, and the exact block has one warp more (1024)
#define MOE_MAX_TOPK 64  // router_*: the selected experts' p in shared memory

// hash.cu
#define SCAN_THREADS 512  // fnv_scan's block: keys up to SCAN_THREADS * SCAN_SEG bytes
#define SCAN_SEG 32  // bytes a thread of fnv_scan

// fused.cu
#define FUSED_MAX_ROW 4096  // combine_rmsnorm_*: hidden sizes up to
#define COMBINE_MAX_K 8  // down_combine_*: a warp a slot, up to this many slots
#define SWIGLU_THREADS 512  // experts_swiglu_*: 32 rows of gate and of up, EXPERT_ROWS a warp
