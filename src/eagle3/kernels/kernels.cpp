// Row-invariant, weight-stationary kernels for small M on any x86-64 CPU.
//
//   wlinear:   y (M, N) = x (M, K) @ W^T, W in one of the formats below.
//   attention: masked attention, one query row at a time.
//
// Why: speculative verification runs K+1 rows through every layer. Stock CPU kernels either
// stream the weights once per row (cost grows with M) or choose a different summation order
// for a different M (a row's result then changes with the batch, and speculative output
// stops being bit-identical to plain decoding). Here each weight block is read and decoded
// once per call and applied to every row, row m's result depends on x[m] and W only, and each
// output column is computed by one thread (no split-K).
//
// Packed formats (GGUF's block codes; layouts written by eagle3/kernels/formats.py):
//   Q8_0 (INT8):  w = d * q,        q int8,   d fp16 per block of 32 inputs.
//   Q4_1 (INT4):  w = d * q + m,    q 0..15,  d, m fp16 per block.
//   Q4_0 (INT4, no m): w = d * (q - 8).
// Activations are quantized per row, per block of 32, from that row alone (Q8: xd = amax/127,
// xq = round-half-even(x / xd) in -127..127, xs = sum of xq). A block's dot product
// isum = sum q * xq - zp * xs is an exact int32, the same by any instruction sequence; the
// epilogue runs in fp32 in block order, with no fused multiply-add:
//   acc = acc + (d * xd) * isum          [+ m * (xd * xs) for Q4_1]
// so every path (scalar, AVX2, AVX-512 VNNI) gives the same bits as the others and as the
// integer reference in PyTorch (`kernels.exact_linear`).
//
// Packed layout: columns in groups of 16; per group g and block b one tile of codes:
//   INT8: 512 bytes, [quad 0..7][column 0..15][4 bytes]: inputs 4 quad .. 4 quad + 3.
//   INT4: 256 bytes, [p 0..3][column 0..15][4 bytes]: low nibble = input 4p + j, high nibble
//         = input 16 + 4p + j (GGUF's own nibble order within a block, transposed).
// scales d and mins m: (N/16, K/32, 16) fp16.
//
// Float formats (F32, BF16 weights as (N, K)) keep fp32 activations: 16-lane fused
// multiply-adds over k and a fixed reduction tree (float_body.h), the same on every path.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace {

enum Format : int64_t { F32 = 0, BF16 = 1, INT8 = 2, INT4 = 3 };
// Ordered worst to best. AVXVNNI is AVX2 with 256-bit vpdpbusd (Alder Lake and later client
// CPUs, which have no AVX-512): its float kernels are the AVX2 path's, its packed matmul its own.
enum Isa : int { SCALAR = 0, AVX2 = 1, AVXVNNI = 2, AVX512 = 3 };
constexpr int N_ISA = 4;
const char* const ISA_NAMES[] = {"scalar", "avx2", "avxvnni", "avx512"};

struct AttnArgs {
  const float* q;
  const void *k, *v;  // float32 or bf16 (uint16_t), both the same
  const bool* mask;
  float* out;
  int64_t T, nh, hd, S, group;
  int64_t qs[3], ks[3], vs[3], ms[3];
  float scale, softcap;
  int64_t hc;  // query heads per unit of work (`attention_units`), 1..HEAD_CHUNK
};

struct RopeArgs {
  float* x;  // (B, T, heads, hd), the last dimension contiguous
  const float *cos, *sin;  // (T, hd), or (B, T, hd) with cb = T * hd
  int64_t T, heads, hd, cb;
  int64_t xs[3];
};

// One call's quantized activations and packed weights.
struct QCall {
  const int8_t* xq;   // (M, K)
  const float* xd;    // (M, nb) scale
  const float* xsd;   // (M, nb) xd * xs
  const int32_t* xs;  // (M, nb) sum of codes
  int64_t M, K, nb, N;
  const uint8_t* codes;
  const uint16_t* d;  // (N/16, nb, 16) fp16 bits
  const uint16_t* m;  // same, or nullptr
  int64_t fmt;
  int32_t zp;  // subtracted zero point: 8 for Q4_0, else 0
  float* y;
};

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// torch.argmax over one row: the first maximum, or the first NaN.
int64_t isa_scalar_argmax(const float* x, int64_t n) {
  int64_t r = 0;
  float bv = x[0];
  if (std::isnan(bv)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > bv) { bv = x[i]; r = i; }
  }
  return r;
}

// Bytes of codes per 16 columns x 32 inputs.
inline int64_t tile_bytes(int64_t fmt) { return fmt == INT8 ? 512 : 256; }

// This thread's fp32 accumulators for M rows x 16 columns (grown once, never freed).
inline float* row_accumulators(int64_t M) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < M * 16) buf.resize(M * 16);
  return buf.data();
}

