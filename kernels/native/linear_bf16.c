/* Linear layers on bf16 weights: out[M, N] = x[M, K] @ w[N, K]^T, the weight in pair panels.
 *
 * Pair panels (ms_pack_pairs): panel q holds output columns [16 q, 16 q + 16) as K / 2 lines
 * of 16 column pairs, p[q][k / 2][n % 16][k % 2], zeros past N (K even). One 64-byte line is
 * 16 columns times two consecutive k, the unit each of the three kinds of kernel reads, so a
 * bf16 weight is held once, in two bytes a parameter, whatever runs it:
 *  - fp32 activations (decode rows; any CPU with AVX2): a line is widened in registers (an
 *    even k's value is the 32-bit lane shifted up 16 bits, an odd k's the lane masked), then
 *    fp32 FMAs. Every output is one FMA chain over k in order, so a row's result does not
 *    depend on M or on the other rows.
 *  - bf16 activations on AMX: a panel's 16 lines from k = 32 i are a B tile as they lie
 *    (TDPBF16PS); blocks of 2 x 2 tiles of 16 x 16 outputs. Rows go by chunks whose
 *    activations stay in L2, panels by groups whose weights do, each 32-row block across
 *    its group (a row's outputs written in 1 KiB runs: a block's 32 rows lie on 32 pages),
 *    and each block's fp32 results are rounded and written halfway through the next
 *    block's products, the vector unit's work beside the tile unit's.
 *  - bf16 activations with AVX512_BF16 and no AMX: a line is one VDPBF16PS operand against
 *    a broadcast pair of x.
 * The bf16-activation kernels sum in fp32 and add the bias in fp32 before the output is
 * rounded (to bf16 where asked).
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
#define COLS 16 /* columns per pair panel */

void ms_pack_pairs(const float *w, int64_t ws_n, int64_t ws_k, uint16_t *p, int64_t N,
                   int64_t K) {
    const int64_t panels = (N + COLS - 1) / COLS;
    for (int64_t q = 0; q < panels; q++)
        for (int64_t j = 0; j < COLS; j++) {
            const int64_t n = q * COLS + j;
            uint16_t *dst = p + q * K * COLS + 2 * j;
            for (int64_t k = 0; k < K; k++)
                dst[(k / 2) * 2 * COLS + k % 2] = n < N ? bf16_round(w[n * ws_n + k * ws_k]) : 0;
        }
}

void ms_unpack_rows_pairs(const uint16_t *p, int64_t K, const int64_t *ids, int64_t T,
                          float *out) {
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *src = p + (ids[t] / COLS) * K * COLS + 2 * (ids[t] % COLS);
        for (int64_t k = 0; k < K; k++)
            out[t * K + k] = widen_at(src, (k / 2) * 2 * COLS + k % 2, 1);
    }
}

/* ---- fp32 activations: lines widened in registers ---- */
#if defined(__AVX512F__)
#include <immintrin.h>
#define WV 1 /* vectors per line */
typedef __m512 vf;
typedef __m512i vi;
#define LOADI(p) _mm512_loadu_si512(p)
#define EVEN(w) _mm512_castsi512_ps(_mm512_slli_epi32(w, 16))
#define ODD(w) _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)))
#define SET1(x) _mm512_set1_ps(x)
#define ZERO() _mm512_setzero_ps()
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define STORE(p, v) _mm512_storeu_ps(p, v)
#define MAX_NP 4
#define MAX_R 4
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define WV 2
typedef __m256 vf;
typedef __m256i vi;
#define LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define EVEN(w) _mm256_castsi256_ps(_mm256_slli_epi32(w, 16))
#define ODD(w) _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)))
#define SET1(x) _mm256_set1_ps(x)
#define ZERO() _mm256_setzero_ps()
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define STORE(p, v) _mm256_storeu_ps(p, v)
#define MAX_NP 2
#define MAX_R 2
#endif

#if defined(WV)
#define LANES (COLS / WV) /* fp32 lanes per vector */

/* R rows of x against NP consecutive panels from p0 (pstride elements apart), into o's
 * first `ncols` columns from the panels' first. */
