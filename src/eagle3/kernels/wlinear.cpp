// Weight-stationary, row-invariant linear layers for small M on x86 CPUs.
//
//   y (M, N) = x (M, K) @ W^T,   W in one of four formats (see `Format`).
//
// Why: speculative verification runs K+1 rows through every linear layer. Stock CPU
// kernels either stream the weights once per row (cost grows with M) or choose a
// different summation order for different M (a row's result then changes with the
// batch, and speculative output stops being bit-identical to plain decoding). Here each
// weight block is read and unpacked once per call and applied to every row, and row m's
// result depends on x[m] and W only: the same instructions run on it whatever M is, and
// each output column is computed by one thread.
//
// F32 runs AVX-512 FMAs on W as stored (N, K). BF16 / INT8 / INT4 run on AMX: activations
// are rounded to bf16 once, weight codes are expanded into bf16 tiles (integers up to 255
// are exact in bf16) and multiplied in fp32 by the tile unit; per-group scales and
// offsets are applied in fp32 afterwards, so the codes are used exactly as stored.
//
// Packed layouts (written by eagle3/kernels/__init__.py, `pack`): the AMX formats store W
// as (N/16, K/32) tiles; a tile holds 16 rows r (input pairs k = 32t + 2r + p) of 16
// columns n, each an input pair p = 0, 1, i.e. the B layout of TDPBF16PS.
//   BF16: 512 bf16 per tile.  INT8: 512 int8 codes per tile.
//   INT4: 256 bytes per tile: 4 runs of 32 little-endian words; word l of run j holds
//         rows 4j, 4j+1, 4j+2, 4j+3 of lane l in nibbles 0..3, lane l = 2n + p.
// scale, offset: (K/G, N) fp32; w = code * scale (INT8) or code * scale + offset (INT4).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Format : int64_t { F32 = 0, BF16 = 1, INT8 = 2, INT4 = 3 };

// ---- F32: 16-lane dot products over K, reduced in a fixed order ----------------------

constexpr int64_t NB = 4;  // weight rows per block
constexpr int64_t MT = 6;  // activation rows per register tile (NB * MT accumulators)

template <int MR, int NR>
inline void dot_tile(const float* x, int64_t K, const float* w, float* y, int64_t N) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 live = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_maskz_loadu_ps(live, w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      __m512 xv = _mm512_maskz_loadu_ps(live, x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int NR>
void dot_rows(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + MT <= M; m += MT) dot_tile<MT, NR>(x + m * K, K, w, y + m * N, N);
  const float* xm = x + m * K;
  float* ym = y + m * N;
  switch (M - m) {
    case 5: dot_tile<5, NR>(xm, K, w, ym, N); break;
    case 4: dot_tile<4, NR>(xm, K, w, ym, N); break;
    case 3: dot_tile<3, NR>(xm, K, w, ym, N); break;
    case 2: dot_tile<2, NR>(xm, K, w, ym, N); break;
    case 1: dot_tile<1, NR>(xm, K, w, ym, N); break;
    default: break;
  }
}

void f32_linear(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N) {
  at::parallel_for(0, (N + NB - 1) / NB, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * NB;
      const float* wb = w + n * K;
      switch (std::min(NB, N - n)) {
        case 4: dot_rows<4>(x, M, K, wb, y + n, N); break;
        case 3: dot_rows<3>(x, M, K, wb, y + n, N); break;
        case 2: dot_rows<2>(x, M, K, wb, y + n, N); break;
        default: dot_rows<1>(x, M, K, wb, y + n, N); break;
      }
    }
  });
}