// The weights stream from DRAM once per call: ask for a block's codes and scales PREFETCH
// blocks before they are needed (one block is 320-576 bytes; a DRAM read takes ~100 ns, a
// block's arithmetic ~20 ns), every cache line of them. Past the end it fetches nothing harmful:
// prefetches never fault.
constexpr int64_t PREFETCH = 16;
inline void prefetch_ahead(const QCall& c, const uint8_t* tile_ptr, int64_t scale_at, int64_t tile) {
  const char* t = reinterpret_cast<const char*>(tile_ptr + PREFETCH * tile);
  for (int64_t i = 0; i < tile; i += 64) _mm_prefetch(t + i, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(c.d + scale_at + PREFETCH * 16), _MM_HINT_T0);
  if (c.m) _mm_prefetch(reinterpret_cast<const char*>(c.m + scale_at + PREFETCH * 16), _MM_HINT_T0);
}

// ======================================= scalar =============================================

namespace isa_scalar {

struct V {
  float l[16];
  static V zero() { V r; for (int i = 0; i < 16; ++i) r.l[i] = 0.f; return r; }
  static V set1(float x) { V r; for (int i = 0; i < 16; ++i) r.l[i] = x; return r; }
  static V load(const float* p) { V r; for (int i = 0; i < 16; ++i) r.l[i] = p[i]; return r; }
  static V load_n(const float* p, int n) { V r = zero(); for (int i = 0; i < n; ++i) r.l[i] = p[i]; return r; }
  static float bf16(uint16_t b) { uint32_t u = static_cast<uint32_t>(b) << 16; float f; std::memcpy(&f, &u, 4); return f; }
  static V load_bf16(const uint16_t* p) { V r; for (int i = 0; i < 16; ++i) r.l[i] = bf16(p[i]); return r; }
  static V load_bf16_n(const uint16_t* p, int n) { V r = zero(); for (int i = 0; i < n; ++i) r.l[i] = bf16(p[i]); return r; }
  static void store(float* p, V a) { for (int i = 0; i < 16; ++i) p[i] = a.l[i]; }
  static void store_n(float* p, V a, int n) { for (int i = 0; i < n; ++i) p[i] = a.l[i]; }
  static V fma(V a, V b, V c) { V r; for (int i = 0; i < 16; ++i) r.l[i] = std::fma(a.l[i], b.l[i], c.l[i]); return r; }
  static V add(V a, V b) { V r; for (int i = 0; i < 16; ++i) r.l[i] = a.l[i] + b.l[i]; return r; }
  static V sub(V a, V b) { V r; for (int i = 0; i < 16; ++i) r.l[i] = a.l[i] - b.l[i]; return r; }
  static V mul(V a, V b) { V r; for (int i = 0; i < 16; ++i) r.l[i] = a.l[i] * b.l[i]; return r; }
  static V max(V a, V b) { V r; for (int i = 0; i < 16; ++i) r.l[i] = a.l[i] > b.l[i] ? a.l[i] : b.l[i]; return r; }
  static V div(V a, V b) { V r; for (int i = 0; i < 16; ++i) r.l[i] = a.l[i] / b.l[i]; return r; }
  static V select_neg(V c, V a, V b) { V r; for (int i = 0; i < 16; ++i) r.l[i] = c.l[i] < 0.f ? a.l[i] : b.l[i]; return r; }
  // Round half to even by the FPU's own rounding (|a| < 2^23: adding 2^23 leaves no fraction
  // bits), as nearbyint does without a libm call per element; larger values are integers.
  static float round1(float a) {
    const float m = std::fabs(a);
    return m < 8388608.f ? std::copysign((m + 8388608.f) - 8388608.f, a) : a;
  }
  static V round_even(V a) { V r; for (int i = 0; i < 16; ++i) r.l[i] = round1(a.l[i]); return r; }
  static V pow2(V n) {  // 2^n for integral n in [-126, 127], built from its bits
    V r;
    for (int i = 0; i < 16; ++i) { uint32_t u = static_cast<uint32_t>(static_cast<int32_t>(n.l[i]) + 127) << 23; std::memcpy(&r.l[i], &u, 4); }
    return r;
  }
  static float reduce(V a) {  // the fixed tree: halves 8, 4, 2, 1
    float s8[8], s4[4];
    for (int i = 0; i < 8; ++i) s8[i] = a.l[i] + a.l[i + 8];
    for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
  }
  static void reduce16(const float* p, int n, float* out) {  // out[j] = reduce(p[16 j ..])
    for (int j = 0; j < n; ++j) out[j] = reduce(load(p + 16 * j));
  }
};
constexpr int MT = 1;
constexpr int NB = 1;
#include "float_body.h"

void qlinear(const QCall& c, int64_t g0, int64_t g1) {
  const int64_t M = c.M, nb = c.nb;
  const int64_t tile = tile_bytes(c.fmt);
  float* acc = row_accumulators(M);
  int32_t w[16][32];
  for (int64_t g = g0; g < g1; ++g) {
    std::fill(acc, acc + M * 16, 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* t = c.codes + (g * nb + b) * tile;
      if (c.fmt == INT8) {
        for (int q = 0; q < 8; ++q)
          for (int l = 0; l < 16; ++l)
            for (int j = 0; j < 4; ++j) w[l][4 * q + j] = static_cast<int8_t>(t[(q * 16 + l) * 4 + j]);
      } else {
        for (int p = 0; p < 4; ++p)
          for (int l = 0; l < 16; ++l)
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = t[(p * 16 + l) * 4 + j];
              w[l][4 * p + j] = byte & 15;
              w[l][16 + 4 * p + j] = byte >> 4;
            }
      }
      const uint16_t* dp = c.d + (g * nb + b) * 16;
      const uint16_t* mp = c.m ? c.m + (g * nb + b) * 16 : nullptr;
      for (int64_t r = 0; r < M; ++r) {
        const int8_t* x = c.xq + r * c.K + b * 32;
        const int64_t rb = r * nb + b;
        for (int l = 0; l < 16; ++l) {
          int32_t s = 0;
          for (int k = 0; k < 32; ++k) s += w[l][k] * x[k];
          s -= c.zp * c.xs[rb];
          float a = acc[r * 16 + l];
          a = a + (half_to_float(dp[l]) * c.xd[rb]) * static_cast<float>(s);
          if (mp) a = a + half_to_float(mp[l]) * c.xsd[rb];
          acc[r * 16 + l] = a;
        }
      }
    }
    for (int64_t r = 0; r < M; ++r) std::memcpy(c.y + r * c.N + g * 16, acc + r * 16, 64);
  }
}

}  // namespace isa_scalar

