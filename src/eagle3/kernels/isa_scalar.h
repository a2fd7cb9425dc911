// The scalar path: plain C++ on any x86-64 CPU, the reference every vector path equals bit for
// bit. Included by kernels.cpp inside its anonymous namespace, after common.h.

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

// This thread's fp32 accumulators for M rows x 16 columns (grown once, never freed).
inline float* row_accumulators(int64_t M) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < M * 16) buf.resize(M * 16);
  return buf.data();
}

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

inline bool supported() { return true; }
const Kernels TABLE{"scalar", supported, qlinear, quantize_rows, float_linear<float>, float_linear<uint16_t>, NB,
                    attention_rows<float>, attention_rows<uint16_t>, rms_norm_rows, rope_rows, silu_mul_rows,
                    scalar_argmax};
}  // namespace isa_scalar
