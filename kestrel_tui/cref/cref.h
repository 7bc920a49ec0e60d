/* The compiled reference: the numerics contract (docs/numerics.md) once more, in C.
 *
 * Every function here gives the numpy reference's bits (kestrel_tui/numerics,
 * backends/ops_exact.py, backends/decoder.py); tests/test_cref_*.py check it bit for bit.
 * Build rules that make that possible (setup.py): -ffp-contract=off (no float FMA
 * contraction), no -ffast-math, IEEE binary32 arithmetic in the stated order; `fma`
 * only where the contract says fma (binary64, inside the transcendental replicas).
 * Threads (team.c) split independent outputs only — rows, heads, columns — never a
 * reduction. SIMD is used where the contract's order is lane-parallel by design (the
 * GEMV's 32 lane accumulators) or where the arithmetic is exact (integer block dots).
 *
 * Files: cpu.c (the SIMD level), transcend.c (expf/cosf/sinf replicas, silu),
 * quant.c (f16, q8_0, q8 rows), gemv.c (q4_0 x q8_0 and f32 GEMV),
 * ops.c (norms, rope, attention, routing, combine),
 * step.c (one decode step of M columns through every layer), fnv.c (probe hashes).
 */
#ifndef KESTREL_CREF_H
#define KESTREL_CREF_H

#include <stdint.h>

/* ---- cpu.c: the SIMD level, read from the CPU at load time ---- */
int kc_gemv_simd(int level);  /* -1: query; set 0 scalar, 1 AVX2, 2 VNNI, 3 AVX-512 (capped at the CPU's); -> level in use */
int kc_avxvnni(void);         /* 1 where the CPU has AVX-VNNI (level 2's 256-bit dot), else 0 */
/* The elementwise loops' second build, for CPUs with AVX2 and FMA (x86-64 only): the same operations,
 * so the same bits. kc_v3() says whether it runs: SIMD level (kc_gemv_simd) >= 1 and an FMA unit. */
#if defined(__x86_64__) || defined(__i386__)
#define KC_V3 __attribute__((target("avx2,fma,f16c")))
#else
#define KC_V3
#endif
int kc_v3(void);

/* ---- transcend.c: the UCRT replicas of numerics/transcend.py ---- */
float kc_expf1(float x);
void kc_expf(const float *x, float *y, int64_t n);
void kc_cosf(const float *x, float *y, int64_t n);
void kc_sinf(const float *x, float *y, int64_t n);
void kc_sincosf(const float *x, float *c, float *s, int64_t n);
void kc_silu(const float *x, float *y, int64_t n);          /* x / (1 + expf(-x)) */

/* ---- quant.c: model/quant.py ---- */
float kc_f16_to_f32(uint16_t h);                           /* exact */
uint16_t kc_f32_to_f16(float f);                           /* round to nearest even, as numpy astype(float16) */
/* q8_0 activation blocks (quantize_q8_0): x [rows, n], n % 32 == 0 -> q [rows, n], d [rows, n/32]
 * (the f16-rounded scale as f32). */
void kc_quant_q8_0(const float *x, int64_t rows, int64_t n, int8_t *q, float *d);
/* q8 rows (quantize_rows_q8: KV cache and query): x [rows, n] -> q [rows, n], d [rows] (f32 scale). */
void kc_quant_rows_q8(const float *x, int64_t rows, int64_t n, int8_t *q, float *d);

/* ---- gemv.c: numerics/linalg.py ---- */
/* One matrix applied to some rows of x, its outputs written at y[yrow[c] * y_ld + y_off + o]. */
typedef struct {
    const void *w;         /* q4_0: uint8 [out, nb, 18] (ggml blocks); f32: float [out, inp] */
    int64_t out;           /* output rows of this matrix */
    int64_t n;             /* columns */
    const int64_t *xrow;   /* [n] the x row of each column (NULL: 0..n-1) */
    const int64_t *yrow;   /* [n] the y row of each column (NULL: 0..n-1) */
    int64_t y_off;         /* first output element within a y row */
} kc_job;
/* q4_0 x q8_0: qx [*, nb*32] int8, dx [*, nb] (kc_quant_q8_0's output); y rows of y_ld floats. */
void kc_gemv_q4(const kc_job *jobs, int n_jobs, int64_t nb, const int8_t *qx, const float *dx,
                float *y, int64_t y_ld, int threads);
