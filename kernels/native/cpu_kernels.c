/* meshserve's CPU kernels: attention that reads the paged KV cache in place, and RMSNorm.
 *
 * Plain C99, no Python or torch headers: kernels/native_cpu.py compiles this file once per
 * machine (cc -O3 -march=native) and calls it through ctypes with tensors' data pointers.
 * Every function is single-threaded: on the CPU meshserve runs one rank per core.
 *
 * Dot products and sums use LANES independent accumulators, so the compiler vectorizes
 * them (AVX2 / AVX-512 / NEON) without being allowed to reorder floating-point sums.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "vec_math.h"

#define LANES 16

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static float dot(const float *a, const float *b, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8)
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float s = hsum8(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

#else
static float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

#endif

static float sum_squares(const float *a, int64_t n) {
    return dot(a, a, n);
}

#define CHUNK 32
#define VCHUNK 64 /* value_rows2's values a pass with AVX-512 */

/* The KV cache holds fp32 or bf16 elements (engine.kv_cache_dtype); `bf16` below is a
 * constant at each call of the always-inlined attention body, so each cache dtype gets its
 * own compiled loop. A bf16 value is the top half of the fp32 with the same bits. */
#define INLINE static inline __attribute__((always_inline))

INLINE float kv_at(const void *base, int64_t i, int bf16) { return widen_at(base, i, bf16); }


INLINE float dot_kv(const float *a, const void *b, int64_t n, int bf16) {
    if (!bf16) return dot(a, (const float *)b, n);
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * kv_at(b, i, 1);
    return s;
}

/* acc[0:CHUNK] (loaded from o) += p * row[i:i + CHUNK] over rows, then stored: four AVX2
 * registers, or an array the compiler may vectorize. */
#if defined(__AVX2__) && defined(__FMA__)
INLINE __m256 load8_kv(const void *base, int64_t i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)base + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#define CHUNK_ACC_LOAD(o)                                                \
    __m256 a0_ = _mm256_loadu_ps((o)), a1_ = _mm256_loadu_ps((o) + 8);   \
    __m256 a2_ = _mm256_loadu_ps((o) + 16), a3_ = _mm256_loadu_ps((o) + 24);
#define CHUNK_ACC_STEP(p, row, i, bf16)                                  \
    {                                                                    \
        const __m256 p_ = _mm256_set1_ps(p);                             \
        a0_ = _mm256_fmadd_ps(p_, load8_kv((row), (i), (bf16)), a0_);       \
        a1_ = _mm256_fmadd_ps(p_, load8_kv((row), (i) + 8, (bf16)), a1_);   \
        a2_ = _mm256_fmadd_ps(p_, load8_kv((row), (i) + 16, (bf16)), a2_);  \
        a3_ = _mm256_fmadd_ps(p_, load8_kv((row), (i) + 24, (bf16)), a3_);  \
    }
#define CHUNK_ACC_STORE(o)                                               \
    _mm256_storeu_ps((o), a0_); _mm256_storeu_ps((o) + 8, a1_);          \
    _mm256_storeu_ps((o) + 16, a2_); _mm256_storeu_ps((o) + 24, a3_);
#else
#define CHUNK_ACC_LOAD(o) float acc_[CHUNK]; memcpy(acc_, (o), sizeof(acc_));
#define CHUNK_ACC_STEP(p, row, i, bf16) \
    { const float p_ = (p); \
      for (int i_ = 0; i_ < CHUNK; i_++) acc_[i_] += p_ * kv_at((row), (i) + i_, (bf16)); }
#define CHUNK_ACC_STORE(o) memcpy((o), acc_, sizeof(acc_));
#endif

#if defined(__AVX512F__)
INLINE __m512 load16_kv(const void *base, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)base + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Lane i of the result: the sum of v[i]'s 16 lanes, for i < 8. */
INLINE __m256 sum8x16(const __m512 *v) {
    __m512 w[4], x[2];
    for (int i = 0; i < 4; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) { /* per 128-bit lane: each of four vectors' lane sums */
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* lanes (0 + 1, 2 + 3) of each, then the halves: vectors 0-3 | 4-7 */
    const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                                   _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    const __m512 z = _mm512_add_ps(y, _mm512_shuffle_f32x4(y, y, 0xB1));
    return _mm512_castps512_ps256(_mm512_shuffle_f32x4(z, z, 0x08));
}
#endif

/* scores[h * len + r] = scale * q_h . row_r for `rows` consecutive key rows; `row` and the
 * strides count cache elements. */
INLINE void key_scores(float *scores, int64_t len, const float *q, const void *row,
                       int64_t rows, int64_t tok_stride, int64_t heads, int64_t group,
                       int64_t head_dim, float scale, int bf16) {
    int64_t r = 0;
#if defined(__AVX512F__)
    if (head_dim % 16 == 0 && group % 2 == 0) {
        /* Two heads of a GQA group score the same K rows: eight rows at a time for both (16
         * accumulators), each K vector loaded and widened once; the eight sums of a head
         * are added lane-wise by a transpose-add tree into one store. */
        const __m256 sc = _mm256_set1_ps(scale);
        for (; r + 8 <= rows; r += 8)
            for (int64_t h = 0; h < heads; h += 2) {
                const float *q0 = q + h * head_dim, *q1 = q0 + head_dim;
                const int64_t kh = r * tok_stride + (h / group) * head_dim;
                __m512 a[8], b[8];
                for (int x = 0; x < 8; x++) a[x] = b[x] = _mm512_setzero_ps();
                for (int64_t c = 0; c < head_dim; c += 16) {
                    const __m512 qa = _mm512_loadu_ps(q0 + c), qb = _mm512_loadu_ps(q1 + c);
                    for (int x = 0; x < 8; x++) {
                        const __m512 kv = load16_kv(row, kh + x * tok_stride + c, bf16);
                        a[x] = _mm512_fmadd_ps(qa, kv, a[x]);
                        b[x] = _mm512_fmadd_ps(qb, kv, b[x]);
                    }
                }
                _mm256_storeu_ps(scores + h * len + r, _mm256_mul_ps(sc, sum8x16(a)));
                _mm256_storeu_ps(scores + (h + 1) * len + r, _mm256_mul_ps(sc, sum8x16(b)));
            }
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (head_dim % 8 == 0 && group % 2 == 0) {
        /* Two heads of a GQA group score the same K rows: four rows at a time for both, each
         * K vector loaded (and converted) once; every score is the same sum, in the same
         * order, as the eight-row loop below gives it. */
        const __m128 sc = _mm_set1_ps(scale);
        for (; r + 4 <= rows; r += 4) {
            for (int64_t h = 0; h < heads; h += 2) {
                const float *q0 = q + h * head_dim, *q1 = q0 + head_dim;
                const int64_t kh = r * tok_stride + (h / group) * head_dim;
                __m256 a[4], b[4];
                for (int x = 0; x < 4; x++) a[x] = b[x] = _mm256_setzero_ps();
                for (int64_t c = 0; c < head_dim; c += 8) {
                    const __m256 qa = _mm256_loadu_ps(q0 + c), qb = _mm256_loadu_ps(q1 + c);
                    for (int x = 0; x < 4; x++) {
                        const __m256 kv = load8_kv(row, kh + x * tok_stride + c, bf16);
                        a[x] = _mm256_fmadd_ps(qa, kv, a[x]);
                        b[x] = _mm256_fmadd_ps(qb, kv, b[x]);
                    }
                }
                const __m256 sa = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]),
                                                 _mm256_hadd_ps(a[2], a[3]));
                const __m256 sb = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]),
                                                 _mm256_hadd_ps(b[2], b[3]));
                _mm_storeu_ps(scores + h * len + r, _mm_mul_ps(sc, _mm_add_ps(
                    _mm256_castps256_ps128(sa), _mm256_extractf128_ps(sa, 1))));
                _mm_storeu_ps(scores + (h + 1) * len + r, _mm_mul_ps(sc, _mm_add_ps(
                    _mm256_castps256_ps128(sb), _mm256_extractf128_ps(sb, 1))));
            }
        }
    } else if (head_dim % 8 == 0) {
        /* Eight rows at a time: eight accumulators reduced together into one register. */
        const __m256 sc = _mm256_set1_ps(scale);
        for (; r + 8 <= rows; r += 8) {
            for (int64_t h = 0; h < heads; h++) {
                const float *qh = q + h * head_dim;
                const int64_t kh = r * tok_stride + (h / group) * head_dim;
                __m256 a[8];
                for (int x = 0; x < 8; x++) a[x] = _mm256_setzero_ps();
                for (int64_t c = 0; c < head_dim; c += 8) {
                    const __m256 qv = _mm256_loadu_ps(qh + c);
                    for (int x = 0; x < 8; x++)
                        a[x] = _mm256_fmadd_ps(qv, load8_kv(row, kh + x * tok_stride + c, bf16),
                                               a[x]);
                }
                const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]),
                                                    _mm256_hadd_ps(a[2], a[3]));
                const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]),
                                                    _mm256_hadd_ps(a[6], a[7]));
                const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                                 _mm256_permute2f128_ps(s0123, s4567, 0x31));
                _mm256_storeu_ps(scores + h * len + r, _mm256_mul_ps(sum, sc));
            }
        }
    }
