/* A whole Llama-family decoder's forward over decode rows, in one call.
 *
 * At a decode step of a small model the CPU spends more time in Python around each kernel
 * (module calls, tensor allocations, ctypes) than in the kernels (figures:
 * docs/benchmarks/2026-12-05-cpu-2core.md). This runs the same kernels in the same order,
 * with the same rounding, from one ctypes call: embedding, then per layer RMSNorm, the
 * fused QKV projection, rotary, the KV store and paged attention (ms_attend_qkv_f32), the
 * output projection, the residual RMSNorm, gate/up, SiLU x up and down; then the final
 * norm. The LM head stays outside.
 *
 * Every row is a decode row: one token with its own position, cache slot, block-table row
 * and context length (a verify step's rows of one sequence each attend up to their own
 * position; every row's K/V is stored before any row attends). Weights are the packed
 * panels of ms_pack_f32 (the embedding too, where it is a tied head's), fp32 or, with
 * weights_bf16, bf16 pair panels (ms_pack_pairs, ms_linear_pairs_f32); biases are
 * optional (NULL) and fp32. The linears split their panels over `threads` (pool.c); the
 * rest runs on the calling thread.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

typedef struct {
    const float *input_norm, *post_norm;       /* [hidden] */
    const void *qkv;                           /* packed [(H + 2 Hkv) D, hidden] */
    const float *qkv_bias;
    const void *o;                             /* packed [hidden, H D] */
    const float *o_bias;
    const void *gate_up;                       /* packed [2 I, hidden] */
    const float *gate_up_bias;
    const void *down;                          /* packed [hidden, I] */
    const float *down_bias;
    void *k_cache, *v_cache;                   /* [blocks, block_size, Hkv, D]: fp32 or bf16 */
} MsDecoderLayer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, window;
    int64_t kv_bf16;                           /* the caches hold bf16 */
    int64_t weights_bf16;                      /* the packed weights (head too) hold bf16 */
    float eps, scale;
    const void *embed;                         /* [vocab, hidden]: fp32 row-major, or packed */
    int64_t embed_packed;                      /* the embedding is a tied head's panels */
    const float *cos, *sin;                    /* [max_positions, D / 2] */
    const float *final_norm;                   /* [hidden] */
    const MsDecoderLayer *layers;
    int64_t threads;                           /* the linears' panels split over the pool */
} MsDecoder;

#define MT_MIN_FLOPS 500000 /* native_cpu.THREAD_MIN_FLOPS */

/* out = x @ w^T for packed panels w of the decoder's weight dtype; 0, or -1 (no memory).
 * With threads, the panels are split over the pool (the same bits: pool.c). */
static int linear(const MsDecoder *m, const float *x, int64_t xs, const void *w, float *out,
                  int64_t os, int64_t M, int64_t K, int64_t N) {
    int64_t threads = m->threads, work = 2 * M * N * K / MT_MIN_FLOPS;
    if (threads > work) threads = work;
    if (threads > 1)
        return ms_linear_packed_mt(x, xs, w, out, os, M, K, N, m->weights_bf16, threads);
    if (m->weights_bf16) {
        ms_linear_pairs_f32(x, xs, w, out, os, M, K, N);
        return 0;
    }
    ms_linear_packed_f32(x, xs, w, out, os, M, K, N);
    return 0;
}

static void add_bias(float *x, const float *bias, int64_t rows, int64_t width) {
    if (!bias) return;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < width; i++) x[r * width + i] += bias[i];
}

/* Final hidden states of T decode rows into out [T, hidden]. Returns 0, -1 when scratch
 * memory could not be allocated, or the attention's code. */
