/* Causal attention of a step's prompt chunks over the paged KV cache, in one call, split
 * over the thread pool.
 *
 * The chunks' own K/V are in the cache already (ms_attend_qkv_f32 stores them), so a chunk
 * that starts mid-sequence (chunked prefill, a prefix-cache hit) reads its earlier
 * positions the same way. Work is cut into units of (chunk, KV head, up to QBLOCK query
 * tokens); the pool's parts take units, the costliest first, from a shared counter. A unit
 * widens the keys it can see (positions [lo, hi) of its sequence) to fp32 once: K
 * transposed in tiles of VW keys ([tile][d][VW]: one vector is VW keys of one dimension),
 * V as rows. Its query rows (each token times each head of the KV head's group) go RT at a
 * time: scores RT x VW by broadcast FMAs over the head dimension, an online softmax per row,
 * then P V into fp32 accumulators; the result is divided by the row's sum once at the end
 * and stored fp32 or rounded to bf16 (nearest even).
 *
 * Vectors are AVX-512 (16 lanes) or AVX2 (8 lanes); the head dimension must be a multiple
 * of the lane count. Without either ISA the function returns MS_UNSUPPORTED and the caller
 * keeps torch's attention.
 */

#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "vec_math.h"

#define MS_NO_MEMORY (-1)
#define MS_UNSUPPORTED (-2)
#define QBLOCK 128 /* query tokens per unit */
#define RT 8       /* query rows per score tile */
#define PT 4       /* query rows per P V tile */

#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
#define DV 4 /* vectors of the head dimension per P V pass */
typedef __m512 vf;
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vset1(x) _mm512_set1_ps(x)
#define vzero() _mm512_setzero_ps()
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vmaxv(a, b) _mm512_max_ps(a, b)
#define hmax(v) _mm512_reduce_max_ps(v)
#define hsum(v) _mm512_reduce_add_ps(v)
/* keys at positions kp past `last` or at or before `first` (a window) get -inf */
static inline vf mask_keys(vf s, vf kp, float first, float last) {
    const __mmask16 ok = _mm512_cmp_ps_mask(kp, _mm512_set1_ps(last), _CMP_LE_OQ) &
                         _mm512_cmp_ps_mask(kp, _mm512_set1_ps(first), _CMP_GT_OQ);
    return _mm512_mask_blend_ps(ok, _mm512_set1_ps(-INFINITY), s);
}
static inline vf iota(void) {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
/* exp(x) for x <= 0, exactly 0 below -87.3 (a masked key's -inf included) */
static inline vf vexp(vf x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(live, exp16(x));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
#define DV 2
typedef __m256 vf;
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vset1(x) _mm256_set1_ps(x)
#define vzero() _mm256_setzero_ps()
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vmaxv(a, b) _mm256_max_ps(a, b)
#define hmax(v) hmax8(v)
#define hsum(v) hsum8(v)
static inline vf mask_keys(vf s, vf kp, float first, float last) {
    const vf ok = _mm256_and_ps(_mm256_cmp_ps(kp, _mm256_set1_ps(last), _CMP_LE_OQ),
                                _mm256_cmp_ps(kp, _mm256_set1_ps(first), _CMP_GT_OQ));
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, ok);
}
static inline vf iota(void) { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
static inline vf vexp(vf x) {
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ), exp8(x));
}
#endif

typedef struct {
    int64_t chunk, kv_head, q0, q1; /* query tokens [q0, q1) of the chunk */
    int64_t cost;
} Unit;

typedef struct {
    const void *q;
    int64_t q_bf16, q_stride;
    const void *k, *v;
    int64_t kv_bf16, block_size, kv_heads, head_dim, heads;
    const int64_t *tables;
    int64_t table_stride;
    const int64_t *starts, *lens, *pos;
    float scale;
    int64_t window;
    void *out;
    int64_t out_bf16, out_stride;
    int64_t bf16_mode; /* 0 fp32 (run_unit); a bf16 cache and output: 1 run_unit_bf16
                          (AVX512_BF16), 2 run_unit_amx (AMX, head size a multiple of 32) */
    Unit *units;
    int64_t n_units, next;
    int rc;
} Job;