#endif
    const int64_t elem = bf16 ? 2 : 4;
    for (; r < rows; r++) {
        const char *rr = (const char *)row + r * tok_stride * elem;
        for (int64_t h = 0; h < heads; h++)
            scores[h * len + r] = scale * dot_kv(q + h * head_dim,
                                                 rr + (h / group) * head_dim * elem, head_dim,
                                                 bf16);
    }
}

/* A block's K and V lines still to be asked for: `done` of `bytes` from each of k and v. */
typedef struct {
    const char *k, *v;
    int64_t bytes, done;
} Pending;

/* Asks for the next `bytes` of the pending block's K and V (into L2: a few blocks ahead
 * overflow L1). */
static void prefetch_some(Pending *pf, int64_t bytes) {
    const int64_t end = pf->done + bytes < pf->bytes ? pf->done + bytes : pf->bytes;
    for (int64_t i = pf->done; i < end; i += 64) {
        __builtin_prefetch(pf->k + i, 0, 1);
        __builtin_prefetch(pf->v + i, 0, 1);
    }
    pf->done = end;
}

/* o[0:head_dim] = o * corr + sum_r p[r] * rows[r * tok_stride + 0:head_dim] for r < count, in
 * order of r, CHUNK floats at a time in registers; asks for `per_row` more bytes of the
 * pending block `pf` at each row. */
