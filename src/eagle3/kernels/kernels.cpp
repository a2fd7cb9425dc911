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
//
// Layout: common.h (formats, arguments, the `Kernels` table), one file per instruction-set path
// (isa_scalar.h, isa_avx2.h, isa_avxvnni.h, isa_avx512.h: each fills in its table), the float
// kernels written once over a vector type (float_body.h), the 256-bit packed matmul shared by
// AVX2 and AVX-VNNI (qlinear256.h); this file: choosing the path (`PATHS`), the ops and their
// registration.
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
#include <limits>
#include <utility>
#include <vector>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace {

#include "common.h"
#include "isa_scalar.h"
#include "isa_avx2.h"
#include "isa_avxvnni.h"
#include "isa_avx512.h"

// ===================================== dispatch =============================================

// Every path, worst to best; the ops call the current one's table.
const Kernels* const PATHS[] = {&isa_scalar::TABLE, &isa_avx2::TABLE, &isa_avxvnni::TABLE, &isa_avx512::TABLE};
constexpr int N_PATHS = sizeof(PATHS) / sizeof(PATHS[0]);

bool runs_here(int i) {
  __builtin_cpu_init();
  return PATHS[i]->supported();
}

std::string path_names(bool here_only) {  // "a, b or c", best first
  std::vector<std::string> names;
  for (int i = N_PATHS - 1; i >= 0; --i)
    if (!here_only || runs_here(i)) names.push_back(PATHS[i]->name);
  std::string out;
  for (size_t j = 0; j < names.size(); ++j)
    out += (j == 0 ? "" : j + 1 == names.size() ? " or " : ", ") + names[j];
  return out;
}

int path_index(const std::string& name) {
  for (int i = 0; i < N_PATHS; ++i)
    if (name == PATHS[i]->name) return i;
  return -1;
}

int initial_path() {  // EAGLE3_ISA when set, else the best path this CPU runs
  const char* env = std::getenv("EAGLE3_ISA");
  if (env != nullptr && *env != '\0') {
    const int i = path_index(env);
    TORCH_CHECK(i >= 0, "EAGLE3_ISA=", env, " is not a path; use ", path_names(false));
    TORCH_CHECK(runs_here(i), "EAGLE3_ISA=", env, ": this CPU cannot run it; use ", path_names(true));
    return i;
  }
  for (int i = N_PATHS - 1; i > 0; --i)
    if (runs_here(i)) return i;
  return 0;
}

std::atomic<int>& current_index() {
  static std::atomic<int> index{initial_path()};
  return index;
}

// The current path's kernels.
const Kernels& kernels() { return *PATHS[current_index().load()]; }

std::string isa_name() { return kernels().name; }

std::vector<std::string> isa_paths() {  // every path this CPU can run, best first
  std::vector<std::string> out;
  for (int i = N_PATHS - 1; i >= 0; --i)
    if (runs_here(i)) out.push_back(PATHS[i]->name);
  return out;
}

std::string set_isa(const std::string& name) {
  const int i = path_index(name);
  TORCH_CHECK(i >= 0, "unknown path ", name, "; use ", path_names(false));
  TORCH_CHECK(runs_here(i), "this CPU cannot run the ", name, " path");
  return PATHS[current_index().exchange(i)]->name;
}

// ===================================== the ops ==============================================

// y (M, N) = x (M, K) W^T for packed W (checked by `check_linear`), into y.
void packed_into(const float* x, int64_t M, int64_t K, const at::Tensor& w, const at::Tensor& scale,
                 const at::Tensor& offset, int64_t fmt, int64_t N, float* y) {
  const int64_t nb = K / 32;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xsd;
  thread_local std::vector<int32_t> xs;
  if (static_cast<int64_t>(xq.size()) < M * K) xq.resize(M * K);
  if (static_cast<int64_t>(xd.size()) < M * nb) { xd.resize(M * nb); xsd.resize(M * nb); xs.resize(M * nb); }
  const Kernels& k = kernels();
  k.quantize_rows(x, M, K, xq.data(), xd.data(), xs.data(), xsd.data());
  QCall c{xq.data(), xd.data(), xsd.data(), xs.data(), M, K, nb, N,
          reinterpret_cast<const uint8_t*>(w.data_ptr()),
          reinterpret_cast<const uint16_t*>(scale.data_ptr()),
          offset.numel() ? reinterpret_cast<const uint16_t*>(offset.data_ptr()) : nullptr,
          fmt, fmt == INT4 && offset.numel() == 0 ? 8 : 0, y};
  at::parallel_for(0, N / 16, 1, [&](int64_t g0, int64_t g1) { k.qlinear(c, g0, g1); });
}

