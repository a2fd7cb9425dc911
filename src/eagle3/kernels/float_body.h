// The float kernels, written once over a 16-lane vector type `V` and included once per
// instruction set by kernels.cpp (inside that set's `#pragma GCC target` and namespace).
//
// Every operation on V is an IEEE elementwise operation (fused multiply-add included) and
// every horizontal sum is `V::reduce`'s fixed tree, so each path (scalar, AVX2, AVX-512)
// produces the same bits, and a row's result depends only on that row: the same in a
// (T > 1) verify as in a 1-row decode.
//
// Needs from the including scope: V (zero, set1, load, load_n, load_bf16, load_bf16_n,
// store, store_n, fma, add, sub, mul, max, round_even, reduce, reduce16), and the constants MT (rows per
// register tile) and NB (weight rows per register tile).

// ---- int8 activations: each row quantized per block of 32, from that row alone -------------
// xd = amax / 127, codes = round-half-even(x * (1 / xd)) clamped to -127..127 (0 where xd is
// 0), xs = their sum, xsd = xd * xs: elementwise IEEE operations and an exact max, the same
// on every path and in the PyTorch reference (`kernels.quantize_rows`).
inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* s, float* sd) {
  const int64_t nb = K / 32;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * 32;
      const V x0 = V::load(xb), x1 = V::load(xb + 16);
      float t[32];
      V::store(t, V::max(V::max(x0, V::sub(V::zero(), x0)), V::max(x1, V::sub(V::zero(), x1))));
      float amax = 0.f;
      for (int l = 0; l < 16; ++l) amax = t[l] > amax ? t[l] : amax;
      const float dd = amax / 127.f;
      const V id = V::set1(dd != 0.f ? 1.f / dd : 0.f);
      V::store(t, V::round_even(V::mul(x0, id)));
      V::store(t + 16, V::round_even(V::mul(x1, id)));
      int8_t* qb = q + r * K + b * 32;
      int32_t sum = 0;
      for (int k = 0; k < 32; ++k) {
        const int32_t v = std::min(127, std::max(-127, static_cast<int32_t>(t[k])));
        qb[k] = static_cast<int8_t>(v);
        sum += v;
      }
      d[r * nb + b] = dd;
      s[r * nb + b] = sum;
      sd[r * nb + b] = dd * static_cast<float>(sum);
    }
}

// ---- linear: y (M, N) = x (M, K) @ W^T with W (N, K) float32 or bfloat16 -------------------

template <typename W>
inline V load_w(const W* p);
template <>
inline V load_w<float>(const float* p) { return V::load(p); }
template <>
inline V load_w<uint16_t>(const uint16_t* p) { return V::load_bf16(p); }
template <typename W>
inline V load_w_n(const W* p, int n);
template <>
inline V load_w_n<float>(const float* p, int n) { return V::load_n(p, n); }
template <>
inline V load_w_n<uint16_t>(const uint16_t* p, int n) { return V::load_bf16_n(p, n); }

