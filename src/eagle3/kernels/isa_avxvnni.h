// The AVX-VNNI path: AVX2 with 256-bit vpdpbusd (Alder Lake and later client CPUs, which have no
// AVX-512). Its packed matmul is its own; every float kernel is the AVX2 path's. Included by
// kernels.cpp inside its anonymous namespace, after isa_avx2.h.

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace isa_avxvnni {

// AVX2's layout with 256-bit vpdpbusd: unsigned codes x the row's signed activation quad,
// summed in int32 from the start. INT8 codes are made unsigned by +128 (xor 0x80), which adds
// 128 * xs: the integer sum starts from -zp * xs (as on the AVX-512 path; the same integers, so
// the same bits).
struct Quad {  // 8 columns x 4 inputs, unsigned
  __m256i u;
};
constexpr int32_t ZP_INT8 = 128;

inline Quad int8_quad(const uint8_t* p) {
  return Quad{_mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                               _mm256_set1_epi8(static_cast<char>(0x80)))};
}

template <int F>
inline __m256i sum_start(int32_t start) { return _mm256_set1_epi32(start); }

template <int F>
inline __m256i sum_step(__m256i s, const Quad& w, int32_t x4) {
  return _mm256_dpbusd_avx_epi32(s, w.u, _mm256_set1_epi32(x4));
}

template <int F>
inline __m256i sum_finish(__m256i s, int32_t) { return s; }

#include "qlinear256.h"

}  // namespace isa_avxvnni
#pragma GCC pop_options

namespace isa_avxvnni {  // outside the target pragma: runs on any CPU
inline bool supported() { return isa_avx2::supported() && __builtin_cpu_supports("avxvnni"); }
const Kernels TABLE{"avxvnni", supported, qlinear, isa_avx2::quantize_rows, isa_avx2::float_linear<float>,
                    isa_avx2::float_linear<uint16_t>, isa_avx2::NB, isa_avx2::attention_rows<float>,
                    isa_avx2::attention_rows<uint16_t>, isa_avx2::rms_norm_rows, isa_avx2::rope_rows,
                    isa_avx2::silu_mul_rows, isa_avx2::argmax_row};
}  // namespace isa_avxvnni