template <typename W, typename F>
void run_float(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N, F linear) {
  const int64_t nbk = kernels().float_cols;
  at::parallel_for(0, (N + nbk - 1) / nbk, 16, [&](int64_t b0, int64_t b1) { linear(x, M, K, w, y, N, b0, b1); });
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
  if (fmt == F32) run_float(x, M, K, w.data_ptr<float>(), y, N, kernels().float_linear_f32);
  else if (fmt == BF16)
    run_float(x, M, K, reinterpret_cast<const uint16_t*>(w.data_ptr()), y, N, kernels().float_linear_bf16);
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
  const auto rows = bf16 ? kernels().attention_bf16 : kernels().attention_f32;
  at::parallel_for(0, B * isa_scalar::attention_units(a), 1, [&](int64_t i0, int64_t i1) { rows(a, i0, i1); });
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
  const auto row = kernels().argmax_row;
  for (int64_t r = 0; r < rows; ++r) o[r] = row(p + r * n, n);
  return out;
}

// Top-p over float32 scores (..., n) and their softmax `probs`, in place: the tokens top-p
// drops set to -inf. The rule and its arithmetic are `decoding.sampling.nucleus`'s: each
// probability as a whole number of 2^-40ths (exact in float32; rounded half to even as
// torch.round), sums of them in double (exact in any order: whole numbers below 2^53); a
// token is dropped when the tokens no more likely than it hold <= floor((1 - top_p) 2^40),
// ties together, the most likely always kept. Nothing is sorted: the candidates are the
// tokens of at least a 1024th of the largest mass (then a 1024th of that, ...) once the rest
// hold no more than the budget (so the rule drops every one of the rest), and a weighted
// selection among them (`least_kept`) finds the cut.
constexpr float MASS_UNIT = 1099511627776.0f;  // 2^40

// A probability in whole 2^-40ths, four at a time (SSE2, every x86-64): x = p 2^40 is exact;
// below 2^23, adding and taking away 2^23 rounds it half to even (IEEE addition), above it
// is whole already.
inline __m128 to_mass4(__m128 p) {
  const __m128 x = _mm_mul_ps(p, _mm_set1_ps(MASS_UNIT)), big = _mm_set1_ps(8388608.f);
  const __m128 low = _mm_cmplt_ps(x, big);
  return _mm_or_ps(_mm_and_ps(low, _mm_sub_ps(_mm_add_ps(x, big), big)), _mm_andnot_ps(low, x));
}

// Sums of whole numbers below 2^53 are exact in double in any order: four independent sums of
// two lanes each (a single chain would wait on each addition's latency).
struct ExactSum {
  __m128d a = _mm_setzero_pd(), b = _mm_setzero_pd(), c = _mm_setzero_pd(), d = _mm_setzero_pd();
  void add8(__m128 m0, __m128 m1) {
    a = _mm_add_pd(a, _mm_cvtps_pd(m0));
    b = _mm_add_pd(b, _mm_cvtps_pd(_mm_movehl_ps(m0, m0)));
    c = _mm_add_pd(c, _mm_cvtps_pd(m1));
    d = _mm_add_pd(d, _mm_cvtps_pd(_mm_movehl_ps(m1, m1)));
  }
  double value() const {
    double t[2];
    _mm_storeu_pd(t, _mm_add_pd(_mm_add_pd(a, b), _mm_add_pd(c, d)));
    return t[0] + t[1];
  }
};

