/* One decode step of M columns through every layer: backends/decoder.py's `step` with the exact op
 * table, op for op, so every probe buffer has the numpy reference's bits (docs/numerics.md, "The layer",
 * L1-L9). Python (cref/backend.py) owns the weights, the KV cache and the probe buffers; this file
 * only walks them. Scratch buffers are allocated per step. */
#include <stdlib.h>
#include <string.h>

#include "cref.h"

#define QK 32

typedef struct {
    float *qkv, *qn, *qnorm, *cos, *sin, *o, *gu, *act, *ey, *fin, *dx;
    int8_t *qx;
    int64_t *pos, *idx, *order, *xrow, *start;
    kc_job *jobs;
} scratch;

static void *grab(void **all, int *n, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    all[(*n)++] = p;
    return p;
}

/* y [rows, sum of outs] = the matrices of one input side by side (L2's q/k/v, L8's gate/up), the q8_0
 * activation quantized once for all of them. */
static void project(const kc_model *m, const kc_lin *const *lins, int n_lins, const float *x, int64_t rows,
                    float *y, scratch *s) {
    int64_t inp = lins[0]->inp, ld = 0;
    kc_job jobs[4];
    for (int i = 0; i < n_lins; i++) {
        jobs[i] = (kc_job){lins[i]->w, lins[i]->out, rows, NULL, NULL, ld};
        ld += lins[i]->out;
    }
    if (lins[0]->q4) {
        kc_quant_q8_0(x, rows, inp, s->qx, s->dx);
        kc_gemv_q4(jobs, n_lins, inp / QK, s->qx, s->dx, y, ld, m->threads);
    } else {
        kc_gemv_f32(jobs, n_lins, inp, x, y, ld, m->threads);
    }
}

/* The k selected experts of each of M tokens (L8c): pair p = (token p / k, slot p % k) reads x row
 * p / k when `shared` (gate/up: the token's one input), else row p (down: the pair's own activation);
 * its outputs go to y row p. One job per expert in use and matrix. */
