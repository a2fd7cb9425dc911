// The packed matmul of the 256-bit paths (AVX2, AVX-VNNI), written once and included by
// kernels.cpp inside each path's namespace (and `#pragma GCC target`).
//
// 8 columns (half h of a 16-column group) at a time; per row and block an exact int32 sum, then
// the fp32 epilogue in block order as on every path. Needs from the including scope:
//   ZP_INT8                          the zero point an INT8 sum carries (0, or 128 after +128)
//   load_int8(t, h, Codes&)          one half-block of INT8 codes
//   block_sum<F>(Codes, x4, start)   the block's integer sum, starting from `start`
// and the Codes type (w[8]: the unsigned operands; sw[8]: what INT8 may need besides).

template <int F>  // 0: INT8, 1: INT4 with offsets (Q4_1), 2: INT4 without (Q4_0)
void qlinear_f(const QCall& c, int64_t g0, int64_t g1) {
  constexpr int64_t tile = F == 0 ? 512 : 256;
  constexpr int32_t zp = F == 0 ? ZP_INT8 : F == 2 ? 8 : 0;
  const int64_t M = c.M, nb = c.nb, K = c.K;
  float* acc = row_accumulators(M);
  const __m256i nib = _mm256_set1_epi8(15);
  for (int64_t g = g0; g < g1; ++g) {
    std::fill(acc, acc + M * 16, 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* t = c.codes + (g * nb + b) * tile;
      const uint16_t* dp = c.d + (g * nb + b) * 16;
      prefetch_ahead(c, t, (g * nb + b) * 16, tile);
      for (int h = 0; h < 2; ++h) {
        Codes w;
        if (F == 0) {
          load_int8(t, h, w);
        } else {
          for (int p = 0; p < 4; ++p) {
            const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 * p + 32 * h));
            w.w[p] = _mm256_and_si256(r, nib);
            w.w[4 + p] = _mm256_and_si256(_mm256_srli_epi16(r, 4), nib);
          }
        }
        const __m256 vd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dp + 8 * h)));
        __m256 vm = _mm256_setzero_ps();
        if (F == 1) vm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c.m + (g * nb + b) * 16 + 8 * h)));
        float* ap = acc + 8 * h;
        for (int64_t r = 0; r < M; ++r, ap += 16) {
          const int32_t* x4 = reinterpret_cast<const int32_t*>(c.xq + r * K + b * 32);
          const int64_t rb = r * nb + b;
          const __m256i s = block_sum<F>(w, x4, zp ? -zp * c.xs[rb] : 0);
          __m256 a = _mm256_loadu_ps(ap);
          a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_mul_ps(vd, _mm256_set1_ps(c.xd[rb])), _mm256_cvtepi32_ps(s)));
          if (F == 1) a = _mm256_add_ps(a, _mm256_mul_ps(vm, _mm256_set1_ps(c.xsd[rb])));
          _mm256_storeu_ps(ap, a);
        }
      }
    }
    for (int64_t r = 0; r < M; ++r) std::memcpy(c.y + r * c.N + g * 16, acc + r * 16, 64);
  }
}

void qlinear(const QCall& c, int64_t g0, int64_t g1) {
  if (c.fmt == INT8) qlinear_f<0>(c, g0, g1);
  else if (c.m) qlinear_f<1>(c, g0, g1);
  else qlinear_f<2>(c, g0, g1);
}
