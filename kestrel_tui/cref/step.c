/* One decode step of M columns through every layer: backends/decoder.py's `step` with the exact op
 * table, op for op, so every probe buffer has the numpy reference's bits (docs/numerics.md, "The layer",
 * L1-L9). Python (cref/backend.py) owns the weights, the KV cache and the probe buffers; this file
 * only walks them.
 *
 * The calling thread runs the step; the GEMVs, attention, SwiGLU and the hashes are team ops (team.c),
 * which helpers join while they are running (each output computed whole by one worker, so the thread
 * count moves no bit). The ops between them (norms, RoPE, the KV rows, routing, the combine) are a few
 * hundred elements each and run on the caller alone: a decode step's matrices are small (the
 * embedded model's are a few thousand rows), so what counts is what each op costs to hand out. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "cref.h"

#define QK 32

typedef struct {
    float *qkv, *qn, *qnorm, *cos, *sin, *o, *gu, *act, *ey, *fin;
    int64_t *pos, *idx, *order, *xrow, *start;
    kc_job *jobs_gu, *jobs_down;  /* the selected experts' jobs (one per expert in use and matrix) */
    int n_jobs_gu, n_jobs_down;
    int team;                     /* kc_team_begin's */
    kc_ws *ws;                    /* one GEMV workspace per worker */
    const uint8_t **bases;        /* each hashed key's slot */
    uint64_t *head_h;             /* [M] the logits' chains */
    const uint8_t **head_cols;    /* [M] */
} scratch;

static void jobs_of(const kc_lin *const *lins, int n_lins, int64_t rows, kc_job *jobs, int64_t *ld)
{
    *ld = 0;
    for (int i = 0; i < n_lins; i++) {
        jobs[i] = (kc_job){lins[i]->w, lins[i]->out, rows, NULL, NULL, *ld};
        *ld += lins[i]->out;
    }
}

/* y [rows, sum of outs] = the matrices of one input side by side (L2's q/k/v, L8's gate/up), the
 * activation quantized once (Q2) for all of them. */
static void project_then(const kc_lin *const *lins, int n_lins, const float *x, int64_t rows, float *y, scratch *s,
                         const kc_after *after)
{
    kc_job jobs[4];
    int64_t ld;
    jobs_of(lins, n_lins, rows, jobs, &ld);
    if (lins[0]->q4)
        kc_team_gemv_q4(s->team, jobs, n_lins, lins[0]->inp / QK, x, y, ld, s->ws, after);
    else
        kc_team_gemv_f32(s->team, jobs, n_lins, lins[0]->inp, x, y, ld, after);
}

static void project(const kc_lin *const *lins, int n_lins, const float *x, int64_t rows, float *y, scratch *s)
{
    project_then(lins, n_lins, x, rows, y, s, NULL);
}

/* The jobs of the k selected experts of each of M tokens (L8c): pair p = (token p / k, slot p % k) reads
 * x row p / k for gate/up (the token's one input) and row p for down (the pair's own activation); its
 * outputs go to y row p. One job per expert in use and matrix, experts ascending. */
static void expert_jobs(const kc_model *m, const kc_layer *L, int64_t pairs, int64_t n_experts, scratch *s)
{
    int64_t *count = s->start;  /* [n_experts + 1] */
    const int64_t *idx = s->idx;
    memset(count, 0, (size_t)(n_experts + 1) * sizeof *count);
    for (int64_t p = 0; p < pairs; p++)
        count[idx[p] + 1]++;
    for (int64_t e = 0; e < n_experts; e++)
        count[e + 1] += count[e];
    for (int64_t p = 0; p < pairs; p++)  /* counting sort by expert; `count` ends as the segment ends */
        s->order[count[idx[p]]++] = p;
    for (int64_t p = 0; p < pairs; p++)
        s->xrow[p] = s->order[p] / m->top_k;
    const kc_lin *gu[2] = {&L->gate, &L->up};
    int64_t begin = 0;
    s->n_jobs_gu = s->n_jobs_down = 0;
    for (int64_t e = 0; e < n_experts; e++) {
        int64_t end = count[e], off = 0;
        if (end == begin)
            continue;
        for (int i = 0; i < 2; i++) {
            const uint8_t *w = (const uint8_t *)gu[i]->w + e * gu[i]->expert_bytes;
            s->jobs_gu[s->n_jobs_gu++] = (kc_job){w, gu[i]->out, end - begin, s->xrow + begin, s->order + begin, off};
            off += gu[i]->out;
        }
        const uint8_t *w = (const uint8_t *)L->down.w + e * L->down.expert_bytes;
        s->jobs_down[s->n_jobs_down++] = (kc_job){w, L->down.out, end - begin, s->order + begin, s->order + begin, 0};
        begin = end;
    }
}