// The least likely kept mass among the candidates `a` (every larger mass of the row is one of
// them): a mass is kept when the masses above it hold less than `need` = total - budget (the
// tokens no more likely than it then hold more than the budget). The selection of quickselect,
// weighted: partition around a pivot into larger, equal and smaller masses; the pivot is kept
// when what is above it (known sums plus the larger part) is < need, and the answer then lies
// among the smaller (or is the pivot); else among the larger. Exact sums: the same answer as
// a full sort.
float least_kept(std::vector<float>& a, double need) {
  size_t lo = 0, hi = a.size();
  double above = 0;  // the masses larger than every one in a[lo, hi)
  float best = std::numeric_limits<float>::infinity();
  while (lo < hi) {
    const float pivot = a[lo + (hi - lo) / 2];
    // a[lo, gt) > pivot, a[gt, eq) == pivot, a[eq, hi) < pivot
    size_t gt = lo, eq = lo, k = hi;
    while (eq < k) {
      if (a[eq] > pivot) std::swap(a[gt++], a[eq++]);
      else if (a[eq] < pivot) std::swap(a[eq], a[--k]);
      else ++eq;
    }
    double larger = 0, equal = 0;
    for (size_t i = lo; i < gt; ++i) larger += a[i];
    for (size_t i = gt; i < eq; ++i) equal += a[i];
    if (above + larger < need) {  // the pivot is kept: look for smaller kept masses
      best = pivot;
      above += larger + equal;
      lo = eq;
    } else {  // dropped: the least kept mass is larger
      hi = gt;
    }
  }
  return best;
}

// The least likely mass top-p keeps in one row p (n,); writes each token's mass.
float top_p_threshold(const float* p, int64_t n, double budget, float* mass,
                      std::vector<float>& cand) {
  ExactSum sum;
  __m128 most4 = _mm_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128 m0 = to_mass4(_mm_loadu_ps(p + i)), m1 = to_mass4(_mm_loadu_ps(p + i + 4));
    _mm_storeu_ps(mass + i, m0);
    _mm_storeu_ps(mass + i + 4, m1);
    most4 = _mm_max_ps(most4, _mm_max_ps(m0, m1));
    sum.add8(m0, m1);
  }
  float lanes[4];
  _mm_storeu_ps(lanes, most4);
  float most = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
  double total = sum.value();
  for (; i < n; ++i) {
    mass[i] = _mm_cvtss_f32(to_mass4(_mm_set1_ps(p[i])));
    total += mass[i];
    most = mass[i] > most ? mass[i] : most;
  }
  float tau = most / 1024.f;
  for (;; tau = tau >= 1024.f ? tau / 1024.f : 0.f) {
    ExactSum held4;
    const __m128 t4 = _mm_set1_ps(tau);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m128 m0 = _mm_loadu_ps(mass + j), m1 = _mm_loadu_ps(mass + j + 4);
      held4.add8(_mm_and_ps(_mm_cmpge_ps(m0, t4), m0), _mm_and_ps(_mm_cmpge_ps(m1, t4), m1));
    }
    double held = held4.value();
    for (; j < n; ++j) held += mass[j] >= tau ? mass[j] : 0.f;
    if (total - held <= budget || tau == 0.f) break;  // the rest are all dropped (or none left)
  }
  cand.clear();
  const __m128 t4 = _mm_set1_ps(tau);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4)
    if (_mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(mass + j), t4)))
      for (int64_t l = j; l < j + 4; ++l)
        if (mass[l] >= tau) cand.push_back(mass[l]);
  for (; j < n; ++j)
    if (mass[j] >= tau) cand.push_back(mass[j]);
  if (cand.empty()) return std::numeric_limits<float>::infinity();  // NaN probabilities: keep none
  return least_kept(cand, total - budget);
}