// ======================================== AVX2 ==============================================

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
// 4-bit codes sum all eight pairs in 16 bits first (|sum| <= 8 * 2 * 15 * 127 < 32768) and
// widen once.
struct Codes {
  __m256i w[8], sw[8];  // unsigned codes (or |q|), and for INT8 the signed codes
};
constexpr int32_t ZP_INT8 = 0;

inline void load_int8(const uint8_t* t, int h, Codes& c) {
  for (int q = 0; q < 8; ++q) {
    c.sw[q] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 * q + 32 * h));
    c.w[q] = _mm256_abs_epi8(c.sw[q]);
  }
}

template <int F>
inline __m256i block_sum(const Codes& c, const int32_t* x4, int32_t start) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s;
  if (F == 0) {
    s = _mm256_setzero_si256();
    for (int q = 0; q < 8; ++q) {
      const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(x4[q]), c.sw[q]);
      s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(c.w[q], xv), ones));
    }
  } else {
    __m256i s16 = _mm256_maddubs_epi16(c.w[0], _mm256_set1_epi32(x4[0]));
    for (int q = 1; q < 8; ++q) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(c.w[q], _mm256_set1_epi32(x4[q])));
    s = _mm256_madd_epi16(s16, ones);
  }
  return start ? _mm256_add_epi32(s, _mm256_set1_epi32(start)) : s;
}

#include "qlinear256.h"

}  // namespace isa_avx2
#pragma GCC pop_options

// ===================================== AVX-VNNI =============================================

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace isa_avxvnni {

// AVX2's layout with 256-bit vpdpbusd: unsigned codes x the row's signed activation quad. INT8
// codes are made unsigned by +128 (xor 0x80), which adds 128 * xs: the integer sum starts from
// -zp * xs (as on the AVX-512 path; the same integers, so the same bits).
struct Codes {
  __m256i w[8];
};
constexpr int32_t ZP_INT8 = 128;

inline void load_int8(const uint8_t* t, int h, Codes& c) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int q = 0; q < 8; ++q)
    c.w[q] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 * q + 32 * h)), flip);
}

template <int F>
inline __m256i block_sum(const Codes& c, const int32_t* x4, int32_t start) {
  __m256i s = _mm256_set1_epi32(start);
  for (int q = 0; q < 8; ++q) s = _mm256_dpbusd_avx_epi32(s, c.w[q], _mm256_set1_epi32(x4[q]));
  return s;
}

#include "qlinear256.h"

}  // namespace isa_avxvnni
#pragma GCC pop_options

// ====================================== AVX-512 =============================================

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
  if (n < 32) return isa_scalar_argmax(x, n);
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
  if (nan) return isa_scalar_argmax(x, n);
  const float m = _mm512_reduce_max_ps(best);
  const __mmask16 is_m = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  int64_t r = _mm512_mask_reduce_min_epi32(is_m, at);
  float bv = m;
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > bv) { bv = x[i]; r = i; }
  }
  return r;
}

}  // namespace isa_avx512
#pragma GCC pop_options

// ===================================== dispatch =============================================

bool cpu_has(Isa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case AVX512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") &&
             __builtin_cpu_supports("fma");
    case AVXVNNI:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avxvnni");
    case AVX2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    default:
      return true;
  }
}

