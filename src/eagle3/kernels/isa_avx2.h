// The AVX2 path (with FMA and F16C): Haswell and later, Zen 1 and later. Included by
// kernels.cpp inside its anonymous namespace, after isa_scalar.h.

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {

// The tail of the fixed tree (float_body.h): 8 sums -> 4 (i + (i + 4)) -> 2 -> 1.
inline float reduce8(__m256 s8) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));  // (0+2, 1+3)
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

struct V {  // lanes 0..7 in lo, 8..15 in hi
  __m256 lo, hi;
  static V make(__m256 a, __m256 b) { V r; r.lo = a; r.hi = b; return r; }
  static V zero() { return make(_mm256_setzero_ps(), _mm256_setzero_ps()); }
  static V set1(float x) { return make(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
  static V load(const float* p) { return make(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
  static __m256i mask8(int n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
  }
  static V load_n(const float* p, int n) {
    return make(_mm256_maskload_ps(p, mask8(n)), _mm256_maskload_ps(p + 8, mask8(n - 8)));
  }
  static __m256 bf16x8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
  static V load_bf16(const uint16_t* p) {
    return make(bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
  }
  static V load_bf16_n(const uint16_t* p, int n) {
    alignas(32) uint16_t tmp[16] = {};
    std::memcpy(tmp, p, n * 2);
    return load_bf16(tmp);
  }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
  static void store_n(float* p, V a, int n) {
    _mm256_maskstore_ps(p, mask8(n), a.lo);
    _mm256_maskstore_ps(p + 8, mask8(n - 8), a.hi);
  }
  static V fma(V a, V b, V c) { return make(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
  static V add(V a, V b) { return make(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
  static V sub(V a, V b) { return make(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
  static V mul(V a, V b) { return make(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
  static V max(V a, V b) {  // the scalar path's a > b ? a : b
    return make(_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ)),
                _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)));
  }
  static V div(V a, V b) { return make(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
  static V select_neg(V c, V a, V b) {
    const __m256 z = _mm256_setzero_ps();
    return make(_mm256_blendv_ps(b.lo, a.lo, _mm256_cmp_ps(c.lo, z, _CMP_LT_OQ)),
                _mm256_blendv_ps(b.hi, a.hi, _mm256_cmp_ps(c.hi, z, _CMP_LT_OQ)));
  }
  static V round_even(V a) {
    return make(_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static __m256 pow2x8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static V pow2(V n) { return make(pow2x8(n.lo), pow2x8(n.hi)); }
  static float reduce(V a) { return reduce8(_mm256_add_ps(a.lo, a.hi)); }
  static void reduce16(const float* p, int n, float* out) {
    for (int j = 0; j < n; ++j) out[j] = reduce(load(p + 16 * j));
  }
};
constexpr int MT = 3;
constexpr int NB = 1;
#include "float_body.h"

// u8 x s8 products summed in pairs by maddubs (no saturation: |products| <= 2 * 128 * 127 <
// 32768), then in fours by madd; INT8 codes as |q| with their signs moved onto the activations.
// 4-bit codes sum all eight pairs of a block in 16 bits (|sum| <= 8 * 2 * 15 * 127 < 32768) and
// widen once at the end (integers: the same sum in any order).
struct Quad {  // 8 columns x 4 inputs: the unsigned operand, and for INT8 the signed codes
  __m256i u, s;
};
constexpr int32_t ZP_INT8 = 0;

inline Quad int8_quad(const uint8_t* p) {
  const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return Quad{_mm256_abs_epi8(s), s};
}

template <int F>  // a block's running sum before its first quad (INT4: 16-bit lanes)
inline __m256i sum_start(int32_t start) {
  return F == 0 ? _mm256_set1_epi32(start) : _mm256_setzero_si256();
}

template <int F>  // the running sum plus quad w times the row's activation quad x4
inline __m256i sum_step(__m256i s, const Quad& w, int32_t x4) {
  if (F == 0) {
    const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(x4), w.s);
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w.u, xv), _mm256_set1_epi16(1)));
  }
  return _mm256_add_epi16(s, _mm256_maddubs_epi16(w.u, _mm256_set1_epi32(x4)));
}

template <int F>  // the block's int32 sum
inline __m256i sum_finish(__m256i s, int32_t start) {
  if (F == 0) return s;
  s = _mm256_madd_epi16(s, _mm256_set1_epi16(1));
  return start ? _mm256_add_epi32(s, _mm256_set1_epi32(start)) : s;
}

#include "qlinear256.h"

// The first index of each row's maximum (a NaN counts as the maximum, as in torch.argmax): per
// lane a strictly greater value replaces the kept one, so each lane keeps its first maximum;
// across lanes the smallest index among equal maxima is the row's first (AVX-512's way, 8 lanes).
int64_t argmax_row(const float* x, int64_t n) {
  if (n < 16) return scalar_argmax(x, n);
  __m256 best = _mm256_loadu_ps(x);
  __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i idx = at;
  const __m256i step = _mm256_set1_epi32(8);
  __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
  int64_t i = 8;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    idx = _mm256_add_epi32(idx, step);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, gt);
    at = _mm256_blendv_epi8(at, idx, _mm256_castps_si256(gt));
  }
  if (_mm256_movemask_ps(nan)) return scalar_argmax(x, n);
  alignas(32) float bv[8];
  alignas(32) int32_t bi[8];
  _mm256_store_ps(bv, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(bi), at);
  float m = bv[0];
  for (int l = 1; l < 8; ++l) m = bv[l] > m ? bv[l] : m;
  int64_t r = n;
  for (int l = 0; l < 8; ++l)
    if (bv[l] == m && bi[l] < r) r = bi[l];
  return argmax_from(x, i, n, m, r);
}

}  // namespace isa_avx2
#pragma GCC pop_options

namespace isa_avx2 {  // outside the target pragma: runs on any CPU
inline bool supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
const Kernels TABLE{"avx2", supported, qlinear, quantize_rows, float_linear<float>, float_linear<uint16_t>, NB,
                    attention_rows<float>, attention_rows<uint16_t>, rms_norm_rows, rope_rows, silu_mul_rows,
                    argmax_row};
}  // namespace isa_avx2