static int by_cost(const void *a, const void *b) {
    const int64_t x = ((const Unit *)a)->cost, y = ((const Unit *)b)->cost;
    return (x < y) - (x > y);
}

#if defined(VW)
/* acc[PT rows][d0 : d0 + width * VW] += p[PT rows][0:VW] @ v[0:VW][same columns]: PT x width
 * accumulators held in registers over the VW keys (rows D apart; p rows VW apart). */
static inline __attribute__((always_inline)) void pv_tile(float *acc, const float *p,
                                                          const float *v, int64_t D,
                                                          int64_t d0, int width) {
    vf o[PT][DV];
    for (int a = 0; a < PT; a++)
        for (int b = 0; b < width; b++) o[a][b] = vload(acc + a * D + d0 + b * VW);
    for (int k = 0; k < VW; k++) {
        vf vv[DV];
        for (int b = 0; b < width; b++) vv[b] = vload(v + k * D + d0 + b * VW);
        for (int a = 0; a < PT; a++) {
            const vf pv = vset1(p[a * VW + k]);
            for (int b = 0; b < width; b++) o[a][b] = vfma(pv, vv[b], o[a][b]);
        }
    }
    for (int a = 0; a < PT; a++)
        for (int b = 0; b < width; b++) vstore(acc + a * D + d0 + b * VW, o[a][b]);
}

/* The first and one past the last key position unit `u` reads. */
static void key_range(const Job *j, const Unit *u, int64_t *lo, int64_t *hi) {
    const int64_t p0 = j->pos[u->chunk] + u->q0;
    *hi = j->pos[u->chunk] + u->q1;
    *lo = j->window > 0 && p0 - j->window + 1 > 0 ? p0 - j->window + 1 : 0;
    *lo -= *lo % 64; /* tiles of keys start at multiples of 64 whatever the unit: a row
                       sees its keys in the same tiles in any chunk (KT and VW divide 64) */
}