Isa best_isa() {
  for (int i = N_ISA - 1; i > 0; --i)
    if (cpu_has(static_cast<Isa>(i))) return static_cast<Isa>(i);
  return SCALAR;
}

Isa initial_isa() {
  const char* env = std::getenv("EAGLE3_ISA");
  if (env != nullptr && *env != '\0') {
    for (int i = 0; i < N_ISA; ++i)
      if (std::string(env) == ISA_NAMES[i]) {
        TORCH_CHECK(cpu_has(static_cast<Isa>(i)), "EAGLE3_ISA=", env, ": this CPU cannot run it; use one of ",
                    cpu_has(AVX512) ? "avx512, " : "", cpu_has(AVXVNNI) ? "avxvnni, " : "",
                    cpu_has(AVX2) ? "avx2, " : "", "scalar");
        return static_cast<Isa>(i);
      }
    TORCH_CHECK(false, "EAGLE3_ISA=", env, " is not a path; use scalar, avx2, avxvnni or avx512");
  }
  return best_isa();
}

std::atomic<int>& current_isa() {
  static std::atomic<int> isa{initial_isa()};
  return isa;
}

std::string isa_name() { return ISA_NAMES[current_isa().load()]; }

std::vector<std::string> isa_paths() {  // every path this CPU can run, best first
  std::vector<std::string> out;
  for (int i = N_ISA - 1; i >= 0; --i)
    if (cpu_has(static_cast<Isa>(i))) out.push_back(ISA_NAMES[i]);
  return out;
}

std::string set_isa(const std::string& name) {
  for (int i = 0; i < N_ISA; ++i)
    if (name == ISA_NAMES[i]) {
      TORCH_CHECK(cpu_has(static_cast<Isa>(i)), "this CPU cannot run the ", name, " path");
      return ISA_NAMES[current_isa().exchange(i)];
    }
  TORCH_CHECK(false, "unknown path ", name, "; use scalar, avx2, avxvnni or avx512");
  return "";
}

// ===================================== the ops ==============================================

int current_path();

// y (M, N) = x (M, K) W^T for packed W (checked by `check_linear`), into y.
void packed_into(const float* x, int64_t M, int64_t K, const at::Tensor& w, const at::Tensor& scale,
                 const at::Tensor& offset, int64_t fmt, int64_t N, float* y) {
  const int64_t nb = K / 32;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xsd;
  thread_local std::vector<int32_t> xs;
  if (static_cast<int64_t>(xq.size()) < M * K) xq.resize(M * K);
  if (static_cast<int64_t>(xd.size()) < M * nb) { xd.resize(M * nb); xsd.resize(M * nb); xs.resize(M * nb); }
  const int isa = current_isa().load(), fam = current_path();  // the packed matmul's, the float ops'
  auto quantize = fam == AVX512 ? isa_avx512::quantize_rows : fam == AVX2 ? isa_avx2::quantize_rows : isa_scalar::quantize_rows;
  quantize(x, M, K, xq.data(), xd.data(), xs.data(), xsd.data());
  QCall c{xq.data(), xd.data(), xsd.data(), xs.data(), M, K, nb, N,
          reinterpret_cast<const uint8_t*>(w.data_ptr()),
          reinterpret_cast<const uint16_t*>(scale.data_ptr()),
          offset.numel() ? reinterpret_cast<const uint16_t*>(offset.data_ptr()) : nullptr,
          fmt, fmt == INT4 && offset.numel() == 0 ? 8 : 0, y};
  at::parallel_for(0, N / 16, 1, [&](int64_t g0, int64_t g1) {
    if (isa == AVX512) isa_avx512::qlinear(c, g0, g1);
    else if (isa == AVXVNNI) isa_avxvnni::qlinear(c, g0, g1);
    else if (isa == AVX2) isa_avx2::qlinear(c, g0, g1);
    else isa_scalar::qlinear(c, g0, g1);
  });
}

template <typename W>
void run_float(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N) {
  const int isa = current_path();
  const int64_t nbk = isa == AVX512 ? isa_avx512::NB : isa == AVX2 ? isa_avx2::NB : isa_scalar::NB;
  at::parallel_for(0, (N + nbk - 1) / nbk, 16, [&](int64_t b0, int64_t b1) {
    if (isa == AVX512) isa_avx512::float_linear<W>(x, M, K, w, y, N, b0, b1);
    else if (isa == AVX2) isa_avx2::float_linear<W>(x, M, K, w, y, N, b0, b1);
    else isa_scalar::float_linear<W>(x, M, K, w, y, N, b0, b1);
  });
}