static void team_gemv(const kc_lin *lin, const kc_job *jobs, int n_jobs, const float *x, float *y, int64_t ld,
                      scratch *s)
{
    if (lin->q4)
        kc_team_gemv_q4(s->team, jobs, n_jobs, lin->inp / QK, x, y, ld, s->ws, NULL);
    else
        kc_team_gemv_f32(s->team, jobs, n_jobs, lin->inp, x, y, ld, NULL);
}

static void add(const float *a, const float *b, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        out[i] = a[i] + b[i];
}

/* bias [n] added to each of `rows` rows of y (row stride ld): one f32 add after the GEMV (L2) */
static void add_bias(float *y, int64_t rows, int64_t ld, const float *bias, int64_t n) {
    if (bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < n; i++)
                y[r * ld + i] = y[r * ld + i] + bias[i];
}

static void copy_cols(float *dst, const float *src, int64_t rows, int64_t src_ld, int64_t n) {
    for (int64_t r = 0; r < rows; r++)
        memcpy(dst + r * n, src + r * src_ld, (size_t)n * sizeof *dst);
}

/* The embedding rows (L9's emb): f32 rows, or q4_0 rows dequantized as d * float(q - 8). */
static void embed(const kc_lin *e, const int64_t *tokens, int64_t M, float *out) {
    int64_t n = e->inp;
    for (int64_t m = 0; m < M; m++) {
        float *row = out + m * n;
        if (!e->q4) {
            memcpy(row, (const float *)e->w + tokens[m] * n, (size_t)n * sizeof *row);
            continue;
        }
        const uint8_t *b = (const uint8_t *)e->w + tokens[m] * (n / QK) * 18;
        for (int64_t blk = 0; blk < n / QK; blk++, b += 18) {
            float d = kc_f16_to_f32((uint16_t)(b[0] | b[1] << 8));
            for (int j = 0; j < 16; j++) {
                row[blk * QK + j] = d * (float)((b[2 + j] & 15) - 8);
                row[blk * QK + j + 16] = d * (float)((b[2 + j] >> 4) - 8);
            }
        }
    }
}

/* silu(gate) * up for rows of [gate | up] (L8c, T3), rows shared by the team */
typedef struct {
    const float *gu;
    float *act;
    int64_t rows, n, chunks;
} swiglu_op;

static void swiglu_chunk(void *ctx, int64_t c, int worker) {
    const swiglu_op *o = ctx;
    (void)worker;
    for (int64_t r = o->rows * c / o->chunks; r < o->rows * (c + 1) / o->chunks; r++) {
        kc_silu(o->gu + r * 2 * o->n, o->act + r * o->n, o->n);
        for (int64_t i = 0; i < o->n; i++)
            o->act[r * o->n + i] = o->act[r * o->n + i] * o->gu[r * 2 * o->n + o->n + i];
    }
}

static void swiglu(const float *gu, int64_t rows, int64_t n, float *act, int team) {
    int64_t chunks = kc_team_chunks(team, 10.0 * (double)(rows * n), rows);  /* ~10 ns an element: its expf */
    swiglu_op o = {gu, act, rows, n, chunks};
    kc_team_run(team, swiglu_chunk, NULL, &o, chunks);
}

