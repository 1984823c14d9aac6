/* The kernels of cpu_kernels.c that other files of this library call. */
#ifndef MESHSERVE_CPU_KERNELS_H
#define MESHSERVE_CPU_KERNELS_H

#include <stdint.h>

void ms_rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows,
                     int64_t width, float eps);
void ms_add_rms_norm_f32(const float *x, const float *residual, const float *weight,
                         float *out, float *residual_out, int64_t rows, int64_t width,
                         float eps);
int ms_attend_qkv_f32(float *qkv, int64_t tokens, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, const float *cos, const float *sin, void *k_cache,
                      void *v_cache, int64_t kv_bf16, int64_t block_size,
                      const int64_t *slots, int64_t num_decode, const int64_t *tables,
                      int64_t table_stride, const int64_t *lens, float scale, int64_t window,
                      float *out, int64_t threads);
int ms_paged_decode_f32(const float *q, int64_t q_stride, const void *k, const void *v,
                        const int64_t *tables, int64_t table_stride, const int64_t *lens,
                        float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, int64_t window,
                        int64_t kv_bf16);
int ms_paged_decode_mt(const float *q, int64_t q_stride, const void *k, const void *v,
                       const int64_t *tables, int64_t table_stride, const int64_t *lens,
                       float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, int64_t block_size, float scale, int64_t window,
                       int64_t kv_bf16, int64_t threads);
void ms_linear_packed_f32(const float *x, int64_t xs, const float *p, float *out, int64_t os,
                          int64_t M, int64_t K, int64_t N);
void ms_unpack_rows_f32(const float *p, int64_t K, const int64_t *ids, int64_t T, float *out);
void ms_argmax_rows_f32(const float *x, int64_t xs, int64_t rows, int64_t cols, int64_t *out);
void ms_silu_mul_f32(const float *x, float *out, int64_t rows, int64_t width);
void ms_silu_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t width);
void ms_add_rms_norm_mixed(const void *x, int64_t x_bf16, const float *residual,
                           const float *weight, void *out, int64_t out_bf16,
                           float *residual_out, int64_t rows, int64_t width, float eps);

/* linear_bf16.c: bf16 weights in pair panels. */
void ms_pack_pairs(const float *w, int64_t ws_n, int64_t ws_k, uint16_t *p, int64_t N,
                   int64_t K);
void ms_unpack_rows_pairs(const uint16_t *p, int64_t K, const int64_t *ids, int64_t T,
                          float *out);
void ms_linear_pairs_f32(const float *x, int64_t xs, const uint16_t *p, float *out, int64_t os,
                         int64_t M, int64_t K, int64_t N);
int ms_linear_pairs_bf16(const uint16_t *x, int64_t xs, const uint16_t *p, int64_t K,
                         int64_t N, void *out, int64_t os, int64_t out_bf16, const float *bias,
                         int64_t M, int64_t variant, int64_t up);
int ms_amx_permitted(void);

/* pool.c: run fn(ctx, part) for part in [0, parts), part 0 on the caller, the rest on
 * persistent worker threads; returns when all are done. */
typedef void (*ms_part_fn)(void *ctx, int64_t part);
void ms_pool_run(ms_part_fn fn, void *ctx, int64_t parts);
int ms_linear_packed_mt(const float *x, int64_t xs, const void *p, float *out, int64_t os,
                        int64_t M, int64_t K, int64_t N, int64_t bf16, int64_t threads);
int ms_linear_pairs_bf16_mt(const uint16_t *x, int64_t xs, const uint16_t *p, int64_t K,
                            int64_t N, void *out, int64_t os, int64_t out_bf16,
                            const float *bias, int64_t M, int64_t variant, int64_t up,
                            int64_t threads);

#endif