// What `wlinear` accepts for a weight in `fmt` with out_features N and in_features K.
void check_linear(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& offset, int64_t fmt,
                  int64_t group, int64_t N, int64_t K) {
  TORCH_CHECK(fmt >= F32 && fmt <= INT4, "wlinear: unknown weight format ", fmt);
  TORCH_CHECK(w.is_contiguous(), "wlinear: the weight must be contiguous");
  if (fmt == F32 || fmt == BF16) {
    const auto want = fmt == F32 ? at::kFloat : at::kBFloat16;
    TORCH_CHECK(w.scalar_type() == want && w.numel() == N * K, "wlinear: a ", fmt == F32 ? "float32" : "bfloat16",
                " weight must be (N, K) = (", N, ", ", K, ") ", fmt == F32 ? "float32" : "bfloat16");
    return;
  }
  TORCH_CHECK(K % 32 == 0, "wlinear: in_features must be a multiple of 32 for packed weights, got ", K);
  TORCH_CHECK(N % 16 == 0, "wlinear: out_features must be a multiple of 16 for packed weights, got ", N);
  TORCH_CHECK(group == 32, "wlinear: packed weights hold one scale per block of 32 inputs, got group ", group);
  TORCH_CHECK(w.scalar_type() == at::kByte || w.scalar_type() == at::kChar, "wlinear: packed codes must be uint8 or int8");
  const int64_t bytes = fmt == INT4 ? N * K / 2 : N * K;
  TORCH_CHECK(w.numel() == bytes, "wlinear: packed weight holds ", w.numel(), " bytes, expected ", bytes);
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.numel() == N * K / 32 && scale.is_contiguous(),
              "wlinear: scales must be (N/16, K/32, 16) float16");
  if (fmt == INT8) TORCH_CHECK(offset.numel() == 0, "wlinear: int8 weights take no offsets");
  if (offset.numel())
    TORCH_CHECK(offset.scalar_type() == at::kHalf && offset.numel() == N * K / 32 && offset.is_contiguous(),
                "wlinear: offsets must be (N/16, K/32, 16) float16");
}

// y (M, N) = x (M, K) W^T for a checked weight in `fmt`, into y.
void linear_into(const float* x, int64_t M, int64_t K, const at::Tensor& w, const at::Tensor& scale,
                 const at::Tensor& offset, int64_t fmt, int64_t N, float* y) {
  if (M == 0 || N == 0) return;
  if (fmt == F32) run_float<float>(x, M, K, w.data_ptr<float>(), y, N);
  else if (fmt == BF16) run_float<uint16_t>(x, M, K, reinterpret_cast<const uint16_t*>(w.data_ptr()), y, N);
  else packed_into(x, M, K, w, scale, offset, fmt, N, y);
}

at::Tensor wlinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                   const at::Tensor& offset, int64_t fmt, int64_t group, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "wlinear: x must be (M, K) float32");
  const int64_t M = x.size(0), K = x.size(1);
  check_linear(w, scale, offset, fmt, group, N, K);
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  linear_into(xc.data_ptr<float>(), M, K, w, scale, offset, fmt, N, y.data_ptr<float>());
  return y;
}

void attention_into(AttnArgs a, int64_t B, bool bf16);

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& mask, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 3,
              "attention takes q (B, nh, T, hd), k, v (B, nkv, S, hd), mask (B, T, S)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == v.scalar_type() &&
              (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16) &&
              mask.scalar_type() == at::kBool,
              "attention takes float32 q, float32 or bfloat16 k and v (the same), and a bool mask");
  const int64_t B = q.size(0), nh = q.size(1), T = q.size(2), hd = q.size(3);
  const int64_t nkv = k.size(1), S = k.size(2);
  TORCH_CHECK(nkv > 0 && nh % nkv == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(mask.size(0) == B && mask.size(1) == T && mask.size(2) == S, "mask must be (B, T, S)");
  auto out = at::empty({B, T, nh * hd}, q.options());
  AttnArgs a{q.data_ptr<float>(), k.data_ptr(), v.data_ptr(), mask.data_ptr<bool>(),
             out.data_ptr<float>(), T, nh, hd, S, nh / nkv,
             {q.stride(0), q.stride(1), q.stride(2)}, {k.stride(0), k.stride(1), k.stride(2)},
             {v.stride(0), v.stride(1), v.stride(2)}, {mask.stride(0), mask.stride(1), mask.stride(2)},
             static_cast<float>(scale), static_cast<float>(softcap), 1};
  attention_into(a, B, k.scalar_type() == at::kBFloat16);
  return out;
}

// Masked attention of B batches as `a` describes it (its hc set here), into a.out.
void attention_into(AttnArgs a, int64_t B, bool bf16) {
  // The heads sharing a key/value head are scored together, in chunks small enough to give
  // every thread work (one decode row of a GQA model has few key/value heads).
  a.hc = std::min<int64_t>(isa_scalar::HEAD_CHUNK, a.group);
  while (a.hc > 1 && B * isa_scalar::attention_units(a) < 2 * at::get_num_threads()) a.hc = (a.hc + 1) / 2;
  const int isa = current_path();
  at::parallel_for(0, B * isa_scalar::attention_units(a), 1, [&](int64_t i0, int64_t i1) {
    if (bf16) {
      if (isa == AVX512) isa_avx512::attention_rows<uint16_t>(a, i0, i1);
      else if (isa == AVX2) isa_avx2::attention_rows<uint16_t>(a, i0, i1);
      else isa_scalar::attention_rows<uint16_t>(a, i0, i1);
    } else {
      if (isa == AVX512) isa_avx512::attention_rows<float>(a, i0, i1);
      else if (isa == AVX2) isa_avx2::attention_rows<float>(a, i0, i1);
      else isa_scalar::attention_rows<float>(a, i0, i1);
    }
  });
}