/* After the q/k/v GEMV (L2-L5): the biases, K and V out of the side-by-side rows, QK-norm and RoPE of
 * both, the KV rows quantized and written to the cache at pos0. */
static void qk_rows(const kc_model *m, const kc_layer *L, int64_t M, int64_t pos0, float *const *f, scratch *s) {
    int64_t hd = m->head_dim, nh = m->n_heads, nkv = m->n_kv, nq = nh * hd, nk = nkv * hd, ld = nq + 2 * nk;
    add_bias(s->qkv, M, ld, L->q_bias, nq);
    add_bias(s->qkv + nq, M, ld, L->k_bias, nk);
    add_bias(s->qkv + nq + nk, M, ld, L->v_bias, nk);
    float *kraw = f[KC_KRAW], *vrow = s->qn + M * nq;  /* v gathered after q's rows in qn */
    copy_cols(kraw, s->qkv + nq, M, ld, nk);
    copy_cols(vrow, s->qkv + nq + nk, M, ld, nk);
    kc_qknorm(kraw, L->k_norm, M * nkv, hd, m->eps, f[KC_KNORM]);
    kc_rope(f[KC_KNORM], M, nkv, hd, s->cos, s->sin, f[KC_KPRE]);
    copy_cols(s->qn, s->qkv, M, ld, nq);
    kc_qknorm(s->qn, L->q_norm, M * nh, hd, m->eps, s->qnorm);
    kc_rope(s->qnorm, M, nh, hd, s->cos, s->sin, f[KC_QROPE]);
    size_t row_bytes = (size_t)nk * (m->kv_q8 ? 1 : sizeof(float));
    if (m->kv_q8) {
        kc_quant_rows_q8(f[KC_KPRE], M * nkv, hd, (int8_t *)f[KC_K], f[KC_KS]);
        kc_quant_rows_q8(vrow, M * nkv, hd, (int8_t *)f[KC_V], f[KC_VS]);
    } else {
        memcpy(f[KC_K], f[KC_KPRE], (size_t)M * row_bytes);
        memcpy(f[KC_V], vrow, (size_t)M * row_bytes);
        for (int64_t i = 0; i < M * nkv; i++)
            f[KC_KS][i] = f[KC_VS][i] = 1.0f;
    }
    memcpy((uint8_t *)L->k_cache + pos0 * row_bytes, f[KC_K], (size_t)M * row_bytes);
    memcpy((uint8_t *)L->v_cache + pos0 * row_bytes, f[KC_V], (size_t)M * row_bytes);
    memcpy(L->ks_cache + pos0 * nkv, f[KC_KS], (size_t)(M * nkv) * sizeof(float));
    memcpy(L->vs_cache + pos0 * nkv, f[KC_VS], (size_t)(M * nkv) * sizeof(float));
}

/* After o_proj (L7, L8a-b): its bias and the residual, the post-attention norm, and for a MoE layer the
 * router, top-k and the selected experts' jobs. */
static void post_attention(const kc_model *m, const kc_layer *L, int64_t M, const float *x, float *const *f,
                           scratch *s) {
    int64_t hidden = m->hidden, k = m->top_k, pairs = M * k;
    add_bias(s->o, M, hidden, L->o_bias, hidden);
    add(x, s->o, f[KC_ORES], M * hidden);
    kc_rmsnorm(f[KC_ORES], L->post_ln, M, hidden, m->eps, f[KC_PNRM]);
    if (!L->router.w)
        return;
    const kc_lin *router[1] = {&L->router};
    project(router, 1, f[KC_PNRM], M, f[KC_ROUTER], s);  /* a few rows: the caller's alone */
    kc_route(f[KC_ROUTER], M, L->router.out, k, m->norm_topk, s->idx, f[KC_TOPW]);
    int32_t *topk = (int32_t *)f[KC_TOPK];
    for (int64_t p = 0; p < pairs; p++)
        topk[p] = (int32_t)s->idx[p];
    expert_jobs(m, L, pairs, L->router.out, s);
}

/* One layer after its input norm (L2-L8). The expert sum and the residual are the caller's, with the
 * next norm. */