static void run_unit(const Job *j, const Unit *u, float *buf) {
    const int64_t D = j->head_dim, G = j->heads / j->kv_heads, g = u->kv_head;
    const int64_t c = u->chunk, bs = j->block_size, start = j->pos[c];
    int64_t lo, hi;
    key_range(j, u, &lo, &hi);
    const int64_t tiles = (hi - lo + VW - 1) / VW;
    float *kt = buf;                         /* [tiles][D][VW] */
    float *vr = kt + tiles * D * VW;         /* [tiles * VW][D] */
    float *qs = vr + tiles * VW * D;         /* [RT][D] */
    float *acc = qs + RT * D;                /* [RT][D] */
    float *pr = acc + RT * D;                /* [RT][VW] */
    const int64_t *table = j->tables + c * j->table_stride;
    const int64_t es = j->kv_bf16 ? 2 : 4, row = j->kv_heads * D;
    for (int64_t p = lo; p < lo + tiles * VW; p++) {
        const int64_t t = (p - lo) / VW, l = (p - lo) % VW;
        float *kd = kt + t * D * VW + l, *vd = vr + (p - lo) * D;
        if (p >= hi) {
            for (int64_t d = 0; d < D; d++) kd[d * VW] = 0.0f;
            memset(vd, 0, (size_t)D * sizeof(float));
            continue;
        }
        const int64_t off = (table[p / bs] * bs + p % bs) * row + g * D;
        const char *kp = (const char *)j->k + off * es, *vp = (const char *)j->v + off * es;
        for (int64_t d = 0; d < D; d++) {
            kd[d * VW] = widen_at(kp, d, j->kv_bf16);
            vd[d] = widen_at(vp, d, j->kv_bf16);
        }
    }
    const int64_t rows = (u->q1 - u->q0) * G;
    for (int64_t r0 = 0; r0 < rows; r0 += RT) {
        const int64_t nr = rows - r0 < RT ? rows - r0 : RT;
        float m[RT], l[RT], qpos[RT], first[RT];
        float qmin = INFINITY, qmax = -INFINITY;
        for (int64_t r = 0; r < RT; r++) {
            const int64_t rr = r < nr ? r0 + r : r0;  /* padding rows repeat the first */
            const int64_t tok = u->q0 + rr / G, head = g * G + rr % G;
            const int64_t at = (j->starts[c] + tok) * j->q_stride + head * D;
            for (int64_t d = 0; d < D; d++) qs[r * D + d] = widen_at(j->q, at + d, j->q_bf16) * j->scale;
            memset(acc + r * D, 0, (size_t)D * sizeof(float));
            m[r] = -INFINITY;
            l[r] = 0.0f;
            qpos[r] = (float)(start + tok);
            first[r] = j->window > 0 ? qpos[r] - (float)j->window : -1.0f;
            if (qpos[r] < qmin) qmin = qpos[r];
            if (qpos[r] > qmax) qmax = qpos[r];
        }
        const float fmin = j->window > 0 ? qmin - (float)j->window : -1.0f;
        int64_t t0 = 0;
        if (j->window > 0 && fmin + 1 > (float)lo) t0 = ((int64_t)fmin + 1 - lo) / VW;
        const int64_t t1 = ((int64_t)qmax - lo) / VW + 1;
        for (int64_t t = t0; t < t1; t++) {
            const float *kd = kt + t * D * VW;
            vf s[RT];
            for (int64_t r = 0; r < RT; r++) s[r] = vzero();
            for (int64_t d = 0; d < D; d++) {
                const vf kv = vload(kd + d * VW);
                for (int64_t r = 0; r < RT; r++) s[r] = vfma(vset1(qs[r * D + d]), kv, s[r]);
            }
            const float base = (float)(lo + t * VW);
            const int masked = base + VW - 1 > qmin || j->window > 0;
            const vf kp = vadd(iota(), vset1(base));
            for (int64_t r = 0; r < RT; r++) {
                vf sr = s[r];
                if (masked) sr = mask_keys(sr, kp, first[r], qpos[r]);
                const float mx = hmax(sr);
                const float mn = mx > m[r] ? mx : m[r];
                if (mn == -INFINITY) { /* nothing this row sees yet */
                    vstore(pr + r * VW, vzero());
                    continue;
                }
                const vf p = vexp(vsub(sr, vset1(mn)));
                vstore(pr + r * VW, p);
                const float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - mn);
                l[r] = l[r] * alpha + hsum(p);
                if (alpha != 1.0f) {
                    const vf av = vset1(alpha);
                    for (int64_t d = 0; d < D; d += VW)
                        vstore(acc + r * D + d, vmul(vload(acc + r * D + d), av));
                }
                m[r] = mn;
            }
            const float *vt = vr + t * VW * D;
            for (int64_t r = 0; r < RT; r += PT) {
                int64_t d0 = 0;
                for (; d0 + DV * VW <= D; d0 += DV * VW) pv_tile(acc + r * D, pr + r * VW, vt, D, d0, DV);
                for (; d0 < D; d0 += VW) pv_tile(acc + r * D, pr + r * VW, vt, D, d0, 1);
            }
        }
        for (int64_t r = 0; r < nr; r++) {
            const int64_t rr = r0 + r, tok = u->q0 + rr / G, head = g * G + rr % G;
            const int64_t at = (j->starts[c] + tok) * j->out_stride + head * D;
            const float inv = 1.0f / l[r];
            if (j->out_bf16) {
                uint16_t *o = (uint16_t *)j->out + at;
                for (int64_t d = 0; d < D; d++) o[d] = bf16_round(acc[r * D + d] * inv);
            } else {
                float *o = (float *)j->out + at;
                for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv;
            }
        }
    }
}


#if defined(__AVX512BF16__)
/* The bf16 variant (a bf16 cache, a bf16 output): q rounded to bf16 once scaled, scores and
 * P V by VDPBF16PS (two products a lane, fp32 sums), the softmax in fp32 and P rounded to
 * bf16 for P V. Keys in tiles of KT = NK vectors: the row maximum, sum and rescale are paid
 * once per KT keys. K is held pair-interleaved ([tile][d / 2][KT][2]: one vector is 16 keys
 * times two dimensions), V pair-interleaved by keys ([tile][KT / 2][D][2]). */
#define KT 64
#define NK (KT / 16)
#define RB 4