INLINE void value_rows(float *o, float corr, const float *p, const void *rows, int64_t count,
                       int64_t tok_stride, int64_t head_dim, Pending *pf, int64_t per_row,
                       int bf16) {
    if (corr != 1.0f) /* 1: the running maximum held, most blocks after the first */
        for (int64_t i = 0; i < head_dim; i++) o[i] *= corr;
    for (int64_t c = 0; c < head_dim; c += CHUNK) {
        const int64_t width = head_dim - c < CHUNK ? head_dim - c : CHUNK;
        if (width == CHUNK) {
            CHUNK_ACC_LOAD(o + c)
            for (int64_t r = 0; r < count; r++) {
                prefetch_some(pf, per_row);
                CHUNK_ACC_STEP(p[r], rows, r * tok_stride + c, bf16)
            }
            CHUNK_ACC_STORE(o + c)
        } else {
            for (int64_t r = 0; r < count; r++)
                for (int64_t i = 0; i < width; i++)
                    o[c + i] += p[r] * kv_at(rows, r * tok_stride + c + i, bf16);
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* value_rows for two heads of a GQA group, which weigh the same V rows: each V vector is
 * loaded (and converted) once for both. Every output is the same FMA chain over r as
 * value_rows gives it. head_dim a multiple of CHUNK. */
INLINE void value_rows2(float *o0, float *o1, float corr0, float corr1, const float *p0,
                        const float *p1, const void *rows, int64_t count, int64_t tok_stride,
                        int64_t head_dim, Pending *pf, int64_t per_row, int bf16) {
    if (corr0 != 1.0f)
        for (int64_t i = 0; i < head_dim; i++) o0[i] *= corr0;
    if (corr1 != 1.0f)
        for (int64_t i = 0; i < head_dim; i++) o1[i] *= corr1;
#if defined(__AVX512F__)
    if (head_dim % VCHUNK == 0) { /* a whole row of 64 values at a time, 4 x 16 lanes */
        for (int64_t c = 0; c < head_dim; c += VCHUNK) {
            __m512 a[4], b[4];
            for (int j = 0; j < 4; j++) {
                a[j] = _mm512_loadu_ps(o0 + c + 16 * j);
                b[j] = _mm512_loadu_ps(o1 + c + 16 * j);
            }
            for (int64_t r = 0; r < count; r++) {
                prefetch_some(pf, per_row);
                const int64_t i = r * tok_stride + c;
                const __m512 x = _mm512_set1_ps(p0[r]), y = _mm512_set1_ps(p1[r]);
                for (int j = 0; j < 4; j++) {
                    const __m512 v = load16_kv(rows, i + 16 * j, bf16);
                    a[j] = _mm512_fmadd_ps(x, v, a[j]);
                    b[j] = _mm512_fmadd_ps(y, v, b[j]);
                }
            }
            for (int j = 0; j < 4; j++) {
                _mm512_storeu_ps(o0 + c + 16 * j, a[j]);
                _mm512_storeu_ps(o1 + c + 16 * j, b[j]);
            }
        }
        return;
    }
#endif
    for (int64_t c = 0; c < head_dim; c += CHUNK) {
        __m256 a0 = _mm256_loadu_ps(o0 + c), a1 = _mm256_loadu_ps(o0 + c + 8);
        __m256 a2 = _mm256_loadu_ps(o0 + c + 16), a3 = _mm256_loadu_ps(o0 + c + 24);
        __m256 b0 = _mm256_loadu_ps(o1 + c), b1 = _mm256_loadu_ps(o1 + c + 8);
        __m256 b2 = _mm256_loadu_ps(o1 + c + 16), b3 = _mm256_loadu_ps(o1 + c + 24);
        for (int64_t r = 0; r < count; r++) {
            prefetch_some(pf, per_row);
            const int64_t i = r * tok_stride + c;
            const __m256 v0 = load8_kv(rows, i, bf16), v1 = load8_kv(rows, i + 8, bf16);
            const __m256 v2 = load8_kv(rows, i + 16, bf16), v3 = load8_kv(rows, i + 24, bf16);
            const __m256 x = _mm256_set1_ps(p0[r]), y = _mm256_set1_ps(p1[r]);
            a0 = _mm256_fmadd_ps(x, v0, a0);
            a1 = _mm256_fmadd_ps(x, v1, a1);
            a2 = _mm256_fmadd_ps(x, v2, a2);
            a3 = _mm256_fmadd_ps(x, v3, a3);
            b0 = _mm256_fmadd_ps(y, v0, b0);
            b1 = _mm256_fmadd_ps(y, v1, b1);
            b2 = _mm256_fmadd_ps(y, v2, b2);
            b3 = _mm256_fmadd_ps(y, v3, b3);
        }
        _mm256_storeu_ps(o0 + c, a0); _mm256_storeu_ps(o0 + c + 8, a1);
        _mm256_storeu_ps(o0 + c + 16, a2); _mm256_storeu_ps(o0 + c + 24, a3);
        _mm256_storeu_ps(o1 + c, b0); _mm256_storeu_ps(o1 + c + 8, b1);
        _mm256_storeu_ps(o1 + c + 16, b2); _mm256_storeu_ps(o1 + c + 24, b3);
    }
}
#define PAIRS 1
#else
#define PAIRS 0
#endif

/* s[0:n] = exp(s[0:n] - m) in place (exp8 where AVX2 is there); returns their sum. */
static float exp_shifted(float *s, int64_t n, float m) {
    int64_t i = 0;
    float total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    total = hsum8(acc);
#endif
    for (; i < n; i++) {
        s[i] = expf(s[i] - m);
        total += s[i];
    }
    return total;
}

static float max_of(const float *s, int64_t n) {
    int64_t i = 1;
    float m = s[0];
#if defined(__AVX2__) && defined(__FMA__)
    if (n >= 8) { /* eight lanes, not one compare chain: a block's 16 scores in 2 steps */
        __m256 mv = _mm256_loadu_ps(s);
        for (i = 8; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    }
#endif
    for (; i < n; i++) m = s[i] > m ? s[i] : m;
    return m;
}

/* The blocks a whole batch reads, in order: sequence b's blocks from start_b / block_size
 * on. The kernel prefetches PREFETCH_BLOCKS of them ahead of the one it works on, across
 * sequence boundaries: blocks lie anywhere in the pool, where the hardware prefetcher can't
 * guess them, and one block of a small model's cache (16 rows of 1 KiB) is too little to
 * cover the memory's latency. A block's lines are asked for a line or two of K and V at
 * each value row of the block PREFETCH_BLOCKS before it, not all at once: a burst of a
 * thousand prefetches fills the core's miss queues and stalls the loads the work needs (on
 * a 2-core EPYC VM, cold-cache decode attention: about 10 GB/s in bursts, 12 a slice per
 * head, 13-14 a line or two a row, against 15-19 for a plain read of the same blocks). */
#define PREFETCH_BLOCKS 4

typedef struct {
    const int64_t *tables, *lens;
    int64_t table_stride, block_size, window, batch;
    int64_t b, blk; /* the cursor: sequence b, its block blk */
} BlockCursor;

static int64_t seq_start(const BlockCursor *c, int64_t b) {
    const int64_t n = c->lens[b];
    return (c->window > 0 && n > c->window) ? n - c->window : 0;
}

/* Moves the cursor to the next block holding wanted rows and makes its K and V pending;
 * 0 when the batch has no more. */
static int prefetch_next(BlockCursor *c, const char *k, const char *v, int64_t blk_stride,
                         int64_t tok_stride, int64_t elem, Pending *pf) {
    c->blk++;
    while (c->b < c->batch && c->blk * c->block_size >= c->lens[c->b]) {
        c->b++;
        if (c->b < c->batch) c->blk = seq_start(c, c->b) / c->block_size;
    }
    if (c->b >= c->batch) return 0;
    const int64_t first = c->blk * c->block_size, start = seq_start(c, c->b);
    const int64_t n = c->lens[c->b];
    const int64_t lo = first < start ? start - first : 0;
    const int64_t hi = n - first < c->block_size ? n - first : c->block_size;
    const int64_t off = c->tables[c->b * c->table_stride + c->blk] * blk_stride + lo * tok_stride;
    pf->k = k + off * elem;
    pf->v = v + off * elem;
    pf->bytes = (hi - lo) * tok_stride * elem;
    pf->done = 0;
    return 1;
}

/* One query token per sequence against its cached keys and values, in one pass over the
 * cache: each block's keys are scored, and its values weighed by a softmax whose running
 * maximum and sum are carried from block to block (the output rescaled when the maximum
 * grows), so a block's K and V are read together, once.
 *
 * q       [B, H, D] with row stride q_stride (heads contiguous, D floats each)
 * k, v    caches [num_blocks, block_size, Hkv, D], contiguous: fp32, or bf16 where kv_bf16
 * tables  [B, table_stride] block ids (int64); lens [B] tokens cached, the query's included
 * out     [B, H, D] contiguous (zeros for a sequence with no tokens)
 * window  > 0: attend to the last `window` positions only
 * Returns 0, or -1 when scratch memory could not be allocated.
 */
INLINE int paged_decode(const float *q, int64_t q_stride, const void *k, const void *v,
                        const int64_t *tables, int64_t table_stride, const int64_t *lens,
                        float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int64_t window,
                        int bf16) {
    const int64_t elem = bf16 ? 2 : 4;
    const int64_t group = heads / kv_heads;
    const int64_t tok_stride = kv_heads * head_dim;
    const int64_t blk_stride = block_size * tok_stride;
    /* Heads 2i and 2i + 1 share their V rows (value_rows2) where the group is even. */
    const int pairs = PAIRS && group % 2 == 0 && head_dim % CHUNK == 0;
    float *scores = malloc(sizeof(float) * (size_t)(heads * (block_size + 2)));
    if (scores == NULL) return -1;
    float *run_max = scores + heads * block_size, *run_sum = run_max + heads;
    /* The prefetch cursor runs PREFETCH_BLOCKS ahead of the block being worked on. */
    BlockCursor ahead = {tables, lens, table_stride, block_size, window, batch, 0, 0};
    int more = batch > 0;
    Pending pf = {0, 0, 0, 0};
    if (more) ahead.blk = seq_start(&ahead, 0) / block_size - 1;
    for (int i = 0; i < PREFETCH_BLOCKS && more; i++) {
        more = prefetch_next(&ahead, k, v, blk_stride, tok_stride, elem, &pf);
        if (more) prefetch_some(&pf, pf.bytes);
    }
    for (int64_t b = 0; b < batch; b++) {
        const int64_t n = lens[b], start = seq_start(&ahead, b);
        const int64_t *table = tables + b * table_stride;
        const float *qb = q + b * q_stride;
        float *ob = out + b * heads * head_dim;
        memset(ob, 0, sizeof(float) * (size_t)(heads * head_dim));
        for (int64_t h = 0; h < heads; h++) {
            run_max[h] = -INFINITY;
            run_sum[h] = 0.0f;
        }
        for (int64_t blk = start / block_size; blk * block_size < n; blk++) {
            if (more) more = prefetch_next(&ahead, k, v, blk_stride, tok_stride, elem, &pf);
            const int64_t first = blk * block_size;
            const int64_t lo = first < start ? start - first : 0;
            const int64_t hi = n - first < block_size ? n - first : block_size;
            const int64_t rows = hi - lo, off = table[blk] * blk_stride + lo * tok_stride;
            /* The pending block's bytes a value row: a line or two of K and of V (none once
             * the last block is asked for: its `done` is its `bytes`). */
#if defined(__AVX512F__)
            const int64_t width = pairs && head_dim % VCHUNK == 0 ? VCHUNK : CHUNK;
#else
            const int64_t width = CHUNK;
#endif
            const int64_t chunks = (head_dim + width - 1) / width;
            const int64_t passes = (pairs ? heads / 2 : heads) * chunks;
            const int64_t per_row = (pf.bytes / (passes * rows) + 63) / 64 * 64;
            const char *kb = (const char *)k + off * elem, *vb = (const char *)v + off * elem;
            key_scores(scores, block_size, qb, kb, rows, tok_stride, heads, group, head_dim,
                       scale, bf16);
            float corr[2];
            for (int64_t h = 0; h < heads; h++) {
                float *s = scores + h * block_size;
                const float m = max_of(s, rows);
                const float new_max = m > run_max[h] ? m : run_max[h];
                corr[h & 1] = run_max[h] == -INFINITY ? 0.0f
                              : new_max == run_max[h] ? 1.0f : expf(run_max[h] - new_max);
                run_sum[h] = run_sum[h] * corr[h & 1] + exp_shifted(s, rows, new_max);
                run_max[h] = new_max;
                const char *vh = vb + (h / group) * head_dim * elem;
#if PAIRS
                if (pairs) {
                    if (h & 1)
                        value_rows2(ob + (h - 1) * head_dim, ob + h * head_dim, corr[0], corr[1],
                                    s - block_size, s, vh, rows, tok_stride, head_dim, &pf,
                                    per_row, bf16);
                    continue;
                }
#endif
                value_rows(ob + h * head_dim, corr[h & 1], s, vh, rows, tok_stride, head_dim,
                           &pf, per_row, bf16);
            }
            prefetch_some(&pf, pf.bytes); /* what a head_dim % CHUNK tail left */
        }
        for (int64_t h = 0; h < heads; h++) {
            const float inv = run_sum[h] > 0.0f ? 1.0f / run_sum[h] : 0.0f;
            for (int64_t i = 0; i < head_dim; i++) ob[h * head_dim + i] *= inv;
        }
    }
    free(scores);
    return 0;
}

int ms_paged_decode_f32(const float *q, int64_t q_stride, const void *k, const void *v,
                        const int64_t *tables, int64_t table_stride, const int64_t *lens,
                        float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int64_t window,
                        int64_t kv_bf16) {
    if (kv_bf16)
        return paged_decode(q, q_stride, k, v, tables, table_stride, lens, out, batch, heads,
                            kv_heads, head_dim, block_size, scale, window, 1);
    return paged_decode(q, q_stride, k, v, tables, table_stride, lens, out, batch, heads,
                        kv_heads, head_dim, block_size, scale, window, 0);
}

/* out = weight * x / sqrt(mean(x^2) + eps), row by row; x, out [rows, width] contiguous. */
void ms_rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows,
                     int64_t width, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * width;
        float *yr = out + r * width;
        const float inv = 1.0f / sqrtf(sum_squares(xr, width) / (float)width + eps);
        for (int64_t i = 0; i < width; i++) yr[i] = weight[i] * (xr[i] * inv);
    }
}

/* residual_out = x + residual; out = rms_norm(residual_out). */
void ms_add_rms_norm_f32(const float *x, const float *residual, const float *weight,
                         float *out, float *residual_out, int64_t rows, int64_t width,
                         float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * width, *rr = residual + r * width;
        float *sr = residual_out + r * width;
        for (int64_t i = 0; i < width; i++) sr[i] = xr[i] + rr[i];
    }
    ms_rms_norm_f32(residual_out, weight, out, rows, width, eps);
}

/* SwiGLU's activation: x [rows, 2 * width] = [gate | up] -> out [rows, width] =
 * silu(gate) * up, silu(g) = g / (1 + exp(-g)), each op rounded to fp32 as PyTorch's are. */
void ms_silu_mul_f32(const float *x, float *out, int64_t rows, int64_t width) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * 2 * width, *u = g + width;
        float *o = out + r * width;
        for (int64_t i = 0; i < width; i++) {
            const float s = g[i] / (1.0f + expf(-g[i]));
            o[i] = s * u[i];
        }
    }
}