/* f32 weights: x [*, inp] float. */
void kc_gemv_f32(const kc_job *jobs, int n_jobs, int64_t inp, const float *x, float *y, int64_t y_ld,
                 int threads);
/* The step's GEMVs: x [rows, nb*32] f32 quantized to q8_0 (Q2) by each worker of the team for itself
 * (a step's GEMV inputs are a few rows: cheaper to quantize twice than to wait for), ws [team] their
 * workspaces. */
typedef struct { int8_t *qx; float *dx; void *xp; } kc_ws;
int kc_ws_init(kc_ws *ws, int64_t rows, int64_t inp);  /* for inputs of up to rows x inp; 0 or -1 */
void kc_ws_free(kc_ws *ws);
/* after, if not NULL: called by the worker that computed them with each chunk's rows r0..r1 (of job 0;
 * used with one job), before the chunk counts as done. */
typedef struct {
    void (*fn)(void *ctx, int64_t chunk, int64_t chunks, int64_t r0, int64_t r1);
    void *ctx;
} kc_after;
void kc_team_gemv_q4(int team, const kc_job *jobs, int n_jobs, int64_t nb, const float *x, float *y, int64_t y_ld,
                     kc_ws *ws, const kc_after *after);
void kc_team_gemv_f32(int team, const kc_job *jobs, int n_jobs, int64_t inp, const float *x, float *y, int64_t y_ld,
                      const kc_after *after);

/* ---- team.c: the calling thread and helpers that join its ops when they are running ---- */
/* fn(ctx, chunk, worker) computes one chunk (outputs no other chunk touches); join(ctx, 0, worker), if
 * not NULL, runs once on each worker before its first chunk of the op. worker: 0 the caller, 1.. helpers. */
typedef void (*kc_chunk_fn)(void *ctx, int64_t chunk, int worker);
int kc_team_begin(int threads);  /* -> the team's size (1: the caller alone) */
void kc_team_end(int team);
/* The chunks to cut an op into: 1 (the caller alone) for an op of less than ~2 us (work_ns: its
 * time on one thread, roughly), else chunks of ~25 us, at least four per worker (so a helper that joins
 * late still finds work) and at most KC_MAX_CHUNKS; never more than `pieces` (what the op can be cut
 * into). */
#define KC_MAX_CHUNKS 64
int64_t kc_team_chunks(int team, double work_ns, int64_t pieces);
void kc_team_share_min(double ns);  /* tests: share every op from ns on (0: all); -1: the default */
/* All chunks 0..chunks (< 65536) of fn, shared by the team; returns when every one is done. */
void kc_team_run(int team, kc_chunk_fn fn, kc_chunk_fn join, void *ctx, int64_t chunks);

/* ---- ops.c: backends/ops_exact.py ---- */
void kc_rmsnorm(const float *x, const float *w, int64_t rows, int64_t n, float eps, float *out); /* block-8 */
void kc_qknorm(const float *x, const float *w, int64_t rows, int64_t n, float eps, float *out);  /* sequential */
/* ang = f32(pos[m]) * inv_freq[i] -> cos, sin [M, half] */
void kc_rope_cos_sin(const int64_t *pos, int64_t M, const float *inv_freq, int64_t half, float *cos, float *sin);
/* x [M, heads, hd] half-split rotation with cos/sin [M, hd/2] -> out (may alias x) */
void kc_rope(const float *x, int64_t M, int64_t heads, int64_t hd, const float *cos, const float *sin, float *out);
/* Online-softmax attention (contract L6). q [M, nh, hd] f32; the cache k/v [T, nkv, hd] (int8 when
 * kv_q8, else f32), ks/vs [T, nkv]; column m attends to 0..pos[m]. out [M, nh*hd]. */
void kc_attention(const float *q, int64_t M, int64_t nh, int64_t nkv, int64_t hd, const void *k, const float *ks,
                  const void *v, const float *vs, int kv_q8, const int64_t *pos, float scale, float *out,
                  int threads);
/* The same, the (column, head) pairs shared by a team of kc_team_begin. */
void kc_team_attention(int team, const float *q, int64_t M, int64_t nh, int64_t nkv, int64_t hd, const void *k,
                       const float *ks, const void *v, const float *vs, int kv_q8, const int64_t *pos, float scale,
                       float *out);