static inline __attribute__((always_inline)) void pv_tile_bf16(float *acc, const uint16_t *p,
                                                               const uint16_t *v, int64_t D,
                                                               int64_t d0, int width) {
    __m512 o[RB][4];
    for (int a = 0; a < RB; a++)
        for (int b = 0; b < width; b++) o[a][b] = _mm512_loadu_ps(acc + a * D + d0 + b * 16);
    for (int k = 0; k < KT / 2; k++) {
        __m512bh vv[4];
        for (int b = 0; b < width; b++)
            vv[b] = (__m512bh)_mm512_loadu_si512(v + (k * D + d0 + b * 16) * 2);
        for (int a = 0; a < RB; a++) {
            const __m512bh pp = pair_bcast(p + a * KT + 2 * k);
            for (int b = 0; b < width; b++) o[a][b] = _mm512_dpbf16_ps(o[a][b], pp, vv[b]);
        }
    }
    for (int a = 0; a < RB; a++)
        for (int b = 0; b < width; b++) _mm512_storeu_ps(acc + a * D + d0 + b * 16, o[a][b]);
}

/* Unit u's keys [lo, hi), padded with zeros to `tiles` tiles of KT, from a bf16 cache: K
 * into kp [tiles][D / 2][KT][2], V into vp [tiles][KT / 2][D][2]. */
static void stage_kv_bf16(const Job *j, const Unit *u, int64_t lo, int64_t hi, int64_t tiles,
                          uint16_t *kp, uint16_t *vp) {
    const int64_t D = j->head_dim, g = u->kv_head, bs = j->block_size;
    const int64_t *table = j->tables + u->chunk * j->table_stride;
    const int64_t row = j->kv_heads * D;
    for (int64_t p = lo; p < lo + tiles * KT; p++) {
        const int64_t t = (p - lo) / KT, jj = (p - lo) % KT;
        uint32_t *kd = (uint32_t *)kp + t * (D / 2) * KT + jj;
        uint16_t *vd = vp + (t * (KT / 2) + jj / 2) * D * 2 + jj % 2;
        if (p >= hi) {
            for (int64_t e = 0; e < D / 2; e++) kd[e * KT] = 0;
            for (int64_t d = 0; d < D; d++) vd[2 * d] = 0;
            continue;
        }
        const int64_t off = (table[p / bs] * bs + p % bs) * row + g * D;
        const uint16_t *kr = (const uint16_t *)j->k + off, *vr = (const uint16_t *)j->v + off;
        for (int64_t e = 0; e < D / 2; e++) memcpy(kd + e * KT, kr + 2 * e, 4);
        for (int64_t d = 0; d < D; d++) vd[2 * d] = vr[d];
    }
}

#define ROWS_MAX 16

/* A tile of query rows' running state: softmax maximum and sum, each row's position and
 * window start (keys at or before it are out), the tile's lowest and highest position. */
typedef struct {
    float m[ROWS_MAX], l[ROWS_MAX], qpos[ROWS_MAX], first[ROWS_MAX], qmin, qmax;
} Rows;

/* Query rows r0 .. r0 + count of unit u (past the unit's nr real ones, copies of the first)
 * into qs [count][D] (scaled, rounded to bf16), zero their accumulators acc [count][D]. */
static void load_rows_bf16(const Job *j, const Unit *u, int64_t r0, int64_t nr, int count,
                           uint16_t *qs, float *acc, Rows *st) {
    const int64_t D = j->head_dim, G = j->heads / j->kv_heads, c = u->chunk;
    st->qmin = INFINITY, st->qmax = -INFINITY;
    for (int r = 0; r < count; r++) {
        const int64_t rr = r < nr ? r0 + r : r0;
        const int64_t tok = u->q0 + rr / G, head = u->kv_head * G + rr % G;
        const int64_t at = (j->starts[c] + tok) * j->q_stride + head * D;
        for (int64_t d = 0; d < D; d++)
            qs[r * D + d] = bf16_round(widen_at(j->q, at + d, j->q_bf16) * j->scale);
        memset(acc + r * D, 0, (size_t)D * sizeof(float));
        st->m[r] = -INFINITY;
        st->l[r] = 0.0f;
        st->qpos[r] = (float)(j->pos[c] + tok);
        st->first[r] = j->window > 0 ? st->qpos[r] - (float)j->window : -1.0f;
        if (st->qpos[r] < st->qmin) st->qmin = st->qpos[r];
        if (st->qpos[r] > st->qmax) st->qmax = st->qpos[r];
    }
}