static void project_experts(const kc_model *m, const kc_lin *const *lins, int n_lins, const float *x,
                            int64_t x_rows, int shared, const int64_t *idx, int64_t pairs, int64_t n_experts,
                            float *y, scratch *s) {
    int64_t *count = s->start;  /* [n_experts + 1] */
    memset(count, 0, (size_t)(n_experts + 1) * sizeof *count);
    for (int64_t p = 0; p < pairs; p++)
        count[idx[p] + 1]++;
    for (int64_t e = 0; e < n_experts; e++)
        count[e + 1] += count[e];
    for (int64_t p = 0; p < pairs; p++)  /* counting sort by expert; `count` ends as the segment ends */
        s->order[count[idx[p]]++] = p;
    for (int64_t p = 0; p < pairs; p++)
        s->xrow[p] = shared ? s->order[p] / m->top_k : s->order[p];
    int64_t inp = lins[0]->inp, ld = 0, n_jobs = 0, begin = 0;
    for (int i = 0; i < n_lins; i++)
        ld += lins[i]->out;
    for (int64_t e = 0; e < n_experts; e++) {
        int64_t end = count[e], off = 0;
        if (end == begin)
            continue;
        for (int i = 0; i < n_lins; i++) {
            const uint8_t *w = (const uint8_t *)lins[i]->w + e * lins[i]->expert_bytes;
            s->jobs[n_jobs++] = (kc_job){w, lins[i]->out, end - begin, s->xrow + begin, s->order + begin, off};
            off += lins[i]->out;
        }
        begin = end;
    }
    if (lins[0]->q4) {
        kc_quant_q8_0(x, x_rows, inp, s->qx, s->dx);
        kc_gemv_q4(s->jobs, (int)n_jobs, inp / QK, s->qx, s->dx, y, ld, m->threads);
    } else {
        kc_gemv_f32(s->jobs, (int)n_jobs, inp, x, y, ld, m->threads);
    }
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

static void ffn(const kc_model *m, const kc_layer *L, int64_t M, float *const *f, scratch *s) {
    int64_t hidden = m->hidden;
    const float *ores = f[KC_ORES];
    float *h = f[KC_PNRM], *moe = f[KC_MOE];
    kc_rmsnorm(ores, L->post_ln, M, hidden, m->eps, h);
    const kc_lin *gu[2] = {&L->gate, &L->up}, *down[1] = {&L->down};
    int64_t ffn_n = L->gate.out;
    if (!L->router.w) {  /* dense MLP: moe is its output; router/topk/topw are empty */
        project(m, gu, 2, h, M, s->gu, s);
        for (int64_t r = 0; r < M; r++)
            kc_silu(s->gu + r * 2 * ffn_n, s->act + r * ffn_n, ffn_n);
        for (int64_t r = 0; r < M; r++)
            for (int64_t i = 0; i < ffn_n; i++)
                s->act[r * ffn_n + i] = s->act[r * ffn_n + i] * s->gu[r * 2 * ffn_n + ffn_n + i];
        project(m, down, 1, s->act, M, moe, s);
        return;
    }
    const kc_lin *router[1] = {&L->router};
    int64_t E = L->router.out, k = m->top_k, pairs = M * k;
    project(m, router, 1, h, M, f[KC_ROUTER], s);
    kc_route(f[KC_ROUTER], M, E, k, m->norm_topk, s->idx, f[KC_TOPW]);
    int32_t *topk = (int32_t *)f[KC_TOPK];
    for (int64_t p = 0; p < pairs; p++)
        topk[p] = (int32_t)s->idx[p];
    project_experts(m, gu, 2, h, M, 1, s->idx, pairs, E, s->gu, s);
    for (int64_t p = 0; p < pairs; p++) {
        kc_silu(s->gu + p * 2 * ffn_n, s->act + p * ffn_n, ffn_n);
        for (int64_t i = 0; i < ffn_n; i++)
            s->act[p * ffn_n + i] = s->act[p * ffn_n + i] * s->gu[p * 2 * ffn_n + ffn_n + i];
    }
    project_experts(m, down, 1, s->act, pairs, 0, s->idx, pairs, E, s->ey, s);
    kc_combine(s->ey, f[KC_TOPW], M, k, hidden, moe);
}

static void layer(const kc_model *m, const kc_layer *L, int64_t M, int64_t pos0, const float *x, float *const *f,
                  scratch *s) {
    int64_t hidden = m->hidden, hd = m->head_dim, nh = m->n_heads, nkv = m->n_kv;
    int64_t nq = nh * hd, nk = nkv * hd, ld = nq + 2 * nk;
    kc_rmsnorm(x, L->input_ln, M, hidden, m->eps, f[KC_NRM]);
    const kc_lin *qkv[3] = {&L->q, &L->k, &L->v};
    project(m, qkv, 3, f[KC_NRM], M, s->qkv, s);
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
    kc_attention(f[KC_QROPE], M, nh, nkv, hd, L->k_cache, L->ks_cache, L->v_cache, L->vs_cache, m->kv_q8, s->pos,
                 m->attn_scale, f[KC_ATTN], m->threads);
    const kc_lin *o[1] = {&L->o};
    project(m, o, 1, f[KC_ATTN], M, s->o, s);
    add_bias(s->o, M, hidden, L->o_bias, hidden);
    add(x, s->o, f[KC_ORES], M * hidden);
    ffn(m, L, M, f, s);
    add(f[KC_ORES], f[KC_MOE], f[KC_X], M * hidden);
}

int kc_step(const kc_model *m, const int64_t *tokens, int64_t M, int64_t pos0, void *const *probes) {
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
    int64_t rows = pairs > M ? pairs : M;
    void *all[20];
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
    s.dx = grab(all, &n_all, sizeof(float) * rows * (widest / QK + 1));
    s.qx = grab(all, &n_all, (size_t)(rows * widest));
    s.pos = grab(all, &n_all, sizeof(int64_t) * M);
    s.idx = grab(all, &n_all, sizeof(int64_t) * pairs);
    s.order = grab(all, &n_all, sizeof(int64_t) * pairs);
    s.xrow = grab(all, &n_all, sizeof(int64_t) * pairs);
    s.start = grab(all, &n_all, sizeof(int64_t) * (n_experts + 1));
    s.jobs = grab(all, &n_all, sizeof(kc_job) * 2 * (n_experts < pairs ? n_experts : pairs));
    int ok = 1;
    for (int i = 0; i < n_all; i++)
        ok = ok && all[i];
    if (ok) {
        for (int64_t i = 0; i < M; i++)
            s.pos[i] = pos0 + i;
        kc_rope_cos_sin(s.pos, M, m->inv_freq, half, s.cos, s.sin);
        if (m->rope_scale != 0.0f)  /* yarn: HF scales its cos/sin tables (L4c) */
            for (int64_t i = 0; i < M * half; i++) {
                s.cos[i] = s.cos[i] * m->rope_scale;
                s.sin[i] = s.sin[i] * m->rope_scale;
            }
        float *const *slot = (float *const *)probes;
        embed(m->embed, tokens, M, slot[KC_EMB]);
        const float *x = slot[KC_EMB];
        for (int64_t l = 0; l < m->n_layers; l++) {
            float *const *f = slot + KC_LAYER0 + l * KC_NFIELDS;
            layer(m, &m->layers[l], M, pos0, x, f, &s);
            x = f[KC_X];
        }
        kc_rmsnorm(x, m->norm, M, hidden, m->eps, s.fin);
        const kc_lin *head[1] = {m->lm_head};
        project(m, head, 1, s.fin, M, slot[KC_LAYER0 + m->n_layers * KC_NFIELDS], &s);
    }
    for (int i = 0; i < n_all; i++)
        free(all[i]);
    return ok ? 0 : -1;
}