static void layer(const kc_model *m, const kc_layer *L, int64_t M, int64_t pos0, const float *x, float *const *f,
                  scratch *s) {
    const kc_lin *qkv[3] = {&L->q, &L->k, &L->v}, *o[1] = {&L->o};
    project(qkv, 3, f[KC_NRM], M, s->qkv, s);
    qk_rows(m, L, M, pos0, f, s);
    kc_team_attention(s->team, f[KC_QROPE], M, m->n_heads, m->n_kv, m->head_dim, L->k_cache, L->ks_cache,
                      L->v_cache, L->vs_cache, m->kv_q8, s->pos, m->attn_scale, f[KC_ATTN]);
    project(o, 1, f[KC_ATTN], M, s->o, s);
    post_attention(m, L, M, x, f, s);
    int64_t ffn_n = L->gate.out, pairs = M * m->top_k;
    if (!L->router.w) {  /* dense MLP: moe is its output; router/topk/topw are empty */
        const kc_lin *gu[2] = {&L->gate, &L->up}, *down[1] = {&L->down};
        project(gu, 2, f[KC_PNRM], M, s->gu, s);
        swiglu(s->gu, M, ffn_n, s->act, s->team);
        project(down, 1, s->act, M, f[KC_MOE], s);
        return;
    }
    team_gemv(&L->gate, s->jobs_gu, s->n_jobs_gu, f[KC_PNRM], s->gu, L->gate.out + L->up.out, s);
    swiglu(s->gu, pairs, ffn_n, s->act, s->team);
    team_gemv(&L->down, s->jobs_down, s->n_jobs_down, s->act, s->ey, m->hidden, s);
}

/* FNV of the probe keys (P3) as a team op: kc_fnv_share's parts of the keys before and after the
 * logits, which are hashed while they are computed (head_hash) */
typedef struct {
    const kc_hashes *h;
    const uint8_t **bases;
    int64_t M, chunks, skip;  /* skip: the logits key's index */
} hash_op;

static void hash_chunk(void *ctx, int64_t c, int worker) {
    const hash_op *o = ctx;
    const int64_t n = o->h->n_keys, *b = o->h->bytes, after = o->skip + 1;
    (void)worker;
    kc_fnv_share(o->bases, b, b, o->skip, o->M, o->h->out, n, (int)c, (int)o->chunks);
    if (after < n)
        kc_fnv_share(o->bases + after, b + after, b + after, n - after, o->M, o->h->out + after, n, (int)c,
                     (int)o->chunks);
}

/* The logits' hash (a chain a column: serial, ~4 cycles a byte, ~0.8 ms for a 151936-row lm_head)
 * follows the lm_head's chunks as they complete: the worker that finishes a chunk advances the chains
 * through every chunk done in order so far, if no other worker is doing so. The caller finishes them
 * after the op. */
typedef struct {
    _Atomic int done[KC_MAX_CHUNKS];
    int64_t r0[KC_MAX_CHUNKS], r1[KC_MAX_CHUNKS];
    _Atomic int busy;
    int64_t next, M, vocab;  /* next: the first chunk not hashed */
    const uint8_t *logits;   /* [M, vocab] f32 */
    uint64_t *h;             /* [M] the chains */
    const uint8_t **cols;    /* [M] scratch */
} head_hash;

static void head_advance(head_hash *hh, int64_t chunks) {
    if (atomic_exchange_explicit(&hh->busy, 1, memory_order_acquire))
        return;  /* another worker is at it */
    while (hh->next < chunks && atomic_load_explicit(&hh->done[hh->next], memory_order_acquire)) {
        const int64_t c = hh->next++, r0 = hh->r0[c];
        for (int64_t m = 0; m < hh->M; m++)
            hh->cols[m] = hh->logits + (m * hh->vocab + r0) * sizeof(float);
        kc_fnv_update(hh->h, hh->cols, hh->M, (hh->r1[c] - r0) * (int64_t)sizeof(float));
    }
    atomic_store_explicit(&hh->busy, 0, memory_order_release);
}