/* Asks for query rows r0 .. r0 + count of unit u (those that exist): the next row tile's,
 * while this one's keys are worked on (the rows lie one token's q/k/v row apart, often
 * out of cache since the projection wrote them). */
static void prefetch_rows(const Job *j, const Unit *u, int64_t r0, int count) {
    const int64_t D = j->head_dim, G = j->heads / j->kv_heads, rows = (u->q1 - u->q0) * G;
    const int64_t es = j->q_bf16 ? 2 : 4;
    for (int64_t rr = r0; rr < r0 + count && rr < rows; rr++) {
        const int64_t tok = u->q0 + rr / G, head = u->kv_head * G + rr % G;
        const char *q = (const char *)j->q + ((j->starts[u->chunk] + tok) * j->q_stride +
                                              head * D) * es;
        for (int64_t b = 0; b < D * es; b += 64) _mm_prefetch(q + b, _MM_HINT_T0);
    }
}

/* The key tiles [t0, t1) of KT from `lo` that any of the rows sees. */
static void tile_range(const Job *j, const Rows *st, int64_t lo, int64_t *t0, int64_t *t1) {
    const float fmin = j->window > 0 ? st->qmin - (float)j->window : -1.0f;
    *t0 = j->window > 0 && fmin + 1 > (float)lo ? ((int64_t)fmin + 1 - lo) / KT : 0;
    *t1 = ((int64_t)st->qmax - lo) / KT + 1;
}

/* Row r's scores sv of the KT keys from position `base`: masked where needed, the online
 * softmax step (its maximum and sum, the accumulator row acc rescaled), P rounded into pb. */
static inline void softmax_row(const Job *j, Rows *st, int r, __m512 sv[NK], float base,
                               uint16_t *pb, float *acc) {
    const int masked = base + KT - 1 > st->qmin || j->window > 0;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int n = 0; n < NK; n++) {
        if (masked)
            sv[n] = mask_keys(sv[n], _mm512_add_ps(iota(), _mm512_set1_ps(base + 16 * n)),
                              st->first[r], st->qpos[r]);
        mx = _mm512_max_ps(mx, sv[n]);
    }
    const float tmax = _mm512_reduce_max_ps(mx), m = st->m[r];
    const float mn = tmax > m ? tmax : m;
    if (mn == -INFINITY) { /* nothing this row sees yet */
        memset(pb, 0, KT * sizeof(uint16_t));
        return;
    }
    const __m512 mv = _mm512_set1_ps(mn);
    __m512 sum = _mm512_setzero_ps();
    for (int n = 0; n < NK; n += 2) {
        const __m512 p0 = vexp(_mm512_sub_ps(sv[n], mv));
        const __m512 p1 = vexp(_mm512_sub_ps(sv[n + 1], mv));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        _mm512_storeu_si512(pb + n * 16, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    const float alpha = m == -INFINITY ? 0.0f : expf(m - mn);
    st->l[r] = st->l[r] * alpha + _mm512_reduce_add_ps(sum);
    if (alpha != 1.0f) {
        const __m512 av = _mm512_set1_ps(alpha);
        for (int64_t d = 0; d < j->head_dim; d += 16)
            _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), av));
    }
    st->m[r] = mn;
}

/* The unit's real rows r0 .. r0 + nr: acc divided by the row's sum, rounded to bf16. */
static void store_rows_bf16(const Job *j, const Unit *u, int64_t r0, int64_t nr,
                            const float *acc, const Rows *st) {
    const int64_t D = j->head_dim, G = j->heads / j->kv_heads;
    for (int64_t r = 0; r < nr; r++) {
        const int64_t rr = r0 + r, tok = u->q0 + rr / G, head = u->kv_head * G + rr % G;
        uint16_t *o = (uint16_t *)j->out + (j->starts[u->chunk] + tok) * j->out_stride +
                      head * D;
        const float inv = 1.0f / st->l[r];
        for (int64_t d = 0; d < D; d++) o[d] = bf16_round(acc[r * D + d] * inv);
    }
}