// ---- AMX: bf16 tiles ------------------------------------------------------------------

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {
  // Linux hands out the AMX register state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Expand one int4 tile (256 bytes: 4 runs of 32 words, word i of run j holding rows
// 4j..4j+3 of lane i, one nibble each) into 16 x 32 bf16 (1 KiB) at dst. Each code q becomes
// the bf16 of 128 + q, whose bits are 0x4300 | q (integers 128..255 are exact in bf16): one
// ternary-logic op per row, no table; the kernel subtracts the 128 in fp32 afterwards.
inline void expand_int4(const uint8_t* src, uint16_t* dst) {
  const __m512i nib = _mm512_set1_epi16(0xF), base = _mm512_set1_epi16(0x4300);
  for (int j = 0; j < 4; ++j) {
    const __m512i w = _mm512_loadu_si512(src + 64 * j);
    uint16_t* d = dst + 128 * j;
    _mm512_storeu_si512(d, _mm512_ternarylogic_epi32(w, nib, base, 0xEA));  // (a & b) | c
    _mm512_storeu_si512(d + 32, _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), nib, base, 0xEA));
    _mm512_storeu_si512(d + 64, _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), nib, base, 0xEA));
    _mm512_storeu_si512(d + 96, _mm512_or_si512(_mm512_srli_epi16(w, 12), base));
  }
}

inline void expand_int8(const int8_t* src, uint16_t* dst) {
  for (int r = 0; r < 32; ++r) {  // 32 runs of 16 codes
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * r))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * r), (__m256i)_mm512_cvtneps_pbh(f));
  }
}

// The partial products of group g (its tpg tiles of 32 inputs) into tile C.
#define EAGLE3_GROUP(C, A, B, g)                                         \
  do {                                                                   \
    _tile_zero(C);                                                       \
    for (int64_t t = (g) * tpg; t < ((g) + 1) * tpg; ++t) {              \
      _tile_loadd(A, xt + t * 32, K * 2);                                \
      _tile_loadd(B, bt + t * 512, 64);                                  \
      _tile_dpbf16ps(C, A, B);                                           \
    }                                                                    \
  } while (0)

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                      const at::Tensor& offset, int64_t fmt, int64_t G, int64_t N) {
  TORCH_CHECK(amx_permitted(), "this CPU or kernel does not grant AMX tile state");
  const int64_t M = x.size(0), K = x.size(1), T = K / 32, groups = K / G, tpg = G / 32;
  const int64_t Mp = (M + 15) / 16 * 16;
  // Activations rounded to bf16 (nearest even), padded to whole 16-row tiles: padding rows
  // are zero and their results dropped (a tile row never influences another).
  std::vector<uint16_t> xb(Mp * K, 0);
  std::vector<float> xsum(M * groups, 0.f);  // per row and group: sum of the bf16 activations
  const float* xf = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; k += 16) {
      __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(xf + m * K + k));
      std::memcpy(xb.data() + m * K + k, &h, 32);
    }
    if (fmt == INT4)
      for (int64_t g = 0; g < groups; ++g) {  // 16 lanes over the group, then one fixed reduction
        __m512 s = _mm512_setzero_ps();
        for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
          __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.data() + m * K + k));
          s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
        xsum[m * groups + g] = _mm512_reduce_add_ps(s);
      }
  }
  auto y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const float* sp = fmt == BF16 ? nullptr : scale.data_ptr<float>();
  const float* op = fmt == INT4 ? offset.data_ptr<float>() : nullptr;

  at::parallel_for(0, N / 16, 4, [&](int64_t b0, int64_t b1) {
    // tmm0 = C (rows x 16 fp32), tmm4 = A (rows x 32 bf16), tmm6 = B (16 x 32 bf16). With
    // M < 16 the tiles hold only M rows: less to load and multiply, and no row's arithmetic
    // changes (rows are independent).
    const uint8_t rows = static_cast<uint8_t>(std::min<int64_t>(M, 16));
    TileConfig cfg;
    cfg.rows[0] = cfg.rows[4] = rows;
    cfg.rows[6] = 16;
    cfg.colsb[0] = cfg.colsb[4] = cfg.colsb[6] = 64;
    _tile_loadconfig(&cfg);
    thread_local std::vector<uint16_t> bbuf;  // one block's weight tiles, expanded
    thread_local std::vector<float> part;     // one group's partial products
    if (fmt != BF16 && bbuf.size() < static_cast<size_t>(T * 512)) bbuf.resize(T * 512);
    if (part.size() < 256) part.resize(256);
    uint16_t* bb = bbuf.data();  // raw pointers: every thread_local access costs a TLS lookup
    float* pp = part.data();
    alignas(64) float acc[256];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 16;
      const uint16_t* bt;
      if (fmt == BF16) {
        bt = reinterpret_cast<const uint16_t*>(w.data_ptr()) + b * T * 512;
      } else {
        for (int64_t t = 0; t < T; ++t) {
          if (fmt == INT4)
            expand_int4(reinterpret_cast<const uint8_t*>(w.data_ptr()) + (b * T + t) * 256,
                        bb + t * 512);
          else
            expand_int8(reinterpret_cast<const int8_t*>(w.data_ptr()) + (b * T + t) * 512,
                        bb + t * 512);
        }
        bt = bb;
      }
      for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
        const int64_t mr = std::min<int64_t>(16, M - m0);
        const uint16_t* xt = xb.data() + m0 * K;
        if (fmt == BF16) {  // one group: C is the result
          EAGLE3_GROUP(0, 4, 6, 0);
          _tile_stored(0, acc, 64);
        }
        for (int64_t g = 0; fmt != BF16 && g < groups; ++g) {
          EAGLE3_GROUP(0, 4, 6, g);
          _tile_stored(0, pp, 64);
          const __m512 s = _mm512_loadu_ps(sp + g * N + n0);
          // INT4 tiles hold 128 + code: offset - 128 scale takes the 128 back out.
          const __m512 o = fmt == INT4 ? _mm512_fnmadd_ps(s, _mm512_set1_ps(128.f), _mm512_loadu_ps(op + g * N + n0))
                                       : _mm512_setzero_ps();
          for (int64_t r = 0; r < mr; ++r) {
            __m512 a = g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(acc + 16 * r);
            a = _mm512_fmadd_ps(_mm512_loadu_ps(pp + 16 * r), s, a);
            if (fmt == INT4) a = _mm512_fmadd_ps(_mm512_set1_ps(xsum[(m0 + r) * groups + g]), o, a);
            _mm512_store_ps(acc + 16 * r, a);
          }
        }
        for (int64_t r = 0; r < mr; ++r)
          _mm512_storeu_ps(yp + (m0 + r) * N + n0, _mm512_load_ps(acc + 16 * r));
      }
    }
    _tile_release();
  });
  return y;
}