static inline __attribute__((always_inline)) void widen_tile(
    const float *x, int64_t xs, const uint16_t *p0, int64_t pstride, int64_t K, float *o,
    int64_t os, int64_t ncols, const int R, const int NP) {
    vf acc[MAX_R][MAX_NP][WV]; /* fixed sizes (a VLA would live in memory) */
    for (int r = 0; r < R; r++)
        for (int q = 0; q < NP; q++)
            for (int v = 0; v < WV; v++) acc[r][q][v] = ZERO();
    for (int64_t k = 0; k < K; k += 2) {
        vf even[MAX_NP][WV], odd[MAX_NP][WV];
        for (int q = 0; q < NP; q++)
            for (int v = 0; v < WV; v++) {
                const vi w = LOADI(p0 + q * pstride + k * COLS + v * 2 * LANES);
                even[q][v] = EVEN(w);
                odd[q][v] = ODD(w);
            }
        for (int r = 0; r < R; r++) {
            const vf a = SET1(x[r * xs + k]), b = SET1(x[r * xs + k + 1]);
            for (int q = 0; q < NP; q++)
                for (int v = 0; v < WV; v++) {
                    acc[r][q][v] = FMA(a, even[q][v], acc[r][q][v]);
                    acc[r][q][v] = FMA(b, odd[q][v], acc[r][q][v]);
                }
        }
    }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < NP; q++) {
            float tmp[COLS];
            const int64_t cols = ncols - q * COLS < COLS ? ncols - q * COLS : COLS;
            float *dst = cols == COLS ? o + r * os + q * COLS : tmp;
            for (int v = 0; v < WV; v++) STORE(dst + v * LANES, acc[r][q][v]);
            if (cols != COLS) memcpy(o + r * os + q * COLS, tmp, sizeof(float) * (size_t)cols);
        }
}

#define WIDEN(R, NP)                                                                       \
    static void widen_##R##_##NP(const float *x, int64_t xs, const uint16_t *p0,          \
                                 int64_t pstride, int64_t K, float *o, int64_t os,         \
                                 int64_t ncols) {                                          \
        widen_tile(x, xs, p0, pstride, K, o, os, ncols, R, NP);                            \
    }
typedef void (*widen_fn)(const float *, int64_t, const uint16_t *, int64_t, int64_t, float *,
                         int64_t, int64_t);
#if MAX_R == 4
WIDEN(1, 1) WIDEN(1, 2) WIDEN(1, 3) WIDEN(1, 4) WIDEN(2, 1) WIDEN(2, 2) WIDEN(2, 3) WIDEN(2, 4)
WIDEN(3, 1) WIDEN(3, 2) WIDEN(3, 3) WIDEN(3, 4) WIDEN(4, 1) WIDEN(4, 2) WIDEN(4, 3) WIDEN(4, 4)
static const widen_fn WIDEN_TILES[MAX_R][MAX_NP] = {
    {widen_1_1, widen_1_2, widen_1_3, widen_1_4}, {widen_2_1, widen_2_2, widen_2_3, widen_2_4},
    {widen_3_1, widen_3_2, widen_3_3, widen_3_4}, {widen_4_1, widen_4_2, widen_4_3, widen_4_4}};
#else
WIDEN(1, 1) WIDEN(1, 2) WIDEN(2, 1) WIDEN(2, 2)
static const widen_fn WIDEN_TILES[MAX_R][MAX_NP] = {{widen_1_1, widen_1_2},
                                                    {widen_2_1, widen_2_2}};
#endif
#endif

/* fp32 x [M, K] (row stride xs) against the pair panels p of N columns, into out (row
 * stride os). The panels go by groups of MAX_NP (one memory stream each), every row of x
 * by tiles of MAX_R against a group while it is in cache. */