/* A bf16 unit's scratch, in bytes from its start: its staged K (at 0) and V, then for a
 * tile of `rows` query rows their q, accumulators, scores (AMX stores its score tiles
 * there; none with `scores` 0) and P. Returns the size; at[] gets where V, q, the
 * accumulators, the scores and P begin. */
enum { AT_V, AT_Q, AT_ACC, AT_SCORES, AT_P };

static int64_t scratch_bf16(int64_t tiles, int64_t D, int64_t rows, int scores, int64_t at[5]) {
    at[AT_V] = tiles * KT * D * 2;
    at[AT_Q] = 2 * at[AT_V];
    at[AT_ACC] = at[AT_Q] + rows * D * 2;
    at[AT_SCORES] = at[AT_ACC] + rows * D * 4;
    at[AT_P] = at[AT_SCORES] + (scores ? rows * KT * 4 : 0);
    return at[AT_P] + rows * KT * 2;
}

static void run_unit_bf16(const Job *j, const Unit *u, char *buf) {
    const int64_t D = j->head_dim, G = j->heads / j->kv_heads;
    int64_t lo, hi;
    key_range(j, u, &lo, &hi);
    const int64_t tiles = (hi - lo + KT - 1) / KT;
    int64_t at[5];
    scratch_bf16(tiles, D, RB, 0, at);
    uint16_t *kp = (uint16_t *)buf, *vp = (uint16_t *)(buf + at[AT_V]);
    uint16_t *qs = (uint16_t *)(buf + at[AT_Q]), *pb = (uint16_t *)(buf + at[AT_P]);
    float *acc = (float *)(buf + at[AT_ACC]);
    stage_kv_bf16(j, u, lo, hi, tiles, kp, vp);
    const int64_t rows = (u->q1 - u->q0) * G;
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
        const int64_t nr = rows - r0 < RB ? rows - r0 : RB;
        Rows st;
        load_rows_bf16(j, u, r0, nr, RB, qs, acc, &st);
        prefetch_rows(j, u, r0 + RB, RB);
        int64_t t0, t1;
        tile_range(j, &st, lo, &t0, &t1);
        for (int64_t t = t0; t < t1; t++) {
            const uint16_t *kt = kp + t * (D / 2) * KT * 2;
            __m512 s[RB][NK];
            for (int r = 0; r < RB; r++)
                for (int n = 0; n < NK; n++) s[r][n] = _mm512_setzero_ps();
            for (int64_t e = 0; e < D / 2; e++) {
                __m512bh kv[NK];
                for (int n = 0; n < NK; n++)
                    kv[n] = (__m512bh)_mm512_loadu_si512(kt + (e * KT + n * 16) * 2);
                for (int r = 0; r < RB; r++) {
                    const __m512bh qq = pair_bcast(qs + r * D + 2 * e);
                    for (int n = 0; n < NK; n++) s[r][n] = _mm512_dpbf16_ps(s[r][n], qq, kv[n]);
                }
            }
            for (int r = 0; r < RB; r++)
                softmax_row(j, &st, r, s[r], (float)(lo + t * KT), pb + r * KT, acc + r * D);
            const uint16_t *vt = vp + t * (KT / 2) * D * 2;
            int64_t d0 = 0;
            for (; d0 + 64 <= D; d0 += 64) pv_tile_bf16(acc, pb, vt, D, d0, 4);
            for (; d0 < D; d0 += 16) pv_tile_bf16(acc, pb, vt, D, d0, 1);
        }
        store_rows_bf16(j, u, r0, nr, acc, &st);
    }
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
/* The AMX variant of run_unit_bf16 (same staging, same rounding): 16 query rows at a time,
 * the scores of KT keys in four tiles (TDPBF16PS over the head dimension, 32 at a time),
 * the softmax in AVX-512 from memory, P V into 16-column tiles of the fp32 accumulator.
 * Tiles: 0-3 scores, 4 the left operand (q or P), 5 the right (K or V), 6 the output. */