static void head_after(void *ctx, int64_t c, int64_t chunks, int64_t r0, int64_t r1) {
    head_hash *hh = ctx;
    hh->r0[c] = r0;
    hh->r1[c] = r1;
    atomic_store_explicit(&hh->done[c], 1, memory_order_release);
    head_advance(hh, chunks);
}

static void run_step(const kc_model *m, const int64_t *tokens, int64_t M, int64_t pos0, float *const *slot,
                     const kc_hashes *hashes, scratch *s) {
    int64_t hidden = m->hidden;
    embed(m->embed, tokens, M, slot[KC_EMB]);
    kc_rmsnorm(slot[KC_EMB], m->layers[0].input_ln, M, hidden, m->eps, slot[KC_LAYER0 + KC_NRM]);
    const float *x = slot[KC_EMB];
    for (int64_t l = 0; l < m->n_layers; l++) {
        float *const *f = slot + KC_LAYER0 + l * KC_NFIELDS;
        const kc_layer *L = &m->layers[l];
        layer(m, L, M, pos0, x, f, s);
        x = f[KC_X];
        /* L8d's sum, the residual, and the next norm (or L9's) */
        if (L->router.w)
            kc_combine(s->ey, f[KC_TOPW], M, m->top_k, hidden, f[KC_MOE]);
        add(f[KC_ORES], f[KC_MOE], f[KC_X], M * hidden);
        if (l + 1 < m->n_layers)
            kc_rmsnorm(f[KC_X], m->layers[l + 1].input_ln, M, hidden, m->eps, f[KC_NFIELDS + KC_NRM]);
        else
            kc_rmsnorm(f[KC_X], m->norm, M, hidden, m->eps, s->fin);
    }
    const int64_t logits_slot = KC_LAYER0 + m->n_layers * KC_NFIELDS;
    int64_t skip = -1;
    for (int64_t j = 0; hashes && j < hashes->n_keys; j++)
        if (hashes->slots[j] == logits_slot)
            skip = j;
    const kc_lin *head[1] = {m->lm_head};
    head_hash hh = {.M = M, .vocab = m->vocab, .logits = (const uint8_t *)slot[logits_slot], .h = s->head_h,
                    .cols = s->head_cols};
    for (int64_t i = 0; i < M; i++)
        hh.h[i] = KC_FNV_OFFSET;
    kc_after after = {head_after, &hh};
    project_then(head, 1, s->fin, M, slot[logits_slot], s, skip >= 0 ? &after : NULL);
    if (!hashes)
        return;
    /* the chunk count the lm_head's GEMV used: its hooks saw it; 1 when it ran alone */
    int64_t chunks = 0;
    while (chunks < KC_MAX_CHUNKS && atomic_load(&hh.done[chunks]))
        chunks++;
    head_advance(&hh, chunks);  /* every chunk done: the chains to the end */
    for (int64_t i = 0; skip >= 0 && i < M; i++)
        hashes->out[i * hashes->n_keys + skip] = hh.h[i];
    if (skip < 0)
        skip = hashes->n_keys;  /* no logits key asked for: every key in the first range */
    double bytes = 0;  /* ~0.4 ns a byte, eight chains at a time */
    for (int64_t j = 0; j < hashes->n_keys; j++)
        bytes += j == skip ? 0 : (double)hashes->bytes[j] * (double)M;
    hash_op o = {hashes, s->bases, M, kc_team_chunks(s->team, 0.4 * bytes, hashes->n_keys * M), skip};
    kc_team_run(s->team, hash_chunk, NULL, &o, o.chunks);
}

static void *grab(void **all, int *n, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    all[(*n)++] = p;
    return p;
}