at::Tensor wlinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                   const at::Tensor& offset, int64_t fmt, int64_t group, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (M, K) float32");
  TORCH_CHECK(fmt >= F32 && fmt <= INT4, "unknown weight format ", fmt);
  TORCH_CHECK(w.is_contiguous(), "weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  auto xc = x.contiguous();
  if (fmt == F32) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.numel() == N * K, "F32 weight must be (N, K)");
    auto y = at::empty({M, N}, x.options());
    if (M > 0 && N > 0) f32_linear(xc.data_ptr<float>(), M, K, w.data_ptr<float>(), y.data_ptr<float>(), N);
    return y;
  }
  TORCH_CHECK(K % 32 == 0, "in_features must be a multiple of 32 for packed weights, got ", K);
  TORCH_CHECK(N % 16 == 0, "out_features must be a multiple of 16 for packed weights, got ", N);
  const int64_t G = fmt == BF16 ? K : group;
  TORCH_CHECK(G > 0 && K % G == 0 && G % 32 == 0, "group ", G, " must be a multiple of 32 dividing ", K);
  const int64_t bytes = fmt == INT4 ? N * K / 2 : fmt == INT8 ? N * K : N * K * 2;
  TORCH_CHECK(w.numel() * w.element_size() == bytes, "packed weight holds ", w.numel() * w.element_size(),
              " bytes, expected ", bytes);
  if (fmt != BF16) TORCH_CHECK(scale.numel() == (K / G) * N, "scale must be (K/G, N)");
  if (fmt == INT4) TORCH_CHECK(offset.numel() == (K / G) * N, "offset must be (K/G, N)");
  if (M == 0) return at::empty({0, N}, x.options());
  return amx_linear(xc, w, scale.contiguous(), offset.contiguous(), fmt, G, N);
}