void ms_linear_pairs_f32(const float *x, int64_t xs, const uint16_t *p, float *out, int64_t os,
                         int64_t M, int64_t K, int64_t N) {
    const int64_t panels = (N + COLS - 1) / COLS, pstride = K * COLS;
#if defined(WV)
    for (int64_t q = 0; q < panels; q += MAX_NP) {
        const int64_t np = panels - q < MAX_NP ? panels - q : MAX_NP;
        for (int64_t m = 0; m < M; m += MAX_R) {
            const int64_t r = M - m < MAX_R ? M - m : MAX_R;
            WIDEN_TILES[r - 1][np - 1](x + m * xs, xs, p + q * pstride, pstride, K,
                                       out + m * os + q * COLS, os, N - q * COLS);
        }
    }
#else
    (void)panels;
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *col = p + (n / COLS) * pstride + 2 * (n % COLS);
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++)
                acc = fmaf(x[m * xs + k], widen_at(col, (k / 2) * 2 * COLS + k % 2, 1), acc);
            out[m * os + n] = acc;
        }
    }
#endif
}

/* ---- bf16 activations: AMX tiles, or VDPBF16PS ---- */
#if defined(__AVX512BF16__)
/* Rows [0, rows) and columns [0, cols) of the fp32 block c (row stride cs) plus the bias
 * (fp32, from this block's first column; NULL for none) into out, rounded to bf16 where
 * out_bf16. */
static void write_block(const float *c, int64_t cs, int64_t rows, int64_t cols,
                        const float *bias, void *out, int64_t os, int out_bf16) {
    if (cols == 32) { /* a whole block: unmasked loads and stores */
        const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
        const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; r++) {
            const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(c + r * cs), b0);
            const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(c + r * cs + 16), b1);
            if (out_bf16) {
                _mm512_storeu_si512((uint16_t *)out + r * os,
                                    (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            } else {
                _mm512_storeu_ps((float *)out + r * os, lo);
                _mm512_storeu_ps((float *)out + r * os + 16, hi);
            }
        }
        return;
    }
    for (int64_t j = 0; j < cols; j += 16) {
        const __mmask16 live = (__mmask16)(cols - j >= 16 ? 0xFFFF : (1u << (cols - j)) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(live, bias + j) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; r++) {
            const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(live, c + r * cs + j), b);
            if (out_bf16)
                _mm256_mask_storeu_epi16((uint16_t *)out + r * os + j, live,
                                         (__m256i)_mm512_cvtneps_pbh(v));
            else
                _mm512_mask_storeu_ps((float *)out + r * os + j, live, v);
        }
    }
}

/* SwiGLU of a block: c's rows hold 16 gate columns then their 16 up columns (fp32, row
 * stride cs); out[r][j] = silu(gate + bias) * (up + bias') for the first `cols` (bias: the
 * gate's, the up's `up` columns on; NULL for none), rounded once. */
static void write_swiglu(const float *c, int64_t cs, int64_t rows, int64_t cols,
                         const float *bias, int64_t up, void *out, int64_t os, int out_bf16) {
    const __mmask16 live = (__mmask16)(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
    const __m512 bg = bias ? _mm512_maskz_loadu_ps(live, bias) : _mm512_setzero_ps();
    const __m512 bu = bias ? _mm512_maskz_loadu_ps(live, bias + up) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const __m512 g = _mm512_add_ps(_mm512_loadu_ps(c + r * cs), bg);
        const __m512 v = _mm512_mul_ps(silu16(g), _mm512_add_ps(_mm512_loadu_ps(c + r * cs + 16),
                                                                bu));
        if (out_bf16)
            _mm256_mask_storeu_epi16((uint16_t *)out + r * os, live,
                                     (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_mask_storeu_ps((float *)out + r * os, live, v);
    }
}

/* R rows of bf16 x against NP panels (VDPBF16PS) into c [R][NP * COLS] (fp32). */
static inline __attribute__((always_inline)) void dot_tile(
    const uint16_t *x, int64_t xs, const uint16_t *p0, int64_t pstride, int64_t K, float *c,
    const int R, const int NP) {
    __m512 acc[8][2]; /* R <= 8, NP <= 2: fixed sizes (a VLA would live in memory) */
    for (int r = 0; r < R; r++)
        for (int q = 0; q < NP; q++) acc[r][q] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        __m512bh w[2];
        for (int q = 0; q < NP; q++)
            w[q] = (__m512bh)_mm512_loadu_si512(p0 + q * pstride + k * COLS);
        for (int r = 0; r < R; r++) {
            const __m512bh a = pair_bcast(x + r * xs + k);
            for (int q = 0; q < NP; q++) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], w[q], a);
        }
    }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < NP; q++) _mm512_storeu_ps(c + r * NP * COLS + q * COLS, acc[r][q]);
}