/* ms_silu_mul_f32 for bf16 activations (a oneDNN gate/up's output): each value widened,
 * silu(g) * u computed in fp32 and rounded to bf16 (nearest even) once. Eight at a time
 * with exp8 where AVX2 is there. */
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* fp32 -> bf16, nearest even, eight at a time (bf16_round's rounding; a NaN stays a NaN). */
static inline __m128i round8_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, lsb),
                                                   _mm256_set1_epi32(0x7fff)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16),
                                              _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif

#if defined(__AVX512F__)
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* fp32 -> bf16, nearest even, sixteen at a time (VCVTNEPS2BF16 where AVX512_BF16 is there;
 * both keep a NaN a NaN). */
static inline void store16_bf16(uint16_t *p, __m512 v) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
#else
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, lsb),
                                                   _mm512_set1_epi32(0x7fff)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16),
                                                      _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
#endif
}
#endif

/* Rows [0, rows) of SwiGLU in bf16; sixteen at a time where AVX-512 is there (1 / (1 + e)
 * by VRCP14PS and one Newton step: within 2 ulp of the division before the bf16
 * rounding). */
void ms_silu_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t width) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = x + r * 2 * width, *u = g + width;
        uint16_t *o = out + r * width;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= width; i += 16)
            store16_bf16(o + i, _mm512_mul_ps(silu16(load16_bf16(g + i)), load16_bf16(u + i)));
#endif
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), top = _mm256_set1_ps(88.0f);
        for (; i + 8 <= width; i += 8) {
            const __m256 gv = load8_bf16(g + i);
            const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), top));
            const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm_storeu_si128((__m128i *)(o + i),
                             round8_bf16(_mm256_mul_ps(s, load8_bf16(u + i))));
        }
#endif
        for (; i < width; i++) {
            const float gi = kv_at(g, i, 1), ui = kv_at(u, i, 1);
            o[i] = bf16_round(gi / (1.0f + expf(-gi)) * ui);
        }
    }
}

/* RMSNorm with bf16 at either end (a bf16 model's batched steps: oneDNN linears read and
 * write bf16): residual_out = x + residual (fp32; x fp32 or, with x_bf16, bf16 widened),
 * out = rms_norm(residual_out) as ms_rms_norm_f32 computes it, stored as fp32 or, with
 * out_bf16, rounded to bf16. Without a residual (NULL), x itself (fp32) is normed and
 * residual_out is not written. */