int kc_step(const kc_model *m, const int64_t *tokens, int64_t M, int64_t pos0, void *const *probes,
            const kc_hashes *hashes) {
    if (M <= 0)
        return 0;
    int64_t hidden = m->hidden, hd = m->head_dim, half = hd / 2, k = m->top_k;
    int64_t nq = m->n_heads * hd, nk = m->n_kv * hd;
    /* the widest GEMV input and the widest expert/MLP stacks, over every layer */
    int64_t widest = hidden > nq ? hidden : nq, ffn_max = 1, n_experts = 1, pairs = M * (k > 0 ? k : 1);
    for (int64_t l = 0; l < m->n_layers; l++) {
        const kc_layer *L = &m->layers[l];
        if (L->gate.out > ffn_max)
            ffn_max = L->gate.out;
        if (L->router.w && L->router.out > n_experts)
            n_experts = L->router.out;
    }
    widest = widest > ffn_max ? widest : ffn_max;
    int64_t rows = pairs > M ? pairs : M, n_hash = hashes ? hashes->n_keys : 0;
    int nt = kc_team_begin(m->threads);
    void *all[24];
    int n_all = 0;
    scratch s;
    s.qkv = grab(all, &n_all, sizeof(float) * M * (nq + 2 * nk));
    s.qn = grab(all, &n_all, sizeof(float) * M * (nq + nk));
    s.qnorm = grab(all, &n_all, sizeof(float) * M * nq);
    s.cos = grab(all, &n_all, sizeof(float) * M * half);
    s.sin = grab(all, &n_all, sizeof(float) * M * half);
    s.o = grab(all, &n_all, sizeof(float) * M * hidden);
    s.gu = grab(all, &n_all, sizeof(float) * rows * 2 * ffn_max);
    s.act = grab(all, &n_all, sizeof(float) * rows * ffn_max);
    s.ey = grab(all, &n_all, sizeof(float) * rows * hidden);
    s.fin = grab(all, &n_all, sizeof(float) * M * hidden);
    s.pos = grab(all, &n_all, sizeof(int64_t) * M);
    s.idx = grab(all, &n_all, sizeof(int64_t) * pairs);
    s.order = grab(all, &n_all, sizeof(int64_t) * pairs);
    s.xrow = grab(all, &n_all, sizeof(int64_t) * pairs);
    s.start = grab(all, &n_all, sizeof(int64_t) * (n_experts + 1));
    int64_t max_jobs = n_experts < pairs ? n_experts : pairs;
    s.jobs_gu = grab(all, &n_all, sizeof(kc_job) * 2 * max_jobs);
    s.jobs_down = grab(all, &n_all, sizeof(kc_job) * max_jobs);
    s.bases = grab(all, &n_all, sizeof(uint8_t *) * (n_hash ? n_hash : 1));
    s.ws = grab(all, &n_all, sizeof(kc_ws) * nt);
    s.head_h = grab(all, &n_all, sizeof(uint64_t) * M);
    s.head_cols = grab(all, &n_all, sizeof(uint8_t *) * M);
    int ok = 1;
    for (int i = 0; i < n_all; i++)
        ok = ok && all[i];
    int n_ws = 0;
    while (ok && n_ws < nt) {
        if (kc_ws_init(&s.ws[n_ws], rows, widest) != 0) {
            kc_ws_free(&s.ws[n_ws]);
            ok = 0;
        } else {
            n_ws++;
        }
    }
    if (ok) {
        for (int64_t i = 0; i < M; i++)
            s.pos[i] = pos0 + i;
        kc_rope_cos_sin(s.pos, M, m->inv_freq, half, s.cos, s.sin);
        if (m->rope_scale != 0.0f)  /* yarn: HF scales its cos/sin tables (L4c) */
            for (int64_t i = 0; i < M * half; i++) {
                s.cos[i] = s.cos[i] * m->rope_scale;
                s.sin[i] = s.sin[i] * m->rope_scale;
            }
        for (int64_t j = 0; j < n_hash; j++)
            s.bases[j] = probes[hashes->slots[j]];
        float *const *slot = (float *const *)probes;
        s.team = nt;
        run_step(m, tokens, M, pos0, slot, hashes, &s);
    }
    for (int i = 0; i < n_ws; i++)
        kc_ws_free(&s.ws[i]);
    for (int i = 0; i < n_all; i++)
        free(all[i]);
    kc_team_end(nt);
    return ok ? 0 : -1;
}