/* Router softmax, top-k (descending, ties to the lower index), renormalise when norm_topk.
 * logits [M, E] -> idx [M, k], w [M, k]. */
void kc_route(const float *logits, int64_t M, int64_t E, int64_t k, int norm_topk, int64_t *idx, float *w);
/* moe = 0; moe = moe + w[j] * y[j] in rank order. y [M, k, n], w [M, k] -> out [M, n] */
void kc_combine(const float *y, const float *w, int64_t M, int64_t k, int64_t n, float *out);

/* ---- step.c: backends/decoder.py's step, every layer, in one call ---- */
typedef struct {
    const void *w;          /* q4_0: uint8 blocks [E?, out, nb, 18]; f32: float [E?, out, inp] */
    int64_t out, inp;
    int q4;                 /* 1: q4_0 blocks, 0: f32 */
    int64_t expert_bytes;   /* bytes from one expert's matrix to the next (0: one matrix) */
} kc_lin;

typedef struct {
    const float *input_ln, *post_ln, *q_norm, *k_norm;
    kc_lin q, k, v, o;
    const float *q_bias, *k_bias, *v_bias, *o_bias;   /* NULL: no attention_bias */
    kc_lin router;                                    /* router.w NULL: a dense MLP */
    kc_lin gate, up, down;                            /* expert stacks, or the dense MLP */
    void *k_cache, *v_cache;                          /* [cap, n_kv, hd] int8 (kv_q8) or f32 */
    float *ks_cache, *vs_cache;                       /* [cap, n_kv] */
} kc_layer;

typedef struct {
    int64_t n_layers, hidden, n_heads, n_kv, head_dim, vocab, top_k;
    float eps, attn_scale, rope_scale;                /* rope_scale 0: none (yarn's factor otherwise) */
    int norm_topk, kv_q8, threads;
    const kc_lin *embed, *lm_head;
    const float *norm, *inv_freq;
    const kc_layer *layers;
} kc_model;

/* Probe slots: KC_EMB, then layer l's field f at KC_LAYER0 + l * KC_NFIELDS + f (f in keys.ALL_FIELDS
 * order), then the logits at KC_LAYER0 + n_layers * KC_NFIELDS. probes[slot] is that key's buffer for
 * all M columns ([M, size], C order); every slot is written. */
enum { KC_NRM, KC_KRAW, KC_KNORM, KC_KPRE, KC_K, KC_KS, KC_V, KC_VS, KC_QROPE, KC_ATTN, KC_ORES, KC_PNRM,
       KC_ROUTER, KC_TOPK, KC_TOPW, KC_MOE, KC_X, KC_NFIELDS };
enum { KC_EMB = 0, KC_LAYER0 = 1 };
/* The probe keys to hash (P3) after the step: key j is slot slots[j] of every column (bytes[j] bytes a
 * column); out [M, n_keys]. Keys of equal length next to each other hash together (fnv.c). */
typedef struct {
    int64_t n_keys;
    const int64_t *slots, *bytes;
    uint64_t *out;
} kc_hashes;
/* M columns at positions pos0..pos0+M-1, hashed when hashes is not NULL; returns 0, or -1 when the
 * step's scratch cannot be allocated. */
int kc_step(const kc_model *model, const int64_t *tokens, int64_t M, int64_t pos0, void *const *probes,
            const kc_hashes *hashes);

/* ---- fnv.c ---- */
/* FNV-1a 64 of n_keys buffers for each of M columns: key j of column m is bytes[j] bytes at
 * base[j] + m * stride[j]. out [M, n_keys]. */
void kc_fnv_keys(const uint8_t *const *base, const int64_t *bytes, const int64_t *stride, int64_t n_keys,
                 int64_t M, uint64_t *out);
/* The same work in `parts` shares; this call does share `part`; key j of column m to out[m * out_ld + j]. */
void kc_fnv_share(const uint8_t *const *base, const int64_t *bytes, const int64_t *stride, int64_t n_keys,
                  int64_t M, uint64_t *out, int64_t out_ld, int part, int parts);
/* n chains h[s] (each started at KC_FNV_OFFSET) continued over len more bytes at p[s]. */
#define KC_FNV_OFFSET 0xcbf29ce484222325ull
void kc_fnv_update(uint64_t *h, const uint8_t *const *p, int64_t n, int64_t len);

#endif
