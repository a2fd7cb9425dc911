// The packed matmul of the 256-bit paths (AVX2, AVX-VNNI), written once and included by each
// path's file inside its namespace (and `#pragma GCC target`).
//
// One half h (8 columns) of a 16-column group at a time, through all of its blocks, for up to
// ROWS rows whose fp32 accumulators and running integer sums stay in registers: each quad of
// codes (8 columns x 4 inputs) is loaded and decoded once and applied to every row of the chunk,
// the rows' independent chains side by side. Per row and block an exact int32 sum, then the fp32
// epilogue in block order as on every path. The first pass over a group (h = 0, the first rows)
// streams its codes from memory, prefetching ahead; the rest find them in L1. A call of one or
// two rows (a decode step) takes both halves in one pass instead, so that each tile is read once.
// Needs from the including scope:
//   Quad, int8_quad(p)                one quad of INT8 codes as the path multiplies them
//   ZP_INT8                           the zero point an INT8 sum carries (0, or 128 after +128)
//   sum_start<F>(start), sum_step<F>(s, quad, x4), sum_finish<F>(s, start)
//                                     a block's integer sum: -zp * xs + sum of codes x activations

constexpr int ROWS = 4;

// Quad q of half h of a block's tile: inputs 4q .. 4q + 3 (INT4: the low nibbles of byte quad q
// for q < 4, the high nibbles of byte quad q - 4 after).
template <int F>
inline Quad quad_codes(const uint8_t* t, int q, int h, __m256i nib) {
  if (F == 0) return int8_quad(t + 64 * q + 32 * h);
  const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 64 * (q & 3) + 32 * h));
  Quad w;
  w.u = _mm256_and_si256(q < 4 ? r : _mm256_srli_epi16(r, 4), nib);
  return w;
}

template <int F, int R, int HS>  // F 0: INT8, 1: INT4 with offsets (Q4_1), 2: INT4 without (Q4_0)
void q_rows(const QCall& c, int64_t g, int h0, int64_t r0, bool stream) {
  // Halves h0 .. h0 + HS - 1 of group g for rows r0 .. r0 + R - 1, through all blocks.
  constexpr int64_t tile = F == 0 ? 512 : 256;
  constexpr int32_t zp = F == 0 ? ZP_INT8 : F == 2 ? 8 : 0;
  const int64_t nb = c.nb, K = c.K;
  const __m256i nib = _mm256_set1_epi8(15);
  const int32_t* x4[R];
  __m256 acc[HS][R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    x4[i] = reinterpret_cast<const int32_t*>(c.xq + (r0 + i) * K);
    for (int hh = 0; hh < HS; ++hh) acc[hh][i] = _mm256_setzero_ps();
  }
  const uint8_t* t = c.codes + g * nb * tile;
  const uint16_t* dp = c.d + g * nb * 16 + 8 * h0;
  const uint16_t* mp = F == 1 ? c.m + g * nb * 16 + 8 * h0 : nullptr;
  for (int64_t b = 0; b < nb; ++b, t += tile) {
    if (stream) prefetch_ahead(c, t, (g * nb + b) * 16, tile);
    int32_t start[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) start[i] = zp ? -zp * c.xs[(r0 + i) * nb + b] : 0;
#pragma GCC unroll 2
    for (int hh = 0; hh < HS; ++hh) {
      __m256i s[R];
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) s[i] = sum_start<F>(start[i]);
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) {
        const Quad w = quad_codes<F>(t, q, h0 + hh, nib);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) s[i] = sum_step<F>(s[i], w, x4[i][8 * b + q]);
      }
      const __m256 vd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dp + b * 16 + 8 * hh)));
      __m256 vm = _mm256_setzero_ps();
      if (F == 1) vm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mp + b * 16 + 8 * hh)));
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const int64_t rb = (r0 + i) * nb + b;
        const __m256 isum = _mm256_cvtepi32_ps(sum_finish<F>(s[i], start[i]));
        acc[hh][i] = _mm256_add_ps(acc[hh][i], _mm256_mul_ps(_mm256_mul_ps(vd, _mm256_set1_ps(c.xd[rb])), isum));
        if (F == 1) acc[hh][i] = _mm256_add_ps(acc[hh][i], _mm256_mul_ps(vm, _mm256_set1_ps(c.xsd[rb])));
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
    for (int hh = 0; hh < HS; ++hh) _mm256_storeu_ps(c.y + (r0 + i) * c.N + g * 16 + 8 * (h0 + hh), acc[hh][i]);
}

template <int F>
void qlinear_f(const QCall& c, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    if (c.M <= 2) {  // both halves in one pass over the blocks: each tile read once
      if (c.M == 1) q_rows<F, 1, 2>(c, g, 0, 0, true);
      else q_rows<F, 2, 2>(c, g, 0, 0, true);
      continue;
    }
    for (int h = 0; h < 2; ++h)
      for (int64_t r0 = 0; r0 < c.M; r0 += ROWS) {
        const bool stream = h == 0 && r0 == 0;
        switch (std::min<int64_t>(ROWS, c.M - r0)) {
          case 1: q_rows<F, 1, 1>(c, g, h, r0, stream); break;
          case 2: q_rows<F, 2, 1>(c, g, h, r0, stream); break;
          case 3: q_rows<F, 3, 1>(c, g, h, r0, stream); break;
          default: q_rows<F, 4, 1>(c, g, h, r0, stream); break;
        }
      }
  }
}

void qlinear(const QCall& c, int64_t g0, int64_t g1) {
  if (c.fmt == INT8) qlinear_f<0>(c, g0, g1);
  else if (c.m) qlinear_f<1>(c, g0, g1);
  else qlinear_f<2>(c, g0, g1);
}