#define DOT(R, NP)                                                                         \
    static void dot_##R##_##NP(const uint16_t *x, int64_t xs, const uint16_t *p0,         \
                               int64_t pstride, int64_t K, float *c) {                     \
        dot_tile(x, xs, p0, pstride, K, c, R, NP);                                         \
    }
DOT(8, 2) DOT(4, 2) DOT(1, 2) DOT(8, 1) DOT(4, 1) DOT(1, 1)

/* The VDPBF16PS kernel over panels of N columns, or with `up` > 0 SwiGLU's: N gate
 * columns, each gate panel paired with the up panel `up` panels on (write_swiglu). */
static void linear_dot(const uint16_t *x, int64_t xs, const uint16_t *p, int64_t K, int64_t N,
                       void *out, int64_t os, int out_bf16, const float *bias, int64_t M,
                       int64_t up) {
    const int64_t panels = (N + COLS - 1) / COLS, pstride = K * COLS;
    const int64_t second = up ? up * pstride : pstride; /* the block's second panel */
    const size_t elem = out_bf16 ? 2 : 4;
    float c[8 * 2 * COLS];
    for (int64_t q = 0; q < panels; q += up ? 1 : 2) {
        const int two = up || q + 1 < panels;
        const int64_t cols = N - q * COLS < 2 * COLS ? N - q * COLS : 2 * COLS;
        for (int64_t m = 0; m < M;) {
            const int64_t r = M - m >= 8 ? 8 : M - m >= 4 ? 4 : 1;
            const uint16_t *xm = x + m * xs, *pq = p + q * pstride;
            if (two) {
                if (r == 8) dot_8_2(xm, xs, pq, second, K, c);
                else if (r == 4) dot_4_2(xm, xs, pq, second, K, c);
                else dot_1_2(xm, xs, pq, second, K, c);
            } else {
                if (r == 8) dot_8_1(xm, xs, pq, pstride, K, c);
                else if (r == 4) dot_4_1(xm, xs, pq, pstride, K, c);
                else dot_1_1(xm, xs, pq, pstride, K, c);
            }
            char *o = (char *)out + (size_t)(m * os + q * COLS) * elem;
            if (up)
                write_swiglu(c, 2 * COLS, r, cols, bias ? bias + q * COLS : NULL, up * COLS, o,
                             os, out_bf16);
            else
                write_block(c, (two ? 2 : 1) * COLS, r, cols, bias ? bias + q * COLS : NULL, o,
                            os, out_bf16);
            m += r;
        }
    }
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define CHUNK_BYTES (512 * 1024) /* activations per row chunk: stay in L2 over the panels */
#define GROUP_PANELS 32 /* panels whose weights stay in L2 over a chunk's rows */
#define PREFETCH_BLOCKS 2 /* how many blocks ahead a chunk's first row block asks for panels */

int ms_amx_permitted(void) {
    static int state; /* 0 not asked, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_RELAXED);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELAXED);
    }
    return s > 0;
}

/* A finished block waiting in its fp32 scratch for write_block. */
typedef struct {
    const float *c, *bias;
    int64_t rows, cols, up; /* up > 0: a SwiGLU block (write_swiglu) */
    char *out;
} Done;

static inline void write_done(const Done *d, int64_t os, int out_bf16) {
    if (d->up)
        write_swiglu(d->c, 32, d->rows, d->cols, d->bias, d->up * COLS, d->out, os, out_bf16);
    else
        write_block(d->c, 32, d->rows, d->cols, d->bias, d->out, os, out_bf16);
}

static inline __attribute__((always_inline)) void amx_steps(
    const uint16_t *a0, const uint16_t *a1, int64_t as0, int64_t as1, const uint16_t *b0,
    const uint16_t *b1, const char *n0, const char *n1, int64_t k0, int64_t k1, const int low,
    const int two) {
    for (int64_t k = k0; k < k1; k += 32) {
        if (n0) /* a later block's panels into L2, the lines of this k step (1 KiB each) */
            for (int i = 0; i < 1024; i += 64) {
                _mm_prefetch(n0 + k * 2 * COLS + i, _MM_HINT_T1);
                _mm_prefetch(n1 + k * 2 * COLS + i, _MM_HINT_T1);
            }
        _tile_loadd(4, a0 + k, as0);
        _tile_loadd(6, b0 + k * COLS, 2 * 2 * COLS);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
            _tile_loadd(7, b1 + k * COLS, 2 * 2 * COLS);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (low) {
            _tile_loadd(5, a1 + k, as1);
            _tile_dpbf16ps(2, 5, 6);
            if (two) _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* The 16 x 32 block of outputs of rows a0 (and a1 below it where `low`) against panel b0
 * (and b1 beside it where `two`), over K; tiles 0-3 the outputs, 4-5 the rows, 6-7 the
 * panels. Stored into c [32][32]. Halfway through K the previous block `done` (if any) is
 * written out, its vector work overlapping the tile unit's. */
static inline __attribute__((always_inline)) void amx_block(
    const uint16_t *a0, const uint16_t *a1, int64_t as0, int64_t as1, const uint16_t *b0,
    const uint16_t *b1, const char *n0, const char *n1, int64_t K, float *c, Done *done,
    int64_t os, int out_bf16, const int low, const int two) {
    _tile_zero(0);
    if (two) _tile_zero(1);
    if (low) _tile_zero(2);
    if (low && two) _tile_zero(3);
    const int64_t half = K / 64 * 32;
    amx_steps(a0, a1, as0, as1, b0, b1, n0, n1, 0, half, low, two);
    if (done->c) {
        write_done(done, os, out_bf16);
        done->c = NULL;
    }
    amx_steps(a0, a1, as0, as1, b0, b1, n0, n1, half, K, low, two);
    _tile_stored(0, c, 32 * 4);
    if (two) _tile_stored(1, c + 16, 32 * 4);
    if (low) _tile_stored(2, c + 16 * 32, 32 * 4);
    if (low && two) _tile_stored(3, c + 16 * 32 + 16, 32 * 4);
}

/* Rows [m0, m0 + 16) of x, or of `tail` (the last M % 16 rows, zero-padded) past M / 16 * 16. */
static inline const uint16_t *rows_at(const uint16_t *x, int64_t xs, const uint16_t *tail,
                                      int64_t K, int64_t M, int64_t m0, int64_t *stride) {
    if (m0 + 16 <= M) {
        *stride = xs * 2;
        return x + m0 * xs;
    }
    *stride = K * 2;
    return tail;
}

static int linear_amx(const uint16_t *x, int64_t xs, const uint16_t *p, int64_t K, int64_t N,
                      void *out, int64_t os, int out_bf16, const float *bias, int64_t M,
                      int64_t up) {
    if (K % 32 != 0 || !ms_amx_permitted()) return MS_UNSUPPORTED;
    const int64_t panels = (N + COLS - 1) / COLS, pstride = K * COLS, rest = M % 16;
    const size_t elem = out_bf16 ? 2 : 4;
    uint16_t *tail = NULL;
    if (rest) {
        tail = calloc((size_t)(16 * K), sizeof(uint16_t));
        if (tail == NULL) return MS_NO_MEMORY;
        for (int64_t r = 0; r < rest; r++)
            memcpy(tail + r * K, x + (M - rest + r) * xs, sizeof(uint16_t) * (size_t)K);
    }
    amx_configure();
    float scratch[2][32 * 32] __attribute__((aligned(64))); /* a block, and the one before */
    int flip = 0;
    Done done = {NULL, NULL, 0, 0, 0, NULL};
    int64_t chunk = CHUNK_BYTES / (2 * K) / 32 * 32;
    if (chunk < 32) chunk = 32;
    for (int64_t mc = 0; mc < M; mc += chunk) {
        const int64_t me = M - mc < chunk ? M : mc + chunk;
        for (int64_t g = 0; g < panels; g += GROUP_PANELS) {
            const int64_t ge = panels - g < GROUP_PANELS ? panels : g + GROUP_PANELS;
            for (int64_t m0 = mc; m0 < me; m0 += 32) {
                const int64_t rows = me - m0 < 32 ? me - m0 : 32;
                int64_t s0, s1 = 0;
                const uint16_t *a0 = rows_at(x, xs, tail, K, M, m0, &s0);
                const uint16_t *a1 = rows > 16 ? rows_at(x, xs, tail, K, M, m0 + 16, &s1) : a0;
                for (int64_t q = g; q < ge; q += up ? 1 : 2) {
                    const int two = up || q + 1 < ge;
                    const int64_t cols = N - q * COLS < 2 * COLS ? N - q * COLS : 2 * COLS;
                    const uint16_t *b0 = p + q * pstride, *b1 = b0 + (up ? up : 1) * pstride;
                    float *c = scratch[flip ^= 1];
                    /* A chunk's first row block meets each panel first: it asks for the
                     * panels PREFETCH_BLOCKS blocks on, into L2 (more misses in flight than
                     * L1's), which it streams from memory: at a few row blocks a pair's
                     * tile products take a third of its memory time, and the hardware
                     * prefetcher does not run far enough ahead */
                    const int64_t qn = q + PREFETCH_BLOCKS * (up ? 1 : 2);
                    const char *n0 = m0 == mc && (up ? qn < panels : qn + 1 < panels)
                                         ? (const char *)(p + qn * pstride) : NULL;
                    const char *n1 = n0 ? (const char *)(p + (qn + (up ? up : 1)) * pstride)
                                        : NULL;
                    if (rows > 16 && two)
                        amx_block(a0, a1, s0, s1, b0, b1, n0, n1, K, c, &done, os, out_bf16, 1, 1);
                    else if (rows > 16)
                        amx_block(a0, a1, s0, s1, b0, b1, n0, n1, K, c, &done, os, out_bf16, 1, 0);
                    else if (two)
                        amx_block(a0, a1, s0, s1, b0, b1, n0, n1, K, c, &done, os, out_bf16, 0, 1);
                    else
                        amx_block(a0, a1, s0, s1, b0, b1, n0, n1, K, c, &done, os, out_bf16, 0, 0);
                    done = (Done){c, bias ? bias + q * COLS : NULL, rows, cols, up,
                                  (char *)out + (size_t)(m0 * os + q * COLS) * elem};
                }
            }
        }
    }
    if (done.c) write_done(&done, os, out_bf16);
    _tile_release();
    free(tail);
    return 0;
}
#define HAVE_AMX 1
#else
int ms_amx_permitted(void) { return 0; }
#define HAVE_AMX 0
#endif
#endif

/* bf16 x [M, K] (row stride xs) against pair panels of N columns, plus the fp32 bias (or
 * NULL), into out [M, N] (row stride os; bf16 where out_bf16, else fp32). With `up` > 0,
 * SwiGLU in the same pass: the panels' first N columns are the gate, each gate panel's up
 * panel lies `up` panels on (a merged gate/up weight: up = I / 16), out [M, N] =
 * silu(gate) * up, the bias (if any) the gate's with the up's `up * 16` columns on (N a
 * multiple of 16). variant: 0 the fastest this CPU has, 1 VDPBF16PS, 2 AMX (K a multiple of
 * 32). MS_UNSUPPORTED where the CPU or this build has not the variant. */
int ms_linear_pairs_bf16(const uint16_t *x, int64_t xs, const uint16_t *p, int64_t K,
                         int64_t N, void *out, int64_t os, int64_t out_bf16, const float *bias,
                         int64_t M, int64_t variant, int64_t up) {
#if defined(__AVX512BF16__)
    if (up && N % COLS != 0) return MS_UNSUPPORTED;
#if HAVE_AMX
    if (variant != 1 && K % 32 == 0 && ms_amx_permitted())
        return linear_amx(x, xs, p, K, N, out, os, (int)out_bf16, bias, M, up);
#endif
    if (variant == 2) return MS_UNSUPPORTED;
    linear_dot(x, xs, p, K, N, out, os, (int)out_bf16, bias, M, up);
    return 0;
#else
    (void)x, (void)xs, (void)p, (void)K, (void)N, (void)out, (void)os, (void)out_bf16;
    (void)bias, (void)M, (void)variant, (void)up;
    return MS_UNSUPPORTED;
#endif
}

#if !defined(__AVX512BF16__)
int ms_amx_permitted(void) { return 0; }
#endif