void ms_add_rms_norm_mixed(const void *x, int64_t x_bf16, const float *residual,
                           const float *weight, void *out, int64_t out_bf16,
                           float *residual_out, int64_t rows, int64_t width, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *src;
        if (residual) {
            const float *rr = residual + r * width;
            float *sr = residual_out + r * width;
            int64_t i = 0;
#if defined(__AVX512F__)
            for (; i + 16 <= width; i += 16) {
                const __m512 xv = x_bf16 ? load16_bf16((const uint16_t *)x + r * width + i)
                                         : _mm512_loadu_ps((const float *)x + r * width + i);
                _mm512_storeu_ps(sr + i, _mm512_add_ps(xv, _mm512_loadu_ps(rr + i)));
            }
#endif
            for (; i < width; i++)
                sr[i] = (x_bf16 ? kv_at(x, r * width + i, 1) : ((const float *)x)[r * width + i])
                        + rr[i];
            src = sr;
        } else {
            src = (const float *)x + r * width;
        }
        const float inv = 1.0f / sqrtf(sum_squares(src, width) / (float)width + eps);
        if (!out_bf16) {
            float *yr = (float *)out + r * width;
            for (int64_t i = 0; i < width; i++) yr[i] = weight[i] * (src[i] * inv);
            continue;
        }
        uint16_t *yr = (uint16_t *)out + r * width;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 iv16 = _mm512_set1_ps(inv);
        for (; i + 16 <= width; i += 16)
            store16_bf16(yr + i, _mm512_mul_ps(_mm512_loadu_ps(weight + i),
                                               _mm512_mul_ps(_mm512_loadu_ps(src + i), iv16)));
#endif
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 iv = _mm256_set1_ps(inv);
        for (; i + 8 <= width; i += 8)
            _mm_storeu_si128((__m128i *)(yr + i), round8_bf16(_mm256_mul_ps(
                _mm256_loadu_ps(weight + i), _mm256_mul_ps(_mm256_loadu_ps(src + i), iv))));
#endif
        for (; i < width; i++) yr[i] = bf16_round(weight[i] * (src[i] * inv));
    }
}

/* Rotary embedding (rotate-half layout) in place: x [T, H, D] with token stride t_stride and
 * heads D apart; cos, sin [T, D/2] contiguous. Each product is rounded before the sum, as
 * PyTorch's x1 * cos - x2 * sin does (this file is built without FMA contraction). */
void ms_rotary_inplace_f32(float *x, int64_t t_stride, int64_t tokens, int64_t heads,
                           int64_t head_dim, const float *cos, const float *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * t_stride + h * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                const float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
                x1[i] = ac - bs;
                x2[i] = bc + as;
            }
        }
    }
}

/* Store each token's K and V rows (row floats each, token strides k_stride / v_stride) at
 * flat cache slots [tokens] of caches laid out [slots, row]: fp32, or bf16 (rounded to
 * nearest even) where kv_bf16. */
void ms_write_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                     int64_t tokens, int64_t row, void *k_cache, void *v_cache,
                     const int64_t *slots, int64_t kv_bf16) {
    for (int64_t t = 0; t < tokens; t++) {
        const size_t bytes = sizeof(float) * (size_t)row;
        if (!kv_bf16) {
            memcpy((float *)k_cache + slots[t] * row, k + t * k_stride, bytes);
            memcpy((float *)v_cache + slots[t] * row, v + t * v_stride, bytes);
            continue;
        }
        uint16_t *kd = (uint16_t *)k_cache + slots[t] * row;
        uint16_t *vd = (uint16_t *)v_cache + slots[t] * row;
        for (int64_t i = 0; i < row; i++) {
            kd[i] = bf16_round(k[t * k_stride + i]);
            vd[i] = bf16_round(v[t * v_stride + i]);
        }
    }
}

/* A layer's attention up to the prefill part, in one call: qkv [T, H + 2 Hkv, D] (contiguous)
 * has its q and k heads rotated in place by cos, sin [T, D/2]; every token's K and V is
 * stored at slots [T] (fp32, or bf16 where kv_bf16); the first num_decode tokens (one per
 * sequence) attend through their block tables into out [num_decode, H, D]. The prefill
 * tokens after them are left to the caller, their q and k rotated and their K/V stored.
 * Returns ms_paged_decode_f32's code. The rows' attention splits over `threads` (pool.c). */
int ms_attend_qkv_f32(float *qkv, int64_t tokens, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, const float *cos, const float *sin, void *k_cache,
                      void *v_cache, int64_t kv_bf16, int64_t block_size,
                      const int64_t *slots, int64_t num_decode, const int64_t *tables,
                      int64_t table_stride, const int64_t *lens, float scale, int64_t window,
                      float *out, int64_t threads) {
    const int64_t t_stride = (heads + 2 * kv_heads) * head_dim;
    const int64_t kv_row = kv_heads * head_dim;
    ms_rotary_inplace_f32(qkv, t_stride, tokens, heads + kv_heads, head_dim, cos, sin);
    ms_write_kv_f32(qkv + heads * head_dim, t_stride, qkv + (heads + kv_heads) * head_dim,
                    t_stride, tokens, kv_row, k_cache, v_cache, slots, kv_bf16);
    if (num_decode == 0) return 0;
    return ms_paged_decode_mt(qkv, t_stride, k_cache, v_cache, tables, table_stride, lens, out,
                              num_decode, heads, kv_heads, head_dim, block_size, scale, window,
                              kv_bf16, threads);
}

/* ---- Linear layers at small batch: out[M, N] = x[M, K] @ w[N, K]^T ----
 *
 * w row-major, as nn.Linear stores it. A block of 4 weight rows and up to 3 input rows
 * keeps 12 eight-lane accumulators in registers while the 4 weight rows stream through
 * contiguously (the hardware prefetcher follows each); the block (4 x K floats) stays in
 * L1 for the next input rows. Each output is a fixed sum: 8 lanes, each an FMA chain over
 * its k in order, added in a fixed order at the end, then the K % 8 tail in order. So a
 * row's result does not depend on M or on the other rows.
 */
#if defined(__AVX2__) && defined(__FMA__)
#define LIN_BLOCK(MB)                                                                      \
    static void lin4_##MB(const float *x, int64_t xs, const float *w, int64_t ws,         \
                          float *out, int64_t os, int64_t K, int prefetch) {               \
        __m256 acc[MB][4];                                                                 \
        for (int m = 0; m < MB; m++)                                                       \
            for (int j = 0; j < 4; j++) acc[m][j] = _mm256_setzero_ps();                   \
        int64_t k = 0;                                                                     \
        const float *pf = w + 4 * ws; /* the next block's rows: streamed from memory */     \
        for (; k + 8 <= K; k += 8) {                                                       \
            if (prefetch && (k & 15) == 0) {                                               \
                _mm_prefetch((const char *)(pf + k), _MM_HINT_T0);                         \
                _mm_prefetch((const char *)(pf + ws + k), _MM_HINT_T0);                    \
                _mm_prefetch((const char *)(pf + 2 * ws + k), _MM_HINT_T0);                \
                _mm_prefetch((const char *)(pf + 3 * ws + k), _MM_HINT_T0);                \
            }                                                                              \
            __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + ws + k);          \
            __m256 w2 = _mm256_loadu_ps(w + 2 * ws + k), w3 = _mm256_loadu_ps(w + 3 * ws + k); \
            for (int m = 0; m < MB; m++) {                                                 \
                __m256 a = _mm256_loadu_ps(x + m * xs + k);                                \
                acc[m][0] = _mm256_fmadd_ps(a, w0, acc[m][0]);                             \
                acc[m][1] = _mm256_fmadd_ps(a, w1, acc[m][1]);                             \
                acc[m][2] = _mm256_fmadd_ps(a, w2, acc[m][2]);                             \
                acc[m][3] = _mm256_fmadd_ps(a, w3, acc[m][3]);                             \
            }                                                                              \
        }                                                                                  \
        for (int m = 0; m < MB; m++)                                                       \
            for (int j = 0; j < 4; j++) {                                                  \
                float r = hsum8(acc[m][j]);                                                \
                for (int64_t t = k; t < K; t++)                                            \
                    r = fmaf(x[m * xs + t], w[j * ws + t], r);                             \
                out[m * os + j] = r;                                                       \
            }                                                                              \
    }