// ---- attention: one query row at a time ------------------------------------------------
//
// out[b, t, h*hd:(h+1)*hd] = softmax(scale * q[b, h, t] . k[b, h/g, s] over s with
// mask[b, t, s]) @ v[b, h/g]. Masked keys are skipped, not zeroed, and the unmasked keys
// are visited in slot order, so a row's result depends only on its query and the keys it
// may see: the same in a (T > 1) verify as in a 1-row decode, whatever sits in the
// masked slots and however long the cache is.

inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// e^x for x <= 0 (and -inf -> 0): 2^n * p(r), r = x - n ln 2, degree-6 polynomial.
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& mask, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 3,
              "attention takes q (B, nh, T, hd), k, v (B, nkv, S, hd), mask (B, T, S)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
              v.scalar_type() == at::kFloat && mask.scalar_type() == at::kBool,
              "attention takes float32 q, k, v and a bool mask");
  const int64_t B = q.size(0), nh = q.size(1), T = q.size(2), hd = q.size(3);
  const int64_t nkv = k.size(1), S = k.size(2), group = nh / nkv;
  TORCH_CHECK(nh % nkv == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "head_dim must be contiguous");
  auto out = at::empty({B, T, nh * hd}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, B * nh * T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> sbuf(S + 16);
    std::vector<int32_t> keep(S);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (nh * T), h = (i / T) % nh, t = i % T, kh = h / group;
      const float* qr = qp + b * q.stride(0) + h * q.stride(1) + t * q.stride(2);
      const float* kb = kp + b * k.stride(0) + kh * k.stride(1);
      const float* vb = vp + b * v.stride(0) + kh * v.stride(1);
      const bool* mr = mp + b * mask.stride(0) + t * mask.stride(1);
      int64_t n = 0;
      for (int64_t s = 0; s < S; ++s)
        if (mr[s * mask.stride(2)]) keep[n++] = static_cast<int32_t>(s);
      float* o = op + (b * T + t) * nh * hd + h * hd;
      if (n == 0) {
        std::memset(o, 0, hd * sizeof(float));
        continue;
      }
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const float* kr = kb + keep[j] * k.stride(2);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < hd; d += 16) {
          const __mmask16 live = lanes(hd - d);
          acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, qr + d), _mm512_maskz_loadu_ps(live, kr + d), acc);
        }
        float x = _mm512_reduce_add_ps(acc) * sc;
        if (cap > 0.f) x = std::tanh(x / cap) * cap;
        sbuf[j] = x;
        mx = std::max(mx, x);
      }
      for (int64_t j = n; j < (n + 15) / 16 * 16; ++j) sbuf[j] = -INFINITY;
      const __m512 vmx = _mm512_set1_ps(mx);
      for (int64_t j = 0; j < n; j += 16)
        _mm512_storeu_ps(sbuf.data() + j, exp_neg(_mm512_sub_ps(_mm512_loadu_ps(sbuf.data() + j), vmx)));
      float denom = 0.f;
      for (int64_t j = 0; j < n; ++j) denom += sbuf[j];
      const float inv = 1.f / denom;
      for (int64_t d = 0; d < hd; d += 16) {
        const __mmask16 live = lanes(hd - d);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; ++j)
          acc = _mm512_fmadd_ps(_mm512_set1_ps(sbuf[j]), _mm512_maskz_loadu_ps(live, vb + keep[j] * v.stride(2) + d), acc);
        _mm512_mask_storeu_ps(o + d, live, _mm512_mul_ps(acc, _mm512_set1_ps(inv)));
      }
    }
  });
  return out;
}

bool amx_available() { return amx_permitted(); }

}  // namespace

TORCH_LIBRARY(eagle3, m) {
  m.def("wlinear(Tensor x, Tensor w, Tensor scale, Tensor offset, int fmt, int group, int N) "
        "-> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, float softcap) -> Tensor");
  m.def("amx_available() -> bool", &amx_available);
}

TORCH_LIBRARY_IMPL(eagle3, CPU, m) {
  m.impl("wlinear", &wlinear);
  m.impl("attention", &attention);
}