int ms_decoder_forward_f32(const MsDecoder *m, int64_t T, const int64_t *tokens,
                           const int64_t *positions, const int64_t *slots,
                           const int64_t *tables, int64_t table_stride, const int64_t *lens,
                           float *out) {
    const int64_t hs = m->hidden, h = m->heads, hkv = m->kv_heads, d = m->head_dim;
    const int64_t qkv_n = (h + 2 * hkv) * d, inter = m->intermediate, half = d / 2;
    const int64_t widest = qkv_n > 2 * inter ? qkv_n : 2 * inter;
    float *buf = malloc(sizeof(float) * (size_t)T * (size_t)(3 * hs + widest + h * d + inter + d));
    if (!buf) return -1;
    float *x = buf, *residual = x + T * hs, *normed = residual + T * hs;
    float *wide = normed + T * hs, *attn = wide + T * widest, *act = attn + T * h * d;
    float *cos = act + T * inter, *sin = cos + T * half;
    if (m->embed_packed && m->weights_bf16) ms_unpack_rows_pairs(m->embed, hs, tokens, T, x);
    else if (m->embed_packed) ms_unpack_rows_f32(m->embed, hs, tokens, T, x);
    for (int64_t t = 0; t < T; t++) {
        if (!m->embed_packed)
            memcpy(x + t * hs, (const float *)m->embed + tokens[t] * hs,
                   sizeof(float) * (size_t)hs);
        memcpy(cos + t * half, m->cos + positions[t] * half, sizeof(float) * (size_t)half);
        memcpy(sin + t * half, m->sin + positions[t] * half, sizeof(float) * (size_t)half);
    }
    int rc = 0;
    for (int64_t l = 0; l < m->num_layers && rc == 0; l++) {
        const MsDecoderLayer *ly = m->layers + l;
        if (l == 0) {  /* the embedding is the first residual */
            memcpy(residual, x, sizeof(float) * (size_t)(T * hs));
            ms_rms_norm_f32(x, ly->input_norm, normed, T, hs, m->eps);
        } else {
            ms_add_rms_norm_f32(x, residual, ly->input_norm, normed, residual, T, hs, m->eps);
        }
        if ((rc = linear(m, normed, hs, ly->qkv, wide, qkv_n, T, hs, qkv_n)) != 0) break;
        add_bias(wide, ly->qkv_bias, T, qkv_n);
        rc = ms_attend_qkv_f32(wide, T, h, hkv, d, cos, sin, ly->k_cache, ly->v_cache,
                               m->kv_bf16, m->block_size, slots, T, tables, table_stride, lens,
                               m->scale, m->window, attn, m->threads);
        if (rc != 0 || (rc = linear(m, attn, h * d, ly->o, x, hs, T, h * d, hs)) != 0) break;
        add_bias(x, ly->o_bias, T, hs);
        ms_add_rms_norm_f32(x, residual, ly->post_norm, normed, residual, T, hs, m->eps);
        if ((rc = linear(m, normed, hs, ly->gate_up, wide, 2 * inter, T, hs, 2 * inter)) != 0)
            break;
        add_bias(wide, ly->gate_up_bias, T, 2 * inter);
        ms_silu_mul_f32(wide, act, T, inter);
        if ((rc = linear(m, act, inter, ly->down, x, hs, T, inter, hs)) != 0) break;
        add_bias(x, ly->down_bias, T, hs);
    }
    if (rc == 0)
        ms_add_rms_norm_f32(x, residual, m->final_norm, out, residual, T, hs, m->eps);
    free(buf);
    return rc;
}

/* The rows for a table row: position p's slot, its context length and its table. */
static void decode_row(int64_t a, const int64_t *table, int64_t table_stride, int64_t p,
                       int64_t bs, int64_t *pos, int64_t *slots, int64_t *lens,
                       int64_t *tab) {
    pos[a] = p;
    slots[a] = table[p / bs] * bs + p % bs;
    lens[a] = p + 1;
    memcpy(tab + a * table_stride, table, sizeof(int64_t) * (size_t)table_stride);
}