LIN_BLOCK(1) LIN_BLOCK(2) LIN_BLOCK(3)

static void lin4(const float *x, int64_t xs, const float *w, int64_t ws, float *out,
                 int64_t os, int64_t K, int64_t mb, int prefetch) {
    switch (mb) {
    case 1: lin4_1(x, xs, w, ws, out, os, K, prefetch); break;
    case 2: lin4_2(x, xs, w, ws, out, os, K, prefetch); break;
    default: lin4_3(x, xs, w, ws, out, os, K, prefetch); break;
    }
}
#define LIN_ROWS 3
#define LIN_COLS 4
#endif

static float lin_one(const float *x, const float *w, int64_t K) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), acc);
    float r = hsum8(acc);
#else
    int64_t k = 0;
    float r = 0.0f;
#endif
    for (; k < K; k++)
        r = fmaf(x[k], w[k], r);
    return r;
}

void ms_linear_f32(const float *x, int64_t xs, const float *w, int64_t ws, float *out,
                   int64_t os, int64_t M, int64_t K, int64_t N) {
    int64_t n0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; n0 + LIN_COLS <= N; n0 += LIN_COLS)
        for (int64_t m0 = 0; m0 < M; m0 += LIN_ROWS) {
            int64_t mb = M - m0 < LIN_ROWS ? M - m0 : LIN_ROWS;
            /* The first pass over a block of weight rows asks for the next block (the
             * other passes find this one in L1); none past the weight's end. */
            int prefetch = m0 == 0 && n0 + 2 * LIN_COLS <= N;
            lin4(x + m0 * xs, xs, w + n0 * ws, ws, out + m0 * os + n0, os, K, mb, prefetch);
        }
#endif
    for (; n0 < N; n0++) /* weight rows left over, one at a time */
        for (int64_t m = 0; m < M; m++)
            out[m * os + n0] = lin_one(x + m * xs, w + n0 * ws, K);
}

/* ---- The same with the weight stored column-major: out[M, N] = x[M, K] @ wt[K, N] ----
 *
 * wt is the weight's transpose, row-major (the runtime keeps wide weights so: the PyTorch
 * GEMV of a single row runs faster on it). The weight is read in memory order: for a chunk
 * of LINT_CHUNK columns, each wt row's segment (contiguous) in turn, four rows at a time,
 * accumulated into the M output rows' chunk (L1/L2). Walking down a column panel instead
 * (one cache line per row) is faster when the weight is in cache and several times slower
 * when it streams from memory, as a model's weights do. Each output is one FMA chain over
 * k in order, independent of M and of the other rows.
 */
#define LINT_CHUNK 2048

#if defined(__AVX2__) && defined(__FMA__)
/* One k group (four wt rows from w0) into the chunk's first n8 columns (a multiple of 8)
 * of output row o, or of rows o and o + os (TWO): the weight vectors loaded once serve
 * both rows. `pf`, if given, is the next k group's chunk, asked for a cache line at a time. */
#define LINT_ROWS(NAME, TWO)                                                                \
    static void NAME(const float *xm, int64_t xs, float *o, int64_t os, const float *w0,  \
                     int64_t ws, int64_t n8, const float *pf) {                            \
        const float *w1 = w0 + ws, *w2 = w1 + ws, *w3 = w2 + ws;                            \
        __m256 a0 = _mm256_broadcast_ss(xm), a1 = _mm256_broadcast_ss(xm + 1);              \
        __m256 a2 = _mm256_broadcast_ss(xm + 2), a3 = _mm256_broadcast_ss(xm + 3);          \
        __m256 c0 = a0, c1 = a1, c2 = a2, c3 = a3;                                          \
        if (TWO) {                                                                          \
            c0 = _mm256_broadcast_ss(xm + xs), c1 = _mm256_broadcast_ss(xm + xs + 1);       \
            c2 = _mm256_broadcast_ss(xm + xs + 2), c3 = _mm256_broadcast_ss(xm + xs + 3);   \
        }                                                                                   \
        for (int64_t n = 0; n < n8; n += 8) {                                               \
            if (pf != NULL && (n & 15) == 0) {                                              \
                _mm_prefetch((const char *)(pf + n), _MM_HINT_T0);                          \
                _mm_prefetch((const char *)(pf + ws + n), _MM_HINT_T0);                     \
                _mm_prefetch((const char *)(pf + 2 * ws + n), _MM_HINT_T0);                 \
                _mm_prefetch((const char *)(pf + 3 * ws + n), _MM_HINT_T0);                 \
            }                                                                               \
            __m256 v0 = _mm256_loadu_ps(w0 + n), v1 = _mm256_loadu_ps(w1 + n);              \
            __m256 v2 = _mm256_loadu_ps(w2 + n), v3 = _mm256_loadu_ps(w3 + n);              \
            __m256 acc = _mm256_loadu_ps(o + n);                                            \
            acc = _mm256_fmadd_ps(a0, v0, acc);                                             \
            acc = _mm256_fmadd_ps(a1, v1, acc);                                             \
            acc = _mm256_fmadd_ps(a2, v2, acc);                                             \
            acc = _mm256_fmadd_ps(a3, v3, acc);                                             \
            _mm256_storeu_ps(o + n, acc);                                                   \
            if (TWO) {                                                                      \
                __m256 acc2 = _mm256_loadu_ps(o + os + n);                                  \
                acc2 = _mm256_fmadd_ps(c0, v0, acc2);                                       \
                acc2 = _mm256_fmadd_ps(c1, v1, acc2);                                       \
                acc2 = _mm256_fmadd_ps(c2, v2, acc2);                                       \
                acc2 = _mm256_fmadd_ps(c3, v3, acc2);                                       \
                _mm256_storeu_ps(o + os + n, acc2);                                         \
            }                                                                               \
        }                                                                                   \
    }
LINT_ROWS(lint_one_row, 0)
LINT_ROWS(lint_two_rows, 1)
#endif