// Lane l of acc[i][j] sums x[i, k] * w[j, k] over k = l (mod 16) in increasing k, one fused
// multiply-add each; the tail is zero-filled (adding +0 * +0 changes nothing). Then the tree.
template <int MR, int NR, typename W>
inline void dot_tile(const float* x, int64_t K, const W* w, float* y, int64_t N) {
  V acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = V::zero();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    V wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load_w<W>(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const V xv = V::load(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = V::fma(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {
    const int n = static_cast<int>(K - k);
    V wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load_w_n<W>(w + j * K + k, n);
    for (int i = 0; i < MR; ++i) {
      const V xv = V::load_n(x + i * K + k, n);
      for (int j = 0; j < NR; ++j) acc[i][j] = V::fma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = V::reduce(acc[i][j]);
}

template <int MR, int NR, typename W>
inline void dot_rows_from(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N) {
  if constexpr (MR > 0) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR) dot_tile<MR, NR, W>(x + m * K, K, w, y + m * N, N);
    if (m < M) dot_rows_from<MR - 1, NR, W>(x + m * K, M - m, K, w, y + m * N, N);
  }
}

template <int NR, typename W>
inline void dot_rows(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N) {
  dot_rows_from<MT, NR, W>(x, M, K, w, y, N);
}

template <int NR, typename W>
inline void dot_cols(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N,
                     int64_t n, int64_t left) {
  if constexpr (NR > 0) {
    if (left >= NR) dot_rows<NR, W>(x, M, K, w + n * K, y + n, N);
    else dot_cols<NR - 1, W>(x, M, K, w, y, N, n, left);
  }
}

template <typename W>
void float_linear(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N,
                  int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n = b * NB;
    dot_cols<NB, W>(x, M, K, w, y, N, n, std::min<int64_t>(NB, N - n));
  }
}

// ---- attention: one query row at a time -----------------------------------------------------

// e^x for x <= 0: 2^n * p(r), r = x - n ln 2, a degree-6 polynomial. x is clamped to -87 so
// 2^n stays a normal float built from its bits (the same on every path, no scalef).
inline V exp_neg(V x) {
  x = V::max(x, V::set1(-87.f));
  const V n = V::round_even(V::mul(x, V::set1(1.44269504088896341f)));
  V r = V::fma(n, V::set1(-0.693145751953125f), x);
  r = V::fma(n, V::set1(-1.428606765330187e-06f), r);
  V p = V::set1(1.3981999507e-3f);
  p = V::fma(p, r, V::set1(8.3334519073e-3f));
  p = V::fma(p, r, V::set1(4.1665795894e-2f));
  p = V::fma(p, r, V::set1(1.6666665459e-1f));
  p = V::fma(p, r, V::set1(5.0000001201e-1f));
  p = V::fma(p, V::mul(r, r), r);
  p = V::add(p, V::set1(1.f));
  return V::mul(p, V::pow2(n));
}

// Scores of one query row against its n kept keys for GC query heads that share a key/value
// head: each key row is read (and widened from bf16) once for all GC heads. Per head, the
// same fused multiply-adds in the same order as one head alone, and each key's 16 lanes are
// summed by the fixed tree (`V::reduce16`: 16 keys at a time where the path can), so the
// same bits as scoring each head on its own.
template <typename W, int GC>
void attention_scores(const AttnArgs& a, const float* const* qr, const W* kb, const int32_t* kp,
                      int64_t n, float* const* sb, float* mx) {
  const int64_t hd = a.hd;
  alignas(64) float part[GC][256];  // per head: 16 keys' 16-lane sums
  alignas(64) float s16[16];
  V vmx[GC];  // per lane the largest score seen (a max in any order is the same number)
  for (int g = 0; g < GC; ++g) {
    mx[g] = -INFINITY;
    vmx[g] = V::set1(-INFINITY);
  }
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int nk = static_cast<int>(std::min<int64_t>(16, n - j0));
    for (int jj = 0; jj < nk; ++jj) {
      const W* kr = kb + kp[j0 + jj] * a.ks[2];
      V acc[GC];
      for (int g = 0; g < GC; ++g) acc[g] = V::zero();
      int64_t d = 0;
      for (; d + 16 <= hd; d += 16) {
        const V kv = load_w<W>(kr + d);
        for (int g = 0; g < GC; ++g) acc[g] = V::fma(V::load(qr[g] + d), kv, acc[g]);
      }
      if (d < hd) {
        const V kv = load_w_n<W>(kr + d, static_cast<int>(hd - d));
        for (int g = 0; g < GC; ++g) acc[g] = V::fma(V::load_n(qr[g] + d, static_cast<int>(hd - d)), kv, acc[g]);
      }
      for (int g = 0; g < GC; ++g) V::store(part[g] + 16 * jj, acc[g]);
    }
    for (int g = 0; g < GC; ++g) {
      V::reduce16(part[g], nk, s16);
      if (nk == 16 && !(a.softcap > 0.f)) {
        const V x = V::mul(V::load(s16), V::set1(a.scale));
        V::store(sb[g] + j0, x);
        vmx[g] = V::max(x, vmx[g]);
        continue;
      }
      for (int jj = 0; jj < nk; ++jj) {
        float x = s16[jj] * a.scale;
        if (a.softcap > 0.f) x = std::tanh(x / a.softcap) * a.softcap;
        sb[g][j0 + jj] = x;
        mx[g] = std::max(mx[g], x);
      }
    }
  }
  for (int g = 0; g < GC; ++g) {
    V::store(s16, vmx[g]);
    for (int l = 0; l < 16; ++l) mx[g] = std::max(mx[g], s16[l]);
  }
}

// out[b, t, h*hd:(h+1)*hd] = softmax(scale * q[b, h, t] . k[b, h/g, s] over the s that
// mask[b, t, s] allows) @ v[b, h/g]. Masked keys are skipped, not zeroed, and the allowed
// keys are visited in slot order, so a row's result depends only on its query and the keys
// it may see, whatever sits in the masked slots and however long the cache is.
// KV is float32 or bf16 (W = uint16_t: each element rounded alone when written, so a row's
// keys are the same whatever else the call holds).
// Unit i = (b, key/value head, chunk of up to a.hc query heads sharing it, t); `attention_units`
// counts them. The chunk's heads share the mask row and the key reads (`attention_scores`);
// how heads are chunked changes no head's arithmetic.
constexpr int64_t HEAD_CHUNK = 4;  // the most heads a unit scores together (a.hc <= it)
inline int64_t attention_units(const AttnArgs& a) {
  return a.nh / a.group * ((a.group + a.hc - 1) / a.hc) * a.T;
}

template <typename W>
void attention_rows(const AttnArgs& a, int64_t i0, int64_t i1) {
  const int64_t T = a.T, nh = a.nh, hd = a.hd, S = a.S, G = a.group;
  const int64_t hc = a.hc, nkv = nh / G, chunks = (G + hc - 1) / hc, per_b = nkv * chunks * T;
  thread_local std::vector<float> sbuf;
  thread_local std::vector<int32_t> keep;
  const int64_t stride = S + 16;
  if (static_cast<int64_t>(sbuf.size()) < HEAD_CHUNK * stride) sbuf.resize(HEAD_CHUNK * stride);
  if (static_cast<int64_t>(keep.size()) < S) keep.resize(S);
  int32_t* kp = keep.data();
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t b = i / per_b, kh = (i / (chunks * T)) % nkv, c = (i / T) % chunks, t = i % T;
    const int64_t h0 = kh * G + c * hc, gc = std::min(hc, G - c * hc);
    const W* kb = static_cast<const W*>(a.k) + b * a.ks[0] + kh * a.ks[1];
    const W* vb = static_cast<const W*>(a.v) + b * a.vs[0] + kh * a.vs[1];
    const bool* mr = a.mask + b * a.ms[0] + t * a.ms[1];
    int64_t n = 0;
    for (int64_t s = 0; s < S; ++s)
      if (mr[s * a.ms[2]]) kp[n++] = static_cast<int32_t>(s);
    const float* qr[HEAD_CHUNK];
    float* sb[HEAD_CHUNK];
    float mx[HEAD_CHUNK];
    for (int64_t g = 0; g < gc; ++g) {
      qr[g] = a.q + b * a.qs[0] + (h0 + g) * a.qs[1] + t * a.qs[2];
      sb[g] = sbuf.data() + g * stride;
    }
    if (n == 0) {
      for (int64_t g = 0; g < gc; ++g) std::memset(a.out + (b * T + t) * nh * hd + (h0 + g) * hd, 0, hd * sizeof(float));
      continue;
    }
    switch (gc) {
      case 1: attention_scores<W, 1>(a, qr, kb, kp, n, sb, mx); break;
      case 2: attention_scores<W, 2>(a, qr, kb, kp, n, sb, mx); break;
      case 3: attention_scores<W, 3>(a, qr, kb, kp, n, sb, mx); break;
      default: attention_scores<W, 4>(a, qr, kb, kp, n, sb, mx); break;
    }
    for (int64_t g = 0; g < gc; ++g) {
      float* sg = sb[g];
      float* o = a.out + (b * T + t) * nh * hd + (h0 + g) * hd;
      for (int64_t j = n; j < (n + 15) / 16 * 16; ++j) sg[j] = mx[g];
      const V vmx = V::set1(mx[g]);
      for (int64_t j = 0; j < n; j += 16) V::store(sg + j, exp_neg(V::sub(V::load(sg + j), vmx)));
      // The denominator in 16 lanes (weights j, j + 16, ... in lane j % 16), then the fixed
      // tree: no serial chain of n additions.
      V dsum = V::zero();
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) dsum = V::add(dsum, V::load(sg + j));
      if (j < n) dsum = V::add(dsum, V::load_n(sg + j, static_cast<int>(n - j)));
      const V inv = V::set1(1.f / V::reduce(dsum));
      // Up to 64 output dims per pass over the keys: four independent accumulators, each still
      // summing its keys in slot order (the same bits as one dim block at a time).
      for (int64_t d0 = 0; d0 < hd; d0 += 64) {
        const int nc = static_cast<int>(std::min<int64_t>(4, (hd - d0 + 15) / 16));
        int live[4];
        for (int q = 0; q < 4; ++q) live[q] = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, hd - d0 - 16 * q)));
        V acc[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
        const int64_t vs = a.vs[2];
        if (hd - d0 >= 64) {  // four whole blocks: accumulators in registers, no masks
          for (int64_t jj = 0; jj < n; ++jj) {
            const V w = V::set1(sg[jj]);
            const W* vr = vb + kp[jj] * vs + d0;
            acc[0] = V::fma(w, load_w<W>(vr), acc[0]);
            acc[1] = V::fma(w, load_w<W>(vr + 16), acc[1]);
            acc[2] = V::fma(w, load_w<W>(vr + 32), acc[2]);
            acc[3] = V::fma(w, load_w<W>(vr + 48), acc[3]);
          }
        } else {
          for (int64_t jj = 0; jj < n; ++jj) {
            const V w = V::set1(sg[jj]);
            const W* vr = vb + kp[jj] * vs + d0;
            for (int q = 0; q < nc; ++q) acc[q] = V::fma(w, load_w_n<W>(vr + 16 * q, live[q]), acc[q]);
          }
        }
        for (int q = 0; q < nc; ++q) V::store_n(o + d0 + 16 * q, V::mul(acc[q], inv), live[q]);
      }
    }
  }
}