// argmax over the last dimension of a float32 tensor (..., n), n > 0: int64 (...).
at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) > 0, "argmax takes float32 (..., n), n > 0");
  auto xc = x.contiguous();
  const int64_t n = x.size(-1), rows = xc.numel() / n;
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto out = at::empty(sizes, x.options().dtype(at::kLong));
  const float* p = xc.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const bool wide = current_path() == AVX512;
  for (int64_t r = 0; r < rows; ++r) o[r] = wide ? isa_avx512::argmax_row(p + r * n, n) : isa_scalar_argmax(p + r * n, n);
  return out;
}

// The path of the float kernels (norms, RoPE, attention, float weights): AVXVNNI runs AVX2's.
int current_path() {
  const int isa = current_isa().load();
  return isa == AVXVNNI ? AVX2 : isa;
}

// y = RMSNorm(x) row by row, x and y (M, H), w (H,).
void rms_norm_into(const float* xp, const float* wp, float* yp, int64_t M, int64_t H, double eps, bool gemma) {
  const int isa = current_path();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) {
    if (isa == AVX512) isa_avx512::rms_norm_rows(xp, wp, yp, M, H, e, gemma, r0, r1);
    else if (isa == AVX2) isa_avx2::rms_norm_rows(xp, wp, yp, M, H, e, gemma, r0, r1);
    else isa_scalar::rms_norm_rows(xp, wp, yp, M, H, e, gemma, r0, r1);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.dim() >= 1 &&
              w.dim() == 1 && w.size(0) == x.size(-1), "rms_norm takes float32 x (..., H) and w (H,)");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto y = at::empty_like(xc);
  const int64_t H = x.size(-1), M = H ? xc.numel() / H : 0;
  rms_norm_into(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), M, H, eps, gemma);
  return y;
}

// RoPE in place on the B x T x heads rows `a` describes.
void rope_into(const RopeArgs& a, int64_t B) {
  const int isa = current_path();
  at::parallel_for(0, B * a.T * a.heads, 256, [&](int64_t i0, int64_t i1) {
    if (isa == AVX512) isa_avx512::rope_rows(a, i0, i1);
    else if (isa == AVX2) isa_avx2::rope_rows(a, i0, i1);
    else isa_scalar::rope_rows(a, i0, i1);
  });
}

void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope_ takes float32 x, cos, sin");
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0,
              "rope_ takes x (B, T, heads, hd) with hd even and contiguous");
  const int64_t B = x.size(0), T = x.size(1), heads = x.size(2), hd = x.size(3);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
              cos.size(-1) == hd && cos.size(-2) == T && (cos.dim() == 2 || (cos.dim() == 3 && cos.size(0) == B)),
              "rope_ takes contiguous cos, sin (T, hd) or (B, T, hd)");
  rope_into(RopeArgs{x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), T, heads, hd,
                     cos.dim() == 3 ? T * hd : 0, {x.stride(0), x.stride(1), x.stride(2)}}, B);
}

// y (M, I) = silu(gate) * up for gu = [gate | up] (M, 2I).
void silu_mul_into(const float* gp, float* yp, int64_t M, int64_t I) {
  const int isa = current_path();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    if (isa == AVX512) isa_avx512::silu_mul_rows(gp, yp, I, r0, r1);
    else if (isa == AVX2) isa_avx2::silu_mul_rows(gp, yp, I, r0, r1);
    else isa_scalar::silu_mul_rows(gp, yp, I, r0, r1);
  });
}

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.scalar_type() == at::kFloat && gu.dim() >= 1 && gu.size(-1) % 2 == 0,
              "silu_mul takes float32 [gate | up] (..., 2I)");
  auto gc = gu.contiguous();
  const int64_t I = gu.size(-1) / 2, M = I ? gc.numel() / (2 * I) : 0;
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto y = at::empty(sizes, gu.options());
  silu_mul_into(gc.data_ptr<float>(), y.data_ptr<float>(), M, I);
  return y;
}