void ms_linear_t_f32(const float *x, int64_t xs, const float *wt, int64_t ws, float *out,
                     int64_t os, int64_t M, int64_t K, int64_t N) {
    for (int64_t n0 = 0; n0 < N; n0 += LINT_CHUNK) {
        int64_t nc = N - n0 < LINT_CHUNK ? N - n0 : LINT_CHUNK;
        for (int64_t m = 0; m < M; m++)
            memset(out + m * os + n0, 0, (size_t)nc * sizeof(float));
        int64_t n8 = 0;
#if defined(__AVX2__) && defined(__FMA__)
        n8 = nc & ~(int64_t)7;
#endif
        int64_t k = 0;
        for (; k + 4 <= K; k += 4) {
            const float *w0 = wt + k * ws + n0, *w1 = w0 + ws, *w2 = w1 + ws, *w3 = w2 + ws;
#if defined(__AVX2__) && defined(__FMA__)
            /* The first pass asks for the next k group's chunk (the other passes find this
             * one in L1/L2); none past the weight's end. */
            const float *pf = k + 8 <= K ? w0 + 4 * ws : NULL;
            int64_t m = 0;
            for (; m + 2 <= M; m += 2, pf = NULL)
                lint_two_rows(x + m * xs + k, xs, out + m * os + n0, os, w0, ws, n8, pf);
            if (m < M)
                lint_one_row(x + m * xs + k, xs, out + m * os + n0, os, w0, ws, n8, pf);
#endif
            for (int64_t m = 0; m < M; m++) { /* the columns past n8, in order */
                const float *xm = x + m * xs + k;
                float *o = out + m * os + n0;
                for (int64_t n = n8; n < nc; n++) {
                    float acc = o[n];
                    acc = fmaf(xm[0], w0[n], acc);
                    acc = fmaf(xm[1], w1[n], acc);
                    acc = fmaf(xm[2], w2[n], acc);
                    acc = fmaf(xm[3], w3[n], acc);
                    o[n] = acc;
                }
            }
        }
        for (; k < K; k++) {
            const float *w0 = wt + k * ws + n0;
            for (int64_t m = 0; m < M; m++) {
                float b = x[m * xs + k], *o = out + m * os + n0;
                for (int64_t n = 0; n < nc; n++)
                    o[n] = fmaf(b, w0[n], o[n]);
            }
        }
    }
}

/* ---- The same with the weight packed in panels: out[M, N] = x[M, K] @ w[N, K]^T ----
 *
 * Packed (ms_pack_f32): panel p holds columns [p * PANEL, (p + 1) * PANEL) of the output,
 * as K rows of PANEL floats (zero past N), so a panel is one contiguous stream. A
 * micro-kernel keeps a tile of up to 4 rows x PANEL outputs in 12 registers while it walks
 * down the panel: three weight loads and one broadcast per row feed twelve FMAs, where
 * the unpacked kernels load and store their accumulators (MKL packs the weight on every
 * call instead). The panel stays in L2 for the next rows of x. Five rows left take one
 * tile of 15 accumulators where AVX-512VL gives 32 registers (else three and two), never
 * a lone row's three FMA chains, which wait on the FMA latency. One row alone streams
 * four panels at once (four memory streams), two rows two or four. Tiles ask for no
 * prefetches: the hardware follows a panel, and at three or four rows a software
 * prefetch per k cost 10% (on a 2-core EPYC VM). Each output is one FMA chain over k in
 * order, so a row's result does not depend on M or on the other rows.
 */
#define PANEL 24

