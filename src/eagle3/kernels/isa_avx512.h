// The AVX-512 path (F, BW, VL, DQ and VNNI): Ice Lake / Sapphire Rapids and later, Zen 4 and
// later. Included by kernels.cpp inside its anonymous namespace, after isa_avx2.h (whose
// reduce8 it shares).

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")
namespace isa_avx512 {

struct V {
  __m512 v;
  static V make(__m512 a) { V r; r.v = a; return r; }
  static __mmask16 live(int n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }
  static V zero() { return make(_mm512_setzero_ps()); }
  static V set1(float x) { return make(_mm512_set1_ps(x)); }
  static V load(const float* p) { return make(_mm512_loadu_ps(p)); }
  static V load_n(const float* p, int n) { return make(_mm512_maskz_loadu_ps(live(n), p)); }
  static V load_bf16(const uint16_t* p) {
    return make(_mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16)));
  }
  static V load_bf16_n(const uint16_t* p, int n) {
    return make(_mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live(n), p)), 16)));
  }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a.v); }
  static void store_n(float* p, V a, int n) { _mm512_mask_storeu_ps(p, live(n), a.v); }
  static V fma(V a, V b, V c) { return make(_mm512_fmadd_ps(a.v, b.v, c.v)); }
  static V add(V a, V b) { return make(_mm512_add_ps(a.v, b.v)); }
  static V sub(V a, V b) { return make(_mm512_sub_ps(a.v, b.v)); }
  static V mul(V a, V b) { return make(_mm512_mul_ps(a.v, b.v)); }
  static V max(V a, V b) { return make(_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ), b.v, a.v)); }
  static V div(V a, V b) { return make(_mm512_div_ps(a.v, b.v)); }
  static V select_neg(V c, V a, V b) {
    return make(_mm512_mask_blend_ps(_mm512_cmp_ps_mask(c.v, _mm512_setzero_ps(), _CMP_LT_OQ), b.v, a.v));
  }
  static V round_even(V a) { return make(_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
  static V pow2(V n) {
    return make(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23)));
  }
  static float reduce(V a) {  // lanes i + (i + 8), then the AVX2 path's tree
    return isa_avx2::reduce8(_mm256_add_ps(_mm512_castps512_ps256(a.v),
                                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1))));
  }
  // reduce() of 16 vectors at once: the same additions (lanes i + (i + 8), then i + (i + 4),
  // then (0 + 2, 1 + 3), then the two), done for 16 keys per instruction by shuffles.
  static void reduce16(const float* p, int n, float* out) {
    if (n < 16) {
      for (int j = 0; j < n; ++j) out[j] = reduce(load(p + 16 * j));
      return;
    }
    __m512 x[8], y[4], z[2];
    for (int k = 0; k < 8; ++k) {  // x[k]: s8 of vectors 2k, 2k + 1
      const __m512 a = _mm512_loadu_ps(p + 32 * k), b = _mm512_loadu_ps(p + 32 * k + 16);
      x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int k = 0; k < 4; ++k)  // y[k], 128-bit chunk m: s4 of vector 4k + m
      y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x88),
                           _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; ++k)  // z[k], chunk m: s2 of vectors 8k + m, 8k + 4 + m
      z[k] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * k], y[2 * k + 1], 0x44),
                           _mm512_shuffle_ps(y[2 * k], y[2 * k + 1], 0xEE));
    // chunk m, lane l: the sum of vector m + 4 l; put vector j in lane j
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(idx, r));
  }
};
constexpr int MT = 6;
constexpr int NB = 4;
#include "float_body.h"

// 16 columns at a time: vpdpbusd multiplies unsigned weight codes by the row's signed
// activation quad broadcast to every column. INT8 codes are made unsigned by +128 (xor 0x80),
// which adds 128 * xs: the block's integer sum starts from -zp * xs instead of 0 (integers:
// the same sum in any order).
// Up to ROWS rows at a time keep their accumulators in registers through all blocks; the
// format is a template argument so that the row loop carries no branches. The first chunk of
// rows streams the group's codes from memory (prefetching ahead); later chunks find them in L1.
enum QKind { Q8 = 0, Q41 = 1, Q40 = 2 };
constexpr int ROWS = 8;

