// What every instruction-set path shares: the weight formats, the arguments of each kernel,
// small helpers, and `Kernels`, the table of functions each path fills in (its own file,
// isa_<name>.h). kernels.cpp includes this and the paths inside its anonymous namespace, then
// dispatches every op through the current path's table: adding a path (AMX tiles, NEON) is one
// file and one row of `PATHS` there.

enum Format : int64_t { F32 = 0, BF16 = 1, INT8 = 2, INT4 = 3 };

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
// torch.argmax's scan of x[i..n) given the maximum m so far, first seen at r (no NaN before i):
// the first maximum, or the first NaN. The vector paths finish their tails with it.
inline int64_t argmax_from(const float* x, int64_t i, int64_t n, float m, int64_t r) {
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > m) { m = x[i]; r = i; }
  }
  return r;
}

int64_t scalar_argmax(const float* x, int64_t n) { return std::isnan(x[0]) ? 0 : argmax_from(x, 1, n, x[0], 0); }

// Bytes of codes per 16 columns x 32 inputs.
inline int64_t tile_bytes(int64_t fmt) { return fmt == INT8 ? 512 : 256; }

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

// One instruction-set path: its name, whether this CPU runs it, and its kernels. A path may
// borrow another's (AVX-VNNI runs AVX2's float kernels and argmax).
struct Kernels {
  const char* name;
  bool (*supported)();
  // Packed weights: the groups of 16 columns [g0, g1) of a call, and the activations' int8 codes.
  void (*qlinear)(const QCall& c, int64_t g0, int64_t g1);
  void (*quantize_rows)(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* s, float* sd);
  // Float weights (N, K) in float32 / bfloat16: weight rows [b0 * float_cols, b1 * float_cols).
  void (*float_linear_f32)(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N,
                           int64_t b0, int64_t b1);
  void (*float_linear_bf16)(const float* x, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t N,
                            int64_t b0, int64_t b1);
  int64_t float_cols;
  // Attention over float32 / bfloat16 keys and values: units [i0, i1) (`attention_units`).
  void (*attention_f32)(const AttnArgs& a, int64_t i0, int64_t i1);
  void (*attention_bf16)(const AttnArgs& a, int64_t i0, int64_t i1);
  void (*rms_norm_rows)(const float* x, const float* w, float* y, int64_t M, int64_t H, float eps, bool gemma,
                        int64_t r0, int64_t r1);
  void (*rope_rows)(const RopeArgs& a, int64_t i0, int64_t i1);
  void (*silu_mul_rows)(const float* gu, float* y, int64_t I, int64_t r0, int64_t r1);
  int64_t (*argmax_row)(const float* x, int64_t n);
};
