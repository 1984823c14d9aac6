/* Work split over threads for the CPU kernels: `ms_pool_run(fn, ctx, parts)` runs
 * fn(ctx, 0) on the calling thread and fn(ctx, 1..parts-1) on others, returning when every
 * part is done: on torch's OpenMP team where the library is built with OpenMP (its
 * default), else on workers of our own, started once (and kept). A decode step hands work
 * to the pool dozens of times, every few tens of microseconds: our worker spins on the job counter for a
 * while after each job (so the next one starts within a microsecond), then sleeps on a
 * condition variable until the next. One job at a time: a second caller meanwhile runs
 * its parts itself. After a fork the child starts without workers and makes its own on
 * first use.
 */

#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>

#include "cpu_kernels.h"

#define MAX_WORKERS 63
#define SPINS 5000 /* pause instructions a worker spins before it sleeps (~0.1-0.5 ms) */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int workers;         /* started, ids 1..workers */
    uint64_t gen;        /* bumped once per job, after the job's fields are written */
    ms_part_fn fn;
    void *ctx;
    int64_t parts;
    int64_t done;        /* workers through the current job */
    int busy;            /* a caller holds the pool */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0};

static uint64_t start_gen[MAX_WORKERS + 1]; /* the job count when each worker was made */

static void *worker(void *arg) {
    const int64_t id = (int64_t)(intptr_t)arg;
    uint64_t seen = start_gen[id]; /* a job published before this thread ran is still its */
    for (;;) {
        uint64_t gen;
        int64_t spins = 0;
        while ((gen = __atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE)) == seen) {
            if (++spins < SPINS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool.mu);
            while (__atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE) == seen)
                pthread_cond_wait(&pool.cv, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = gen;
        if (id < pool.parts) pool.fn(pool.ctx, id);
        __atomic_add_fetch(&pool.done, 1, __ATOMIC_RELEASE);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pool.workers = 0; /* the parent's threads do not exist here */
    pool.busy = 0;    /* nor does a job a parent's thread was running */
}

/* Start workers until there are `n` (at most MAX_WORKERS); returns how many there are. */
static int ensure_workers(int n) {
    static int registered = 0;
    if (!registered) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        registered = 1;
    }
    if (n > MAX_WORKERS) n = MAX_WORKERS;
    while (pool.workers < n) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        start_gen[pool.workers + 1] = pool.gen;
        const int rc = pthread_create(&t, &attr, worker, (void *)(intptr_t)(pool.workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.workers++;
    }
    return pool.workers;
}

static void threads_run(ms_part_fn fn, void *ctx, int64_t parts) {
    /* One job at a time: a caller that finds the pool busy (another thread of the process
     * inside a kernel: ctypes lets them run at once) runs its parts itself. */
    if (parts <= 1 || __atomic_exchange_n(&pool.busy, 1, __ATOMIC_ACQUIRE)) {
        for (int64_t p = 0; p < parts; p++) fn(ctx, p);
        return;
    }
    if (ensure_workers((int)(parts - 1)) == 0) { /* no thread to hand to */
        for (int64_t p = 0; p < parts; p++) fn(ctx, p);
        __atomic_store_n(&pool.busy, 0, __ATOMIC_RELEASE);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.parts = parts;
    __atomic_store_n(&pool.done, 0, __ATOMIC_RELAXED);
    pthread_mutex_lock(&pool.mu);
    __atomic_add_fetch(&pool.gen, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    fn(ctx, 0);
    for (int64_t p = pool.workers + 1; p < parts; p++) fn(ctx, p); /* past the workers */
    while (__atomic_load_n(&pool.done, __ATOMIC_ACQUIRE) < pool.workers) cpu_relax();
    __atomic_store_n(&pool.busy, 0, __ATOMIC_RELEASE);
}

#if defined(_OPENMP)
#include <omp.h>

static int forked; /* set in a child of fork, where GNU OpenMP's team is gone but not reset */

static void note_fork(void) { forked = 1; }

/* Built with OpenMP (native_cpu's default): the parts run on the OpenMP team torch's own
 * kernels (oneDNN's) run on, so no second set of threads spins for the same cores beside
 * theirs. A forked child (OpenMP would wait there for its parent's threads) uses the
 * threads above, which it makes its own. */
void ms_pool_run(ms_part_fn fn, void *ctx, int64_t parts) {
    static int registered;
    if (!__atomic_exchange_n(&registered, 1, __ATOMIC_ACQ_REL))
        pthread_atfork(NULL, NULL, note_fork);
    if (forked || parts <= 1) {
        threads_run(fn, ctx, parts);
        return;
    }
#pragma omp parallel num_threads((int)parts)
    {
        const int64_t n = omp_get_num_threads();
        for (int64_t p = omp_get_thread_num(); p < parts; p += n) fn(ctx, p);
    }
}
#else
void ms_pool_run(ms_part_fn fn, void *ctx, int64_t parts) { threads_run(fn, ctx, parts); }
#endif

/* ms_linear_packed_f32 (fp32 panels) / ms_linear_pairs_f32 (bf16 pair panels) with the
 * panels split over `threads` (the pool): each part a contiguous range of panels, each
 * output computed exactly as on one thread. */
typedef struct {
    const float *x;
    int64_t xs;
    const char *p;
    float *out;
    int64_t os, M, K, N, bf16, parts;
} LinearJob;

#define PANEL_COLS 24 /* cpu_kernels.c: PANEL */
#define PAIR_COLS 16  /* linear_bf16.c: COLS */

static void linear_part(void *ctx, int64_t part) {
    LinearJob *j = ctx;
    const int64_t width = j->bf16 ? PAIR_COLS : PANEL_COLS;
    const int64_t panels = (j->N + width - 1) / width;
    const int64_t q0 = panels * part / j->parts, q1 = panels * (part + 1) / j->parts;
    if (q1 <= q0) return;
    const int64_t cols = (j->N < q1 * width ? j->N : q1 * width) - q0 * width;
    const char *p = j->p + q0 * j->K * width * (j->bf16 ? 2 : 4);
    float *out = j->out + q0 * width;
    if (j->bf16)
        ms_linear_pairs_f32(j->x, j->xs, (const uint16_t *)p, out, j->os, j->M, j->K, cols);
    else
        ms_linear_packed_f32(j->x, j->xs, (const float *)p, out, j->os, j->M, j->K, cols);
}

int ms_linear_packed_mt(const float *x, int64_t xs, const void *p, float *out, int64_t os,
                        int64_t M, int64_t K, int64_t N, int64_t bf16, int64_t threads) {
    const int64_t width = bf16 ? PAIR_COLS : PANEL_COLS;
    const int64_t panels = (N + width - 1) / width;
    LinearJob job = {x, xs, p, out, os, M, K, N, bf16, threads < panels ? threads : panels};
    if (job.parts < 1) job.parts = 1;
    ms_pool_run(linear_part, &job, job.parts);
    return 0;
}

/* ms_linear_pairs_bf16 with the columns split over `threads` parts: by pairs of panels
 * (the AMX kernel's 32 columns), or with `up` by gate panels; each output computed exactly
 * as on one thread. */
typedef struct {
    const uint16_t *x;
    int64_t xs;
    const uint16_t *p;
    int64_t K, N;
    char *out;
    int64_t os, out_bf16;
    const float *bias;
    int64_t M, variant, up, parts;
    int rc;
} PairsJob;

static int64_t pairs_unit(const PairsJob *j) { return (j->up ? 1 : 2) * PAIR_COLS; }

static void pairs_part(void *ctx, int64_t part) {
    PairsJob *j = ctx;
    const int64_t unit = pairs_unit(j), units = (j->N + unit - 1) / unit;
    const int64_t u0 = units * part / j->parts, u1 = units * (part + 1) / j->parts;
    if (u1 <= u0) return;
    const int64_t c0 = u0 * unit, c1 = j->N < u1 * unit ? j->N : u1 * unit;
    const int rc = ms_linear_pairs_bf16(
        j->x, j->xs, j->p + c0 * j->K, j->K, c1 - c0, j->out + c0 * (j->out_bf16 ? 2 : 4),
        j->os, j->out_bf16, j->bias ? j->bias + c0 : NULL, j->M, j->variant, j->up);
    if (rc != 0) __atomic_store_n(&j->rc, rc, __ATOMIC_RELAXED);
}

int ms_linear_pairs_bf16_mt(const uint16_t *x, int64_t xs, const uint16_t *p, int64_t K,
                            int64_t N, void *out, int64_t os, int64_t out_bf16,
                            const float *bias, int64_t M, int64_t variant, int64_t up,
                            int64_t threads) {
    PairsJob job = {x, xs, p, K, N, out, os, out_bf16, bias, M, variant, up, 1, 0};
    const int64_t units = (N + pairs_unit(&job) - 1) / pairs_unit(&job);
    job.parts = threads < units ? threads : units;
    if (job.parts <= 1)
        return ms_linear_pairs_bf16(x, xs, p, K, N, out, os, out_bf16, bias, M, variant, up);
    ms_pool_run(pairs_part, &job, job.parts);
    return job.rc;
}

/* ms_paged_decode_f32 with the rows split over `threads` (the pool): each part a
 * contiguous range of rows holding about as many cached tokens as the others; each row is
 * computed exactly as alone. */
typedef struct {
    const float *q;
    int64_t q_stride;
    const void *k, *v;
    const int64_t *tables;
    int64_t table_stride;
    const int64_t *lens;
    float *out;
    int64_t heads, kv_heads, head_dim, block_size, window, kv_bf16;
    float scale;
    const int64_t *bounds; /* rows [bounds[i], bounds[i + 1]) are part i */
    int rc;
} DecodeJob;

static void decode_part(void *ctx, int64_t part) {
    DecodeJob *j = ctx;
    const int64_t r0 = j->bounds[part], rows = j->bounds[part + 1] - r0;
    if (rows <= 0) return;
    const int rc = ms_paged_decode_f32(
        j->q + r0 * j->q_stride, j->q_stride, j->k, j->v, j->tables + r0 * j->table_stride,
        j->table_stride, j->lens + r0, j->out + r0 * j->heads * j->head_dim, rows, j->heads,
        j->kv_heads, j->head_dim, j->block_size, j->scale, j->window, j->kv_bf16);
    if (rc != 0) __atomic_store_n(&j->rc, rc, __ATOMIC_RELAXED);
}

#define DECODE_MIN_TOKENS 2048 /* cached tokens per part below which a part is not worth it */

int ms_paged_decode_mt(const float *q, int64_t q_stride, const void *k, const void *v,
                       const int64_t *tables, int64_t table_stride, const int64_t *lens,
                       float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, int64_t block_size, float scale, int64_t window,
                       int64_t kv_bf16, int64_t threads) {
    int64_t total = 0;
    for (int64_t r = 0; r < batch; r++) total += lens[r];
    int64_t parts = threads < batch ? threads : batch;
    if (parts > total / DECODE_MIN_TOKENS) parts = total / DECODE_MIN_TOKENS;
    if (parts > MAX_WORKERS + 1) parts = MAX_WORKERS + 1;
    if (parts <= 1)
        return ms_paged_decode_f32(q, q_stride, k, v, tables, table_stride, lens, out, batch,
                                   heads, kv_heads, head_dim, block_size, scale, window,
                                   kv_bf16);
    int64_t bounds[MAX_WORKERS + 2];
    bounds[0] = 0;
    int64_t r = 0, seen = 0;
    for (int64_t i = 1; i < parts; i++) { /* the first row past i / parts of the tokens */
        while (r < batch && seen * parts < total * i) seen += lens[r++];
        bounds[i] = r;
    }
    bounds[parts] = batch;
    DecodeJob job = {q, q_stride, k, v, tables, table_stride, lens, out, heads, kv_heads,
                     head_dim, block_size, window, kv_bf16, scale, bounds, 0};
    ms_pool_run(decode_part, &job, parts);
    return job.rc;
}

/* Row-wise kernels of a bf16 model's batched steps (SwiGLU, RMSNorm with the residual) with
 * their rows split over `threads` parts (the pool), each row computed as alone. */
#define ROWS_MIN_VALUES 32768 /* values per part below which a part is not worth it */

typedef struct {
    int norm; /* 1: ms_add_rms_norm_mixed, 0: ms_silu_mul_bf16 */
    const void *x;
    int64_t x_bf16;
    const float *residual, *weight;
    void *out;
    int64_t out_bf16;
    float *residual_out;
    int64_t rows, width, parts;
    float eps;
} RowsJob;

static int64_t rows_parts(int64_t rows, int64_t width, int64_t threads) {
    int64_t parts = threads < rows ? threads : rows;
    if (parts > rows * width / ROWS_MIN_VALUES) parts = rows * width / ROWS_MIN_VALUES;
    if (parts > MAX_WORKERS + 1) parts = MAX_WORKERS + 1;
    return parts < 1 ? 1 : parts;
}

static void rows_part(void *ctx, int64_t part) {
    const RowsJob *j = ctx;
    const int64_t r0 = j->rows * part / j->parts, r1 = j->rows * (part + 1) / j->parts;
    const int64_t w = j->width, at = r0 * w;
    if (r1 <= r0) return;
    if (!j->norm) {
        ms_silu_mul_bf16((const uint16_t *)j->x + 2 * at, (uint16_t *)j->out + at, r1 - r0, w);
        return;
    }
    ms_add_rms_norm_mixed((const char *)j->x + at * (j->x_bf16 ? 2 : 4), j->x_bf16,
                          j->residual ? j->residual + at : NULL, j->weight,
                          (char *)j->out + at * (j->out_bf16 ? 2 : 4), j->out_bf16,
                          j->residual ? j->residual_out + at : NULL, r1 - r0, w, j->eps);
}

void ms_silu_mul_bf16_mt(const uint16_t *x, uint16_t *out, int64_t rows, int64_t width,
                         int64_t threads) {
    RowsJob job = {0, x, 1, NULL, NULL, out, 1, NULL, rows, width,
                   rows_parts(rows, width, threads), 0.0f};
    if (job.parts <= 1) return ms_silu_mul_bf16(x, out, rows, width);
    ms_pool_run(rows_part, &job, job.parts);
}

void ms_add_rms_norm_mixed_mt(const void *x, int64_t x_bf16, const float *residual,
                              const float *weight, void *out, int64_t out_bf16,
                              float *residual_out, int64_t rows, int64_t width, float eps,
                              int64_t threads) {
    RowsJob job = {1, x, x_bf16, residual, weight, out, out_bf16, residual_out, rows, width,
                   rows_parts(rows, width, threads), eps};
    if (job.parts <= 1)
        return ms_add_rms_norm_mixed(x, x_bf16, residual, weight, out, out_bf16, residual_out,
                                     rows, width, eps);
    ms_pool_run(rows_part, &job, job.parts);
}