// cache[b, h, pos[t]] = x[b, t, h] for x (B, T, heads, hd) float32 (strides xs for b, t, h;
// head_dim contiguous) and a float32 or bfloat16 cache (B, heads, S, hd): what index_copy_ of
// x cast to the cache's dtype writes (bfloat16 rounds to nearest even, as `Tensor.to` does),
// without the temporaries. pos: T checked slots.
void write_kv(at::Tensor& cache, const float* xp, const int64_t* xs, int64_t B, int64_t T, int64_t heads,
              const int64_t* pos) {
  const int64_t hd = cache.size(3);
  const bool bf16 = cache.scalar_type() == at::kBFloat16;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const float* src = xp + b * xs[0] + t * xs[1] + h * xs[2];
        const int64_t at = b * cache.stride(0) + h * cache.stride(1) + pos[t] * cache.stride(2);
        if (bf16) {
          c10::BFloat16* dst = cache.data_ptr<c10::BFloat16>() + at;
          for (int64_t d = 0; d < hd; ++d) dst[d] = c10::BFloat16(src[d]);
        } else {
          std::memcpy(cache.data_ptr<float>() + at, src, hd * sizeof(float));
        }
      }
}

// One projection of `decoder_layer`: [w, scale, offset, bias] as a QLinear holds them (bias
// empty when none), its format and out_features. y (M, N) = x W^T (+ bias), the bias added after
// (as `y + bias` adds it).
void project_into(const float* x, int64_t M, int64_t K, at::TensorList p, int64_t fmt, int64_t N, float* y) {
  TORCH_CHECK(p.size() == 4, "decoder_layer: a projection is [w, scale, offset, bias]");
  check_linear(p[0], p[1], p[2], fmt, 32, N, K);
  linear_into(x, M, K, p[0], p[1], p[2], fmt, N, y);
  if (p[3].numel()) {
    TORCH_CHECK(p[3].numel() == N && p[3].scalar_type() == at::kFloat, "decoder_layer: a bias must be (N,) float32");
    auto bc = p[3].contiguous();
    const float* bp = bc.data_ptr<float>();
    for (int64_t r = 0; r < M; ++r)
      for (int64_t j = 0; j < N; ++j) y[r * N + j] += bp[j];
  }
}