/* A draft model's greedy drafts of B sequences in one call, for drafted [B, k] (row r: its
 * table row in tables, n[r] drafts wanted, n[r] <= k).
 *
 * With feed_counts (not NULL), sequence r first feeds its feed_counts[r] tokens (the ones
 * the draft lags by, then its last known one: the next of feed_tokens, flattened) as decode
 * rows from position start[r]; the argmax of the LM head at its last row is draft 0.
 * Without, draft 0 is already in drafted[r * k] and start[r] is its last known token's
 * position. Then steps j = 1 .. k - 1 feed draft j - 1 at the last known position + j for
 * the rows that want draft j and take the head's argmax as draft j. head: packed panels
 * of [vocab, hidden], of the decoder's weight dtype. The same kernels as the modules'
 * steps and dispatch.argmax_rows, so the same drafts. Returns 0, or the forward's code
 * (-1 too where a bf16 head's scratch could not be allocated). */
int ms_decoder_draft_greedy_f32(const MsDecoder *m, const void *head, int64_t vocab,
                                int64_t B, const int64_t *feed_tokens,
                                const int64_t *feed_counts, const int64_t *start,
                                const int64_t *tables, int64_t table_stride, const int64_t *n,
                                int64_t k, int64_t *drafted) {
    const int64_t hs = m->hidden, bs = m->block_size;
    int64_t rows_max = B;
    if (feed_counts) {
        rows_max = 0;
        for (int64_t r = 0; r < B; r++) rows_max += feed_counts[r];
        rows_max = rows_max > B ? rows_max : B;
    }
    int64_t *ints = malloc(sizeof(int64_t) * (size_t)(rows_max * (5 + table_stride) + B));
    float *buf = malloc(sizeof(float) * (size_t)(rows_max * hs + B * (hs + vocab)));
    int rc = (ints && buf) ? 0 : -1;
    int64_t *ids = ints, *pos = ids + rows_max, *slots = pos + rows_max;
    int64_t *lens = slots + rows_max, *rows = lens + rows_max, *base = rows + rows_max;
    int64_t *tab = base + B;
    float *hidden = buf, *last = buf + rows_max * hs, *logits = last + B * hs;
    for (int64_t r = 0; r < B; r++) base[r] = start[r];
    if (rc == 0 && feed_counts) {
        int64_t t = 0;
        for (int64_t r = 0; r < B; r++) {
            const int64_t *table = tables + r * table_stride;
            for (int64_t i = 0; i < feed_counts[r]; i++, t++) {
                ids[t] = feed_tokens[t];
                decode_row(t, table, table_stride, start[r] + i, bs, pos, slots, lens, tab);
            }
            base[r] = start[r] + feed_counts[r] - 1;
            rows[r] = t - 1;  /* its last row */
        }
        rc = ms_decoder_forward_f32(m, t, ids, pos, slots, tab, table_stride, lens, hidden);
        if (rc == 0) {
            for (int64_t r = 0; r < B; r++)
                memcpy(last + r * hs, hidden + rows[r] * hs, sizeof(float) * (size_t)hs);
            rc = linear(m, last, hs, head, logits, vocab, B, hs, vocab);
            if (rc == 0) ms_argmax_rows_f32(logits, vocab, B, vocab, pos);
            for (int64_t r = 0; r < B && rc == 0; r++) drafted[r * k] = pos[r];
        }
    }
    for (int64_t j = 1; j < k && rc == 0; j++) {
        int64_t a = 0;  /* the rows that want draft j, compacted */
        for (int64_t r = 0; r < B; r++) {
            if (n[r] <= j) continue;
            rows[a] = r;
            ids[a] = drafted[r * k + j - 1];
            decode_row(a, tables + r * table_stride, table_stride, base[r] + j, bs, pos, slots,
                       lens, tab);
            a++;
        }
        if (a == 0) break;
        rc = ms_decoder_forward_f32(m, a, ids, pos, slots, tab, table_stride, lens, hidden);
        if (rc != 0) break;
        if ((rc = linear(m, hidden, hs, head, logits, vocab, a, hs, vocab)) != 0) break;
        ms_argmax_rows_f32(logits, vocab, a, vocab, pos);  /* pos: free again */
        for (int64_t i = 0; i < a; i++) drafted[rows[i] * k + j] = pos[i];
    }
    free(ints);
    free(buf);
    return rc;
}
