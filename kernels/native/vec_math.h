/* Vector helpers the CPU kernels share: horizontal sums and maxima, and exp. */
#ifndef MESHSERVE_VEC_MATH_H
#define MESHSERVE_VEC_MATH_H

#include <stdint.h>
#include <string.h>

/* fp32 -> bf16, rounded to nearest even (NaN kept a quiet NaN), as torch's .to(bfloat16). */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Element i of an fp32 array, or with bf16 of a bf16 one widened (the top half of the fp32
 * with the same bits). */
static inline float widen_at(const void *base, int64_t i, int64_t bf16) {
    if (!bf16) return ((const float *)base)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* exp(x), eight lanes: 2^k times a degree-6 polynomial on [-ln2/2, ln2/2] (within 2 ulp of
 * expf); x below -87.3 gives exp(-87.3), about 1e-38. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
/* exp8 on sixteen lanes (the same polynomial; 2^k by VSCALEFPS). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, k);
}

/* silu(g) = g / (1 + exp(-g)) on sixteen lanes, the reciprocal by VRCP14PS and one Newton
 * step (within 2 ulp of the division); exp's argument capped at 88 (a very negative g: 0). */
static inline __m512 silu16(__m512 g) {
    const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g),
                                         _mm512_set1_ps(88.0f)));
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(g, inv);
}
#endif


#if defined(__AVX512BF16__)
/* The bf16 pair p[0], p[1] in every 32-bit lane: one VDPBF16PS operand (two k's of a row). */
static inline __m512bh pair_bcast(const uint16_t *p) {
    uint32_t x;
    memcpy(&x, p, sizeof(x));
    return (__m512bh)_mm512_set1_epi32((int)x);
}
#endif

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
/* Palette 1 with tiles 0-7 each 16 rows of 64 bytes: the one shape the kernels use. */
static inline void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
}
#endif

#endif