// A Llama-family pre-norm layer on the row-invariant path, as one op: the same kernels, in the
// same order, as `targets.decoder.Block.forward` calls them one by one (RMSNorm, qkv, RoPE on q
// and k, K/V written at input_pos, attention over slots [0, kv_len), o, residual, RMSNorm,
// gate_up, SwiGLU, down, residual), so the same bits; what it saves is the ~20 Python-level
// ops per layer around them, and it runs the kernels on raw buffers (one workspace per thread,
// no tensor per step but the output). h (B, T, H); cos, sin (T, hd); caches (B, nkv, S_max, hd);
// mask (T, kv_len) bool. projections: qkv, o, gate_up, down; fmts, ns: their formats and N.
// The residual stream h is also what the attention output is added to.
at::Tensor decoder_layer(const at::Tensor& h, const at::Tensor& ln1, const at::Tensor& ln2,
                         at::TensorList qkv_p, at::TensorList o_p, at::TensorList gu_p,
                         at::TensorList down_p, at::IntArrayRef fmts, at::IntArrayRef ns,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& input_pos, const at::Tensor& mask,
                         int64_t kv_len, int64_t nh, int64_t nkv, double eps, double scale,
                         double softcap, const std::optional<at::Tensor>& attn_in) {
  TORCH_CHECK(h.dim() == 3 && h.scalar_type() == at::kFloat, "decoder_layer: h must be (B, T, H) float32");
  TORCH_CHECK(fmts.size() == 4 && ns.size() == 4, "decoder_layer: four projections");
  const int64_t B = h.size(0), T = h.size(1), H = h.size(2), M = B * T;
  const int64_t hd = k_cache.size(3), nq = ns[0], I = ns[2] / 2;
  TORCH_CHECK(nkv > 0 && nh % nkv == 0 && ns[0] == (nh + 2 * nkv) * hd && ns[1] == H && ns[3] == H &&
              ns[2] % 2 == 0, "decoder_layer: projection sizes do not match the heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == B && k_cache.size(1) == nkv && kv_len <= k_cache.size(2) &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
              k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && hd % 2 == 0,
              "decoder_layer: caches must be (B, nkv, S, hd) with S >= kv_len, hd even and contiguous");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16,
              "decoder_layer: the cache must be float32 or bfloat16");
  TORCH_CHECK(mask.dim() == 2 && mask.size(0) == T && mask.size(1) == kv_len && mask.scalar_type() == at::kBool,
              "decoder_layer: mask must be (T, kv_len) bool");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == hd && cos.sizes() == sin.sizes() &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "decoder_layer: cos, sin must be (T, hd) float32");
  TORCH_CHECK(input_pos.dim() == 1 && input_pos.scalar_type() == at::kLong && input_pos.size(0) == T,
              "decoder_layer: input_pos must be (T,) int64");
  TORCH_CHECK(ln1.scalar_type() == at::kFloat && ln2.scalar_type() == at::kFloat && ln2.numel() == H,
              "decoder_layer: norm weights must be (H,) float32");
  const bool given = attn_in.has_value() && attn_in->defined();
  if (given) {
    TORCH_CHECK(attn_in->dim() == 3 && attn_in->size(0) == B && attn_in->size(1) == T &&
                attn_in->scalar_type() == at::kFloat, "decoder_layer: attn_in must be (B, T, Hin) float32");
  } else {
    TORCH_CHECK(ln1.numel() == H, "decoder_layer: norm weights must be (H,) float32");
  }
  const int64_t Hin = given ? attn_in->size(2) : H;
  auto pc = input_pos.contiguous();
  const int64_t* pos = pc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < k_cache.size(2), "decoder_layer: input_pos ", pos[t], " is outside the cache");
  auto hc = h.contiguous(), cc = cos.contiguous(), sc = sin.contiguous(), mc = mask.contiguous();
  auto w1 = ln1.contiguous(), w2 = ln2.contiguous();
  const float* hp = hc.data_ptr<float>();

  // One workspace per calling thread, grown once: x, qkv, attention out, h1, x2, gate_up, act, y.
  // (A call over many rows, which decode and verify steps never are, takes its own buffer
  // rather than growing the kept one.)
  thread_local std::vector<float> ws;
  std::vector<float> once;
  const int64_t need = M * (Hin + nq + nh * hd + 3 * H + 3 * I);
  if (need > (int64_t{1} << 20)) once.resize(need);
  else if (static_cast<int64_t>(ws.size()) < need) ws.resize(need);
  float* x = need > (int64_t{1} << 20) ? once.data() : ws.data();
  float* qkv = x + M * Hin;
  float* att = qkv + M * nq;
  float* h1 = att + M * nh * hd;
  float* x2 = h1 + M * H;
  float* gu = x2 + M * H;
  float* act = gu + M * 2 * I;
  float* y = act + M * I;
  at::Tensor xin;
  const float* xp = x;
  if (given) {
    xin = attn_in->contiguous();
    xp = xin.data_ptr<float>();
  } else {
    rms_norm_into(hp, w1.data_ptr<float>(), x, M, H, eps, false);  // (M, H)
  }
  project_into(xp, M, Hin, qkv_p, fmts[0], nq, qkv);  // (M, (nh + 2 nkv) hd): q | k | v per row
  const int64_t rs[3] = {T * nq, nq, hd};  // strides of q, k, v as (B, T, heads, hd)
  rope_into(RopeArgs{qkv, cc.data_ptr<float>(), sc.data_ptr<float>(), T, nh, hd, 0, {rs[0], rs[1], rs[2]}}, B);
  rope_into(RopeArgs{qkv + nh * hd, cc.data_ptr<float>(), sc.data_ptr<float>(), T, nkv, hd, 0, {rs[0], rs[1], rs[2]}}, B);
  write_kv(k_cache, qkv + nh * hd, rs, B, T, nkv, pos);
  write_kv(v_cache, qkv + (nh + nkv) * hd, rs, B, T, nkv, pos);
  AttnArgs a{qkv, k_cache.data_ptr(), v_cache.data_ptr(), mc.data_ptr<bool>(), att, T, nh, hd, kv_len, nh / nkv,
             {T * nq, hd, nq}, {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)},
             {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)}, {0, mc.stride(0), mc.stride(1)},
             static_cast<float>(scale), static_cast<float>(softcap), 1};
  attention_into(a, B, k_cache.scalar_type() == at::kBFloat16);  // (B, T, nh hd)
  project_into(att, M, nh * hd, o_p, fmts[1], H, y);
  for (int64_t i = 0; i < M * H; ++i) h1[i] = hp[i] + y[i];
  rms_norm_into(h1, w2.data_ptr<float>(), x2, M, H, eps, false);
  project_into(x2, M, H, gu_p, fmts[2], 2 * I, gu);  // (M, 2I)
  silu_mul_into(gu, act, M, I);
  project_into(act, M, I, down_p, fmts[3], H, y);
  auto out = at::empty({B, T, H}, h.options());
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < M * H; ++i) op[i] = h1[i] + y[i];
  return out;
}

}  // namespace

TORCH_LIBRARY(eagle3, m) {
  m.def("decoder_layer(Tensor h, Tensor ln1, Tensor ln2, Tensor[] qkv, Tensor[] o, Tensor[] gate_up, "
        "Tensor[] down, int[] fmts, int[] ns, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor input_pos, Tensor mask, int kv_len, int nh, int nkv, float eps, float scale, float softcap, "
        "Tensor? attn_in=None) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool gemma) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("wlinear(Tensor x, Tensor w, Tensor scale, Tensor offset, int fmt, int group, int N) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, float softcap) -> Tensor");
  m.def("isa() -> str", &isa_name);
  m.def("isa_paths() -> str[]", &isa_paths);
  m.def("set_isa(str name) -> str", &set_isa);
}

TORCH_LIBRARY_IMPL(eagle3, CPU, m) {
  m.impl("wlinear", &wlinear);
  m.impl("attention", &attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("decoder_layer", &decoder_layer);
  m.impl("argmax", &argmax);
}