void ms_pack_f32(const float *w, int64_t ws_n, int64_t ws_k, float *p, int64_t N, int64_t K) {
    int64_t panels = (N + PANEL - 1) / PANEL;
    for (int64_t q = 0; q < panels; q++) {
        float *panel = p + q * K * PANEL;
        if (ws_k == 1) /* row-major: read each weight row in order, write down the panel */
            for (int64_t j = 0; j < PANEL; j++) {
                int64_t n = q * PANEL + j;
                for (int64_t k = 0; k < K; k++)
                    panel[k * PANEL + j] = n < N ? w[n * ws_n + k] : 0.0f;
            }
        else /* column-major (or any other): write the panel in order */
            for (int64_t k = 0; k < K; k++)
                for (int64_t j = 0; j < PANEL; j++) {
                    int64_t n = q * PANEL + j;
                    panel[k * PANEL + j] = n < N ? w[n * ws_n + k * ws_k] : 0.0f;
                }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#define PK_ROW(r)                                                                          \
    if (rows > r) {                                                                        \
        const __m256 a = _mm256_broadcast_ss(x + r * xs + k);                              \
        c##r##0 = _mm256_fmadd_ps(a, w0, c##r##0);                                         \
        c##r##1 = _mm256_fmadd_ps(a, w1, c##r##1);                                         \
        c##r##2 = _mm256_fmadd_ps(a, w2, c##r##2);                                         \
    }
#define PK_OUT(r)                                                                          \
    if (rows > r) {                                                                        \
        float *dst = ncols == PANEL ? o + r * os : tmp;                                    \
        _mm256_storeu_ps(dst, c##r##0);                                                    \
        _mm256_storeu_ps(dst + 8, c##r##1);                                                \
        _mm256_storeu_ps(dst + 16, c##r##2);                                               \
        if (ncols != PANEL)                                                                \
            memcpy(o + r * os, tmp, (size_t)ncols * sizeof(float));                        \
    }
/* `ROWS` (1-5) rows of x against one panel, into the first `ncols` columns of o. */
#define PK_TILE(NAME, ROWS)                                                                \
    static void NAME(const float *x, int64_t xs, const float *panel, int64_t K, float *o,  \
                     int64_t os, int64_t ncols) {                                          \
        const int rows = ROWS;                                                             \
        const __m256 z = _mm256_setzero_ps();                                              \
        __m256 c00 = z, c01 = z, c02 = z, c10 = z, c11 = z, c12 = z;                        \
        __m256 c20 = z, c21 = z, c22 = z, c30 = z, c31 = z, c32 = z;                        \
        __m256 c40 = z, c41 = z, c42 = z;                                                  \
        float tmp[PANEL];                                                                  \
        for (int64_t k = 0; k < K; k++) {                                                  \
            const float *w = panel + k * PANEL;                                            \
            const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);             \
            const __m256 w2 = _mm256_loadu_ps(w + 16);                                     \
            PK_ROW(0) PK_ROW(1) PK_ROW(2) PK_ROW(3) PK_ROW(4)                              \
        }                                                                                  \
        PK_OUT(0) PK_OUT(1) PK_OUT(2) PK_OUT(3) PK_OUT(4)                                  \
        (void)tmp;                                                                         \
    }
PK_TILE(pk_tile1, 1)
PK_TILE(pk_tile2, 2)
PK_TILE(pk_tile3, 3)
PK_TILE(pk_tile4, 4)
#if defined(__AVX512VL__)
PK_TILE(pk_tile5, 5) /* 15 accumulators: only where EVEX gives 32 registers */
#endif

/* ROWS rows of x against NP consecutive full panels from q0, the panels streamed at once
 * (one stream does not saturate memory). Each output is the same FMA chain as in the
 * tiles. The accumulators, ROWS x NP x 3, must fit the registers. */
#define PK_PANELS(NAME, ROWS, NP)                                                          \
    static void NAME(const float *x, int64_t xs, const float *q0, int64_t K, float *o,     \
                     int64_t os) {                                                         \
        __m256 acc[ROWS][NP][3];                                                           \
        for (int r = 0; r < ROWS; r++)                                                     \
            for (int p = 0; p < NP; p++)                                                   \
                for (int j = 0; j < 3; j++) acc[r][p][j] = _mm256_setzero_ps();            \
        for (int64_t k = 0; k < K; k++) {                                                  \
            __m256 w[NP][3];                                                               \
            for (int p = 0; p < NP; p++)                                                   \
                for (int j = 0; j < 3; j++)                                                \
                    w[p][j] = _mm256_loadu_ps(q0 + (p * K + k) * PANEL + 8 * j);           \
            for (int r = 0; r < ROWS; r++) {                                               \
                const __m256 a = _mm256_broadcast_ss(x + r * xs + k);                      \
                for (int p = 0; p < NP; p++)                                               \
                    for (int j = 0; j < 3; j++)                                            \
                        acc[r][p][j] = _mm256_fmadd_ps(a, w[p][j], acc[r][p][j]);          \
            }                                                                              \
        }                                                                                  \
        for (int r = 0; r < ROWS; r++)                                                     \
            for (int p = 0; p < NP; p++)                                                   \
                for (int j = 0; j < 3; j++)                                                \
                    _mm256_storeu_ps(o + r * os + p * PANEL + 8 * j, acc[r][p][j]);        \
    }
#if defined(__AVX512VL__)
#define TWO_ROW_PANELS 4 /* 24 accumulators of 32 registers */
#else
#define TWO_ROW_PANELS 2 /* 12 of 16 */
#endif
PK_PANELS(pk_one_row, 1, 4)
PK_PANELS(pk_two_rows, 2, TWO_ROW_PANELS)

/* One tile call of `rows` rows (1-5) on a panel. */
INLINE void pk_tile(int rows, const float *x, int64_t xs, const float *panel, int64_t K,
                    float *o, int64_t os, int64_t ncols) {
    switch (rows) {
    case 1: pk_tile1(x, xs, panel, K, o, os, ncols); break;
    case 2: pk_tile2(x, xs, panel, K, o, os, ncols); break;
    case 3: pk_tile3(x, xs, panel, K, o, os, ncols); break;
    case 4: pk_tile4(x, xs, panel, K, o, os, ncols); break;
#if defined(__AVX512VL__)
    case 5: pk_tile5(x, xs, panel, K, o, os, ncols); break;
#endif
    }
}
#endif

void ms_linear_packed_f32(const float *x, int64_t xs, const float *p, float *out, int64_t os,
                          int64_t M, int64_t K, int64_t N) {
    int64_t panels = (N + PANEL - 1) / PANEL, q = 0;
#define PANEL_AT(i) (p + (i) * K * PANEL)
#if defined(__AVX2__) && defined(__FMA__)
    /* One or two rows (decode) stream several panels at once; the tiles take the rest. */
    if (M == 1)
        for (; q + 4 <= panels && (q + 4) * PANEL <= N; q += 4)
            pk_one_row(x, xs, PANEL_AT(q), K, out + q * PANEL, os);
    if (M == 2)
        for (; q + TWO_ROW_PANELS <= panels && (q + TWO_ROW_PANELS) * PANEL <= N;
             q += TWO_ROW_PANELS)
            pk_two_rows(x, xs, PANEL_AT(q), K, out + q * PANEL, os);
    for (; q < panels; q++) {
        const float *panel = PANEL_AT(q);
        int64_t ncols = N - q * PANEL < PANEL ? N - q * PANEL : PANEL;
        float *o = out + q * PANEL;
        int64_t m = 0;
        for (; M - m >= 4 && M - m != 5; m += 4)
            pk_tile(4, x + m * xs, xs, panel, K, o + m * os, os, ncols);
        const int64_t rest = M - m; /* 0-3, or 5: never a lone row after a tile */
        const float *xm = x + m * xs;
        float *om = o + m * os;
        if (rest == 5) {
#if defined(__AVX512VL__)
            pk_tile(5, xm, xs, panel, K, om, os, ncols);
#else
            pk_tile(3, xm, xs, panel, K, om, os, ncols);
            pk_tile(2, xm + 3 * xs, xs, panel, K, om + 3 * os, os, ncols);
#endif
        } else if (rest > 0) {
            pk_tile((int)rest, xm, xs, panel, K, om, os, ncols);
        }
    }
#else
    for (; q < panels; q++)
        for (int64_t j = 0; j < PANEL && q * PANEL + j < N; j++)
            for (int64_t m = 0; m < M; m++) {
                float acc = 0.0f;
                for (int64_t k = 0; k < K; k++)
                    acc = fmaf(x[m * xs + k], p[(q * K + k) * PANEL + j], acc);
                out[m * os + q * PANEL + j] = acc;
            }
#endif
#undef PANEL_AT
}

void ms_unpack_rows_f32(const float *p, int64_t K, const int64_t *ids, int64_t T, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *src = p + (ids[t] / PANEL) * K * PANEL + ids[t] % PANEL;
        float *dst = out + t * K;
        for (int64_t k = 0; k < K; k++) dst[k] = src[k * PANEL];
    }
}

/* ---- Greedy sampling: out[r] = argmax of row r of x[rows, cols] (row stride xs) ----
 *
 * As torch.argmax: the first index of the largest value, and a NaN counts as larger than
 * anything (the first NaN wins). Two passes over the row, both vectorized: its largest
 * value (and whether it holds a NaN), then where that value first occurs.
 */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t i = 0;
    float m = x[0];
    int nan = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (n >= 8) {
        __m256 mv = _mm256_loadu_ps(x), nv = _mm256_cmp_ps(mv, mv, _CMP_UNORD_Q);
        for (i = 8; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            mv = _mm256_max_ps(mv, v);
            nv = _mm256_or_ps(nv, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        m = lanes[0];
        for (int l = 1; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
        nan = _mm256_movemask_ps(nv) != 0;
    }
#endif
    for (; i < n; i++) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    if (nan) {
        for (i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    }
    i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 target = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target,
                                                          _CMP_EQ_OQ));
        if (mask) return i + __builtin_ctz((unsigned)mask);
    }
#endif
    for (; i < n; i++)
        if (x[i] == m) return i;
    return 0; /* not reached: m is one of the row's values */
}

void ms_argmax_rows_f32(const float *x, int64_t xs, int64_t rows, int64_t cols, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * xs, cols);
}

/* Reads `bytes` (a multiple of 256) from p (64-byte aligned) once, in order, with the
 * widest loads this build has; returns the XOR of its 64-bit words (so nothing is
 * skipped). The
 * single-thread read bandwidth a decode step's weight streaming is measured against
 * (bench/decode_bandwidth.py). */
uint64_t ms_read_bytes(const void *p, int64_t bytes) {
#if defined(__AVX512F__)
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    const __m512i *v = p;
    for (int64_t i = 0; i < bytes / 64; i += 4) {
        a0 = _mm512_xor_si512(a0, _mm512_load_si512(v + i));
        a1 = _mm512_xor_si512(a1, _mm512_load_si512(v + i + 1));
        a2 = _mm512_xor_si512(a2, _mm512_load_si512(v + i + 2));
        a3 = _mm512_xor_si512(a3, _mm512_load_si512(v + i + 3));
    }
    a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    uint64_t lanes[8], x = 0;
    memcpy(lanes, &a0, sizeof(lanes));
    for (int i = 0; i < 8; i++) x ^= lanes[i];
    return x;
#elif defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    const __m256i *v = p;
    for (int64_t i = 0; i < bytes / 32; i += 4) {
        a0 = _mm256_xor_si256(a0, _mm256_load_si256(v + i));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256(v + i + 1));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256(v + i + 2));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256(v + i + 3));
    }
    a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    uint64_t lanes[4];
    memcpy(lanes, &a0, sizeof(lanes));
    return lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
#else
    const uint64_t *v = p;
    uint64_t a = 0;
    for (int64_t i = 0; i < bytes / 8; i++) a ^= v[i];
    return a;
#endif
}