template <int F, int R>
void q_rows(const QCall& c, int64_t g, int64_t r0, bool stream) {
  constexpr int64_t tile = F == Q8 ? 512 : 256;
  constexpr int32_t zp = F == Q8 ? 128 : F == Q40 ? 8 : 0;
  const int64_t nb = c.nb, K = c.K;
  const __m512i nib = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* xq = c.xq + r0 * K;
  const float* xd = c.xd + r0 * nb;
  const float* xsd = c.xsd + r0 * nb;
  const int32_t* xs = c.xs + r0 * nb;
  __m512 acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const uint8_t* t = c.codes + g * nb * tile;
  const uint16_t* dp = c.d + g * nb * 16;
  const uint16_t* mp = F == Q41 ? c.m + g * nb * 16 : nullptr;
  for (int64_t b = 0; b < nb; ++b, t += tile, dp += 16) {
    if (stream) prefetch_ahead(c, t, (g * nb + b) * 16, tile);
    __m512i w[8];
    if (F == Q8) {
      for (int q = 0; q < 8; ++q) w[q] = _mm512_xor_si512(_mm512_loadu_si512(t + 64 * q), flip);
    } else {
      for (int p = 0; p < 4; ++p) {
        const __m512i r = _mm512_loadu_si512(t + 64 * p);
        w[p] = _mm512_and_si512(r, nib);
        w[4 + p] = _mm512_and_si512(_mm512_srli_epi16(r, 4), nib);
      }
    }
    const __m512 vd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dp)));
    __m512 vm = _mm512_setzero_ps();
    if (F == Q41) vm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mp + b * 16)));
    // q outer, rows inner: the rows' dependent vpdpbusd chains advance side by side.
    __m512i s[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) s[i] = zp ? _mm512_set1_epi32(-zp * xs[i * nb + b]) : _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q)
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i)
        s[i] = _mm512_dpbusd_epi32(s[i], w[q], _mm512_set1_epi32(reinterpret_cast<const int32_t*>(xq + i * K + b * 32)[q]));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_mul_ps(vd, _mm512_set1_ps(xd[i * nb + b])), _mm512_cvtepi32_ps(s[i])));
      if (F == Q41) acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(vm, _mm512_set1_ps(xsd[i * nb + b])));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(c.y + (r0 + i) * c.N + g * 16, acc[i]);
}

template <int F>
void q_group(const QCall& c, int64_t g) {
  for (int64_t r0 = 0; r0 < c.M; r0 += ROWS) {
    const bool stream = r0 == 0;
    switch (std::min<int64_t>(ROWS, c.M - r0)) {
      case 1: q_rows<F, 1>(c, g, r0, stream); break;
      case 2: q_rows<F, 2>(c, g, r0, stream); break;
      case 3: q_rows<F, 3>(c, g, r0, stream); break;
      case 4: q_rows<F, 4>(c, g, r0, stream); break;
      case 5: q_rows<F, 5>(c, g, r0, stream); break;
      case 6: q_rows<F, 6>(c, g, r0, stream); break;
      case 7: q_rows<F, 7>(c, g, r0, stream); break;
      default: q_rows<F, 8>(c, g, r0, stream); break;
    }
  }
}

void qlinear(const QCall& c, int64_t g0, int64_t g1) {
  const int kind = c.fmt == INT8 ? Q8 : c.m ? Q41 : Q40;
  for (int64_t g = g0; g < g1; ++g) {
    if (kind == Q8) q_group<Q8>(c, g);
    else if (kind == Q41) q_group<Q41>(c, g);
    else q_group<Q40>(c, g);
  }
}

// The first index of each row's maximum (a NaN counts as the maximum, as in torch.argmax).
// Per lane a strictly greater value replaces the kept one, so each lane keeps its first
// maximum; across lanes the smallest index among equal maxima is the row's first.
int64_t argmax_row(const float* x, int64_t n) {
  if (n < 32) return scalar_argmax(x, n);
  __m512 best = _mm512_loadu_ps(x);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i idx = at;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  int64_t i = 16;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    idx = _mm512_add_epi32(idx, step);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_blend_ps(gt, best, v);
    at = _mm512_mask_blend_epi32(gt, at, idx);
  }
  if (nan) return scalar_argmax(x, n);
  const float m = _mm512_reduce_max_ps(best);
  const __mmask16 is_m = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  return argmax_from(x, i, n, m, _mm512_mask_reduce_min_epi32(is_m, at));
}

}  // namespace isa_avx512
#pragma GCC pop_options

namespace isa_avx512 {  // outside the target pragma: runs on any CPU
inline bool supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}
const Kernels TABLE{"avx512", supported, qlinear, quantize_rows, float_linear<float>, float_linear<uint16_t>, NB,
                    attention_rows<float>, attention_rows<uint16_t>, rms_norm_rows, rope_rows, silu_mul_rows,
                    argmax_row};
}  // namespace isa_avx512