#include <sys/syscall.h>
#include <unistd.h>
#define AR ROWS_MAX /* query rows per AMX tile */

static void run_unit_amx(const Job *j, const Unit *u, char *buf) {
    const int64_t D = j->head_dim, G = j->heads / j->kv_heads;
    int64_t lo, hi;
    key_range(j, u, &lo, &hi);
    const int64_t tiles = (hi - lo + KT - 1) / KT;
    int64_t at[5];
    scratch_bf16(tiles, D, AR, 1, at);
    uint16_t *kp = (uint16_t *)buf, *vp = (uint16_t *)(buf + at[AT_V]);
    uint16_t *qs = (uint16_t *)(buf + at[AT_Q]), *pb = (uint16_t *)(buf + at[AT_P]);
    float *acc = (float *)(buf + at[AT_ACC]), *sc = (float *)(buf + at[AT_SCORES]);
    stage_kv_bf16(j, u, lo, hi, tiles, kp, vp);
    const int64_t rows = (u->q1 - u->q0) * G;
    for (int64_t r0 = 0; r0 < rows; r0 += AR) {
        const int64_t nr = rows - r0 < AR ? rows - r0 : AR;
        Rows st;
        load_rows_bf16(j, u, r0, nr, AR, qs, acc, &st);
        prefetch_rows(j, u, r0 + AR, AR);
        int64_t t0, t1;
        tile_range(j, &st, lo, &t0, &t1);
        for (int64_t t = t0; t < t1; t++) {
            const uint16_t *kt = kp + t * (D / 2) * KT * 2;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t e0 = 0; e0 < D; e0 += 32) {
                const uint16_t *kb = kt + (e0 / 2) * KT * 2;
                _tile_loadd(4, qs + e0, D * 2);
                _tile_loadd(5, kb, KT * 4);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(5, kb + 32, KT * 4);
                _tile_dpbf16ps(1, 4, 5);
                _tile_loadd(5, kb + 64, KT * 4);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(5, kb + 96, KT * 4);
                _tile_dpbf16ps(3, 4, 5);
            }
            _tile_stored(0, sc, KT * 4);
            _tile_stored(1, sc + 16, KT * 4);
            _tile_stored(2, sc + 32, KT * 4);
            _tile_stored(3, sc + 48, KT * 4);
            for (int r = 0; r < AR; r++) {
                __m512 sv[NK];
                for (int n = 0; n < NK; n++) sv[n] = _mm512_loadu_ps(sc + r * KT + n * 16);
                softmax_row(j, &st, r, sv, (float)(lo + t * KT), pb + r * KT, acc + r * D);
            }
            const uint16_t *vt = vp + t * (KT / 2) * D * 2;
            for (int64_t dn = 0; dn < D; dn += 16) {
                _tile_loadd(6, acc + dn, D * 4);
                _tile_loadd(4, pb, KT * 2);
                _tile_loadd(5, vt + dn * 2, D * 4);
                _tile_dpbf16ps(6, 4, 5);
                _tile_loadd(4, pb + 32, KT * 2);
                _tile_loadd(5, vt + (16 * D + dn) * 2, D * 4);
                _tile_dpbf16ps(6, 4, 5);
                _tile_stored(6, acc + dn, D * 4);
            }
        }
        store_rows_bf16(j, u, r0, nr, acc, &st);
    }
}
#define AMX 1
#else
#define AMX 0
#endif
#define BF16_DOT 1
#else
#define BF16_DOT 0
#endif