void top_p_(at::Tensor& scores, const at::Tensor& probs, double top_p) {
  TORCH_CHECK(scores.scalar_type() == at::kFloat && probs.scalar_type() == at::kFloat &&
              scores.sizes() == probs.sizes() && scores.dim() >= 1 && scores.size(-1) > 0 &&
              scores.is_contiguous() && top_p > 0 && top_p <= 1, "top_p_ takes contiguous float32 scores "
              "and probs of one shape (..., n), n > 0, and 0 < top_p <= 1");
  auto pc = probs.contiguous();
  const int64_t n = scores.size(-1), rows = scores.numel() / n;
  const double budget = std::floor((1.0 - top_p) * static_cast<double>(MASS_UNIT));
  // Kept between calls: a fresh vocabulary-sized buffer is a fresh mapping, zeroed page by page.
  thread_local std::vector<float> mass;
  thread_local std::vector<float> cand;
  if (static_cast<int64_t>(mass.size()) < n) mass.resize(n);
  const float drop = -std::numeric_limits<float>::infinity();
  // Subnormal probabilities (a peaked softmax has thousands) cost a microcode assist each;
  // read as zero they give the same mass, 0 (p 2^40 < 2^-85 rounds to it either way).
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // DAZ | FTZ
  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict s = scores.data_ptr<float>() + r * n;
    const float* __restrict m = mass.data();
    const float keep = top_p_threshold(pc.data_ptr<float>() + r * n, n, budget, mass.data(), cand);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] = m[j] >= keep ? s[j] : drop;
  }
  _mm_setcsr(csr);
}

// y = RMSNorm(x) row by row, x and y (M, H), w (H,).
void rms_norm_into(const float* xp, const float* wp, float* yp, int64_t M, int64_t H, double eps, bool gemma) {
  const auto rows = kernels().rms_norm_rows;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) { rows(xp, wp, yp, M, H, e, gemma, r0, r1); });
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
  const auto rows = kernels().rope_rows;
  at::parallel_for(0, B * a.T * a.heads, 256, [&](int64_t i0, int64_t i1) { rows(a, i0, i1); });
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
  const auto rows = kernels().silu_mul_rows;
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) { rows(gp, yp, I, r0, r1); });
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

#include "draft_chain.h"

}  // namespace


TORCH_LIBRARY(eagle3, m) {
  m.def("decoder_layer(Tensor h, Tensor ln1, Tensor ln2, Tensor[] qkv, Tensor[] o, Tensor[] gate_up, "
        "Tensor[] down, int[] fmts, int[] ns, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor input_pos, Tensor mask, int kv_len, int nh, int nkv, float eps, float scale, float softcap, "
        "Tensor? attn_in=None) -> Tensor");
  m.def("draft_chain(Tensor tokens, Tensor feats, int start, int k, Tensor[] embed, int embed_fmt, "
        "Tensor hidden_norm, Tensor input_norm, Tensor post_norm, Tensor final_norm, Tensor[] qkv, Tensor[] o, "
        "Tensor[] gate_up, Tensor[] down, int[] fmts, int[] ns, Tensor[] lm_head, int lm_fmt, Tensor d2t, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int nh, int nkv, float eps, float scale, "
        "bool norm_before_residual) -> (Tensor, Tensor, Tensor)");
  m.def("draft_tree(Tensor tokens, Tensor feats, int start, int top_k, int depth, int n, int max_rope, "
        "Tensor[] embed, int embed_fmt, Tensor hidden_norm, Tensor input_norm, Tensor post_norm, Tensor final_norm, "
        "Tensor[] qkv, Tensor[] o, Tensor[] gate_up, Tensor[] down, int[] fmts, int[] ns, Tensor[] lm_head, "
        "int lm_fmt, Tensor d2t, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int nh, int nkv, "
        "float eps, float scale, bool norm_before_residual) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool gemma) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("top_p_(Tensor(a!) scores, Tensor probs, float top_p) -> ()");
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
  m.impl("draft_chain", &draft_chain);
  m.impl("draft_tree", &draft_tree);
  m.impl("argmax", &argmax);
  m.impl("top_p_", &top_p_);
}