// ---- elementwise steps around the matmuls, one row at a time ---------------------------------

// RMSNorm of each row of x (M, H): r = 1 / sqrt(sum(x^2) / H + eps) (the sum in 16 lanes and
// the fixed tree); y = w * (x * r), or (x * r) * (1 + w) for Gemma.
void rms_norm_rows(const float* x, const float* w, float* y, int64_t M, int64_t H, float eps,
                   bool gemma, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * H;
    float* yr = y + r * H;
    V acc = V::zero();
    int64_t k = 0;
    for (; k + 16 <= H; k += 16) {
      const V v = V::load(xr + k);
      acc = V::fma(v, v, acc);
    }
    if (k < H) {
      const V v = V::load_n(xr + k, static_cast<int>(H - k));
      acc = V::fma(v, v, acc);
    }
    const V inv = V::set1(1.f / std::sqrt(V::reduce(acc) / static_cast<float>(H) + eps));
    for (k = 0; k < H; k += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, H - k));
      const V h = V::mul(V::load_n(xr + k, n), inv);
      const V wv = V::load_n(w + k, n);
      V::store_n(yr + k, gemma ? V::mul(h, V::add(V::set1(1.f), wv)) : V::mul(wv, h), n);
    }
  }
}

// RoPE in place on rows of head vectors: x[:half] = x1 * c1 + (-x2) * s1 and
// x[half:] = x2 * c2 + x1 * s2, one rounding per multiply and add: the bits of
// `x * cos + rotate_half(x) * sin` in PyTorch.
void rope_rows(const RopeArgs& a, int64_t i0, int64_t i1) {
  const int64_t half = a.hd / 2;
  for (int64_t i = i0; i < i1; ++i) {  // i = (b * T + t) * heads + h
    const int64_t h = i % a.heads, bt = i / a.heads, t = bt % a.T, b = bt / a.T;
    float* x = a.x + b * a.xs[0] + t * a.xs[1] + h * a.xs[2];
    const float* c = a.cos + b * a.cb + t * a.hd;
    const float* s = a.sin + b * a.cb + t * a.hd;
    for (int64_t k = 0; k < half; k += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, half - k));
      const V x1 = V::load_n(x + k, n), x2 = V::load_n(x + half + k, n);
      const V lo = V::add(V::mul(x1, V::load_n(c + k, n)), V::mul(V::sub(V::zero(), x2), V::load_n(s + k, n)));
      const V hi = V::add(V::mul(x2, V::load_n(c + half + k, n)), V::mul(x1, V::load_n(s + half + k, n)));
      V::store_n(x + k, lo, n);
      V::store_n(x + half + k, hi, n);
    }
  }
}

// SwiGLU of each row of gu (M, 2I) = [gate | up]: y = silu(gate) * up, silu(g) = g / (1 + e^-g)
// with e^-|g| from exp_neg (g >= 0: g / (1 + t); g < 0: g * t / (1 + t)).
void silu_mul_rows(const float* gu, float* y, int64_t I, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    float* yr = y + r * I;
    for (int64_t k = 0; k < I; k += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, I - k));
      const V gv = V::load_n(g + k, n);
      const V neg_abs = V::sub(V::zero(), V::max(gv, V::sub(V::zero(), gv)));
      const V t = exp_neg(neg_abs);
      const V den = V::add(V::set1(1.f), t);
      const V num = V::select_neg(gv, V::mul(gv, t), gv);  // g < 0: g * t, else g
      V::store_n(yr + k, V::mul(V::div(num, den), V::load_n(u + k, n)), n);
    }
  }
}
