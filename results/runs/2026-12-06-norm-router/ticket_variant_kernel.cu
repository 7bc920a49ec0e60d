// The rmsnorm_router_* kernel of calls 2-4 (kernels/fused.cu), beside gemv.cuh's gemv_q4_m1 with a
// `Wait wait` hook in place of its pdl_wait() (as in rmsnorm_router_one_block.patch) and
// NORM_THREADS moved to launch.cuh. The plan launched it at M = 1 for a MoE layer's
// post-attention norm with grid ceil(E / 32), block NORM_THREADS, instead of rmsnorm_*, the
// router's gemv_q4_* and router_*; the ticket was a 4-byte allocation of its own (Target.ticket:
// the backend's for direct steps, the graph's for a capture). Call 2 had it in the arena's
// scratch: a step of another width leaves other bytes there, and the first M = 1 step after the
// M = 3 prefill read a stale ticket (compute-sanitizer: experts_swiglu reading past its weights
// with the expert ids that were never written).
template <bool NORM_EXACT>
__device__ __forceinline__ void rmsnorm_router(const float *x, const float *w, float *out, int n, float eps,
                                               signed char *xq, float *xd, int quant, const uint4 *W, const __half *D,
                                               float *logits, int E, int nb, int gemm_exact, int *topk, float *topw,
                                               int k, int norm_topk, int exact_exp, int moe_exact, unsigned *ticket) {
  __shared__ __align__(16) float ys[FUSED_MAX_ROW];
  __shared__ __align__(16) signed char xqs[FUSED_MAX_ROW];
  __shared__ float xds[FUSED_MAX_ROW / QK];
  __shared__ float lg[NORM_THREADS];
  __shared__ bool is_last;
  const bool first = blockIdx.x == 0;
  signed char *q = first ? xq : xqs;
  float *qd = first ? xd : xds;
  auto norm = [&] {
    pdl_wait();
    rmsnorm_row<NORM_EXACT>(x, w, first ? out : ys, n, eps, q, qd, quant, 0);
    __syncthreads();  // the row's q8_0 is the GEMV's input
  };
  if (gemm_exact)
    gemv_q4_m1<true>(W, D, q, qd, nullptr, logits, E, nb, blockIdx.x, norm);
  else
    gemv_q4_m1<false>(W, D, q, qd, nullptr, logits, E, nb, blockIdx.x, norm);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();  // see every other block's logits
  if (threadIdx.x < E) lg[threadIdx.x] = __ldcg(logits + threadIdx.x);
  __syncthreads();
  if (moe_exact)
    router<true>(lg, topk, topw, E, k, norm_topk, exact_exp, 0);
  else
    router<false>(lg, topk, topw, E, k, norm_topk, exact_exp, 0);
  if (threadIdx.x == 0) *ticket = 0;  // ready for the next layer
}