static void part(void *ctx, int64_t id) {
    (void)id;
    Job *j = ctx;
    float *buf = NULL;
    int64_t cap = 0;
    int configured = 0; /* this thread's AMX tiles */
    for (;;) {
        const int64_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->n_units) break;
        const Unit *u = &j->units[i];
        int64_t lo, hi;
        key_range(j, u, &lo, &hi);
        int64_t need = 2 * ((hi - lo + VW - 1) / VW) * VW * j->head_dim +
                       2 * RT * j->head_dim + RT * VW; /* floats */
#if BF16_DOT
        int64_t at[5];
        if (j->bf16_mode) /* in floats */
            need = (scratch_bf16((hi - lo + KT - 1) / KT, j->head_dim,
                                 j->bf16_mode == 2 ? ROWS_MAX : RB, j->bf16_mode == 2, at) +
                    3) / 4;
#endif
        if (need > cap) {
            free(buf);
            buf = aligned_alloc(64, (size_t)((need * 4 + 63) / 64 * 64));
            cap = buf ? need : 0;
            if (!buf) {
                __atomic_store_n(&j->rc, MS_NO_MEMORY, __ATOMIC_RELAXED);
                break;
            }
        }
#if BF16_DOT
#if AMX
        if (j->bf16_mode == 2) {
            if (!configured) amx_configure();
            configured = 1;
            run_unit_amx(j, u, (char *)buf);
            continue;
        }
#endif
        if (j->bf16_mode == 1) {
            run_unit_bf16(j, u, (char *)buf);
            continue;
        }
#endif
        run_unit(j, u, buf);
    }
#if AMX
    if (configured) _tile_release();
#endif
    (void)configured;
    free(buf);
}
#endif

int ms_prefill_attention(const void *q, int64_t q_bf16, int64_t q_stride, const void *k,
                         const void *v, int64_t kv_bf16, int64_t block_size, int64_t kv_heads,
                         int64_t head_dim, int64_t heads, const int64_t *tables,
                         int64_t table_stride, const int64_t *starts, const int64_t *lens,
                         const int64_t *pos, int64_t chunks, float scale, int64_t window,
                         void *out, int64_t out_bf16, int64_t out_stride, int64_t threads,
                         int64_t variant) {
#if defined(VW)
    if (head_dim % VW != 0 || kv_heads <= 0 || heads % kv_heads != 0) return MS_UNSUPPORTED;
    int64_t n = 0;
    for (int64_t c = 0; c < chunks; c++) n += kv_heads * ((lens[c] + QBLOCK - 1) / QBLOCK);
    Unit *units = malloc((size_t)(n > 0 ? n : 1) * sizeof(Unit));
    if (!units) return MS_NO_MEMORY;
    Job job = {q, q_bf16, q_stride, k, v, kv_bf16, block_size, kv_heads, head_dim, heads,
               tables, table_stride, starts, lens, pos, scale, window, out, out_bf16,
               out_stride, 0, units, n, 0, 0};
    int64_t best = 0; /* the fastest variant these shapes and this CPU have */
#if defined(__AVX512BF16__)
    if (kv_bf16 && out_bf16) best = 1;
#if AMX
    if (kv_bf16 && out_bf16 && head_dim % 32 == 0 && ms_amx_permitted()) best = 2;
#endif
#endif
    if (variant > best || (variant == 1 && !(kv_bf16 && out_bf16))) {
        free(units);
        return MS_UNSUPPORTED;
    }
    job.bf16_mode = variant < 0 ? best : variant;
    int64_t i = 0;
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t q0 = 0; q0 < lens[c]; q0 += QBLOCK)
            for (int64_t g = 0; g < kv_heads; g++) {
                Unit *u = &units[i++];
                u->chunk = c, u->kv_head = g, u->q0 = q0;
                u->q1 = q0 + QBLOCK < lens[c] ? q0 + QBLOCK : lens[c];
                int64_t lo, hi;
                key_range(&job, u, &lo, &hi);
                u->cost = (u->q1 - u->q0) * (hi - lo);
            }
    qsort(units, (size_t)n, sizeof(Unit), by_cost);
    int64_t parts = threads < n ? threads : n;
    if (parts <= 1)
        part(&job, 0);
    else
        ms_pool_run(part, &job, parts);
    free(units);
    return job.rc;
#else
    (void)q, (void)q_bf16, (void)q_stride, (void)k, (void)v, (void)kv_bf16, (void)block_size;
    (void)kv_heads, (void)head_dim, (void)heads, (void)tables, (void)table_stride;
    (void)starts, (void)lens, (void)pos, (void)chunks, (void)scale, (void)window, (void)out;
    (void)out_bf16, (void)out_stride, (void)threads, (void)variant;
    return MS_UNSUPPORTED;
#endif
}
