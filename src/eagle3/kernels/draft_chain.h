// An EAGLE-3 head's greedy chain as one op (`eagle3::draft_chain`): the catch-up over a row's
// backlog and k greedy drafts, with no Python between the steps. Included by kernels.cpp after
// `decoder_layer`, whose kernels and order it reuses, so every number is the one the head's
// module (`draft.model.Eagle3Draft.forward`) computes op by op with the kernels:
//   emb = embedding(token)                       (a float32 table, or a tied LM head's codes)
//   a = [input_layernorm(emb) | hidden_norm(g)]  (T, 2H); residual = g (or hidden_norm(g))
//   h = decoder_layer(residual, attn_in = a)     (RoPE at the row's position, causal)
//   logits = lm_head(norm(h)); draft = argmax; target id = draft + d2t[draft]
// What it saves is the ~25 Python-level ops of each step (~0.3 ms on a 2-core EPYC) and the LM
// head over catch-up rows whose logits nobody reads (rows are independent: the last row's
// logits are the bits a forward over all of them gives that row).

// A token's embedding row (H,) into y: a float32 table (V, H) = [table], or a tied LM head's
// packed codes [w, scale, offset] (`formats.QLinear.rows`: int8 code * d; Q4_1 code * d + m;
// Q4_0 (code - 8) * d; one rounding per operation, as PyTorch computes them).
void embed_row_into(at::TensorList table, int64_t fmt, int64_t token, int64_t H, float* y) {
  if (fmt == F32) {
    std::memcpy(y, table[0].data_ptr<float>() + token * H, H * sizeof(float));
    return;
  }
  const int64_t nb = H / 32, g = token / 16, c = token % 16, tile = tile_bytes(fmt);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(table[0].data_ptr());
  const uint16_t* sd = reinterpret_cast<const uint16_t*>(table[1].data_ptr());
  const uint16_t* sm = table[2].numel() ? reinterpret_cast<const uint16_t*>(table[2].data_ptr()) : nullptr;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t = w + (g * nb + b) * tile;
    const int64_t at = (g * nb + b) * 16 + c;
    const float d = half_to_float(sd[at]);
    float* yb = y + b * 32;
    if (fmt == INT8) {
      for (int64_t quad = 0; quad < 8; ++quad)
        for (int64_t j = 0; j < 4; ++j)
          yb[4 * quad + j] = static_cast<float>(static_cast<int8_t>(t[(quad * 16 + c) * 4 + j])) * d;
      continue;
    }
    const float m = sm ? half_to_float(sm[at]) : 0.0f;
    for (int64_t p = 0; p < 4; ++p)
      for (int64_t j = 0; j < 4; ++j) {
        const uint8_t byte = t[(p * 16 + c) * 4 + j];
        const int lo = byte & 15, hi = byte >> 4;  // inputs 4p + j and 16 + 4p + j
        if (sm) {
          const float lo_d = static_cast<float>(lo) * d, hi_d = static_cast<float>(hi) * d;
          yb[4 * p + j] = lo_d + m;
          yb[16 + 4 * p + j] = hi_d + m;
        } else {
          yb[4 * p + j] = static_cast<float>(lo - 8) * d;
          yb[16 + 4 * p + j] = static_cast<float>(hi - 8) * d;
        }
      }
  }
}

// The head's weights and shapes, as `Eagle3Draft.chain_op_args` lists them.
struct Head {
  at::TensorList embed;
  int64_t embed_fmt, V, H;
  const float *hidden_norm, *input_norm, *final_norm;
  const at::Tensor& post_norm;
  at::TensorList qkv, o, gate_up, down;
  at::IntArrayRef fmts, ns;
  at::TensorList lm_head;
  int64_t lm_fmt, Vd;
  const int64_t* d2t;
  const at::Tensor &cos, &sin;
  at::Tensor k_cache, v_cache;
  int64_t nh, nkv;
  double eps, scale;
  bool norm_before_residual;
};

// T rows of tokens (target ids) with features g (T, H) at positions p0..p0+T-1 through the
// head's layer (causal over the cache's first p0 + T slots): the next features h (T, H).
at::Tensor head_layer(const Head& m, const int64_t* tokens, const float* g, int64_t T, int64_t p0) {
  const int64_t H = m.H;
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < 3 * T * H) buf.resize(3 * T * H);
  float* emb = buf.data();
  float* en = emb + T * H;
  float* gn = en + T * H;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(tokens[t] >= 0 && tokens[t] < m.V, "draft_chain: token ", tokens[t], " is outside the vocabulary");
    embed_row_into(m.embed, m.embed_fmt, tokens[t], H, emb + t * H);
  }
  auto opts = at::TensorOptions().dtype(at::kFloat);
  auto a = at::empty({1, T, 2 * H}, opts);
  auto residual = at::empty({1, T, H}, opts);
  float* ap = a.data_ptr<float>();
  rms_norm_into(g, m.hidden_norm, gn, T, H, m.eps, false);
  rms_norm_into(emb, m.input_norm, en, T, H, m.eps, false);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(ap + t * 2 * H, en + t * H, H * sizeof(float));
    std::memcpy(ap + t * 2 * H + H, gn + t * H, H * sizeof(float));
  }
  std::memcpy(residual.data_ptr<float>(), m.norm_before_residual ? gn : g, T * H * sizeof(float));
  auto pos = at::arange(p0, p0 + T, at::TensorOptions().dtype(at::kLong));
  auto mask = at::ones({T, p0 + T}, at::TensorOptions().dtype(at::kBool)).tril(p0);
  return decoder_layer(residual, m.post_norm, m.post_norm, m.qkv, m.o, m.gate_up, m.down, m.fmts, m.ns,
                       m.cos.narrow(0, p0, T), m.sin.narrow(0, p0, T), m.k_cache, m.v_cache, pos, mask,
                       p0 + T, m.nh, m.nkv, m.eps, m.scale, 0.0, a)
      .view({T, H});
}

// logits (Vd,) = lm_head(norm(h)) for one feature row h (H,).
void head_logits(const Head& m, const float* h, float* logits) {
  thread_local std::vector<float> xn;
  if (static_cast<int64_t>(xn.size()) < m.H) xn.resize(m.H);
  rms_norm_into(h, m.final_norm, xn.data(), 1, m.H, m.eps, false);
  project_into(xn.data(), 1, m.H, m.lm_head, m.lm_fmt, m.Vd, logits);
}

// A lone row's catch-up over its backlog tokens (R,) with features (R, H) at positions start..,
// then k greedy drafts: (drafts (k,) target ids, the root logits (Vd,) at the backlog's last row,
// its feature (H,)). Draft i > 0 runs the head at position start + R + i - 1.
std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_chain(
    const at::Tensor& tokens, const at::Tensor& feats, int64_t start, int64_t k, at::TensorList embed,
    int64_t embed_fmt, const at::Tensor& hidden_norm, const at::Tensor& input_norm, const at::Tensor& post_norm,
    const at::Tensor& final_norm, at::TensorList qkv_p, at::TensorList o_p, at::TensorList gu_p,
    at::TensorList down_p, at::IntArrayRef fmts, at::IntArrayRef ns, at::TensorList lm_head, int64_t lm_fmt,
    const at::Tensor& d2t, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
    int64_t nh, int64_t nkv, double eps, double scale, bool norm_before_residual) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.size(0) > 0,
              "draft_chain: tokens must be (R,) int64, R > 0");
  const int64_t R = tokens.size(0);
  TORCH_CHECK(feats.dim() == 2 && feats.size(0) == R && feats.scalar_type() == at::kFloat,
              "draft_chain: feats must be (R, H) float32");
  const int64_t H = feats.size(1);
  TORCH_CHECK(k >= 1 && start >= 0, "draft_chain: k >= 1 and start >= 0");
  TORCH_CHECK(start + R + k - 1 <= std::min(k_cache.size(2), cos.size(0)),
              "draft_chain: positions up to ", start + R + k - 2, " pass the cache's end");
  TORCH_CHECK(H % 32 == 0 || embed_fmt == F32, "draft_chain: packed embeddings need H divisible by 32");
  TORCH_CHECK(embed_fmt == F32 ? embed.size() == 1 && embed[0].scalar_type() == at::kFloat &&
                                     embed[0].dim() == 2 && embed[0].size(1) == H && embed[0].is_contiguous()
                               : embed.size() == 3 && (embed_fmt == INT8 || embed_fmt == INT4) &&
                                     embed[0].is_contiguous() && embed[1].scalar_type() == at::kHalf,
              "draft_chain: embed is [table (V, H) float32] or packed [w, scale, offset]");
  const int64_t V = embed_fmt == F32 ? embed[0].size(0) : embed[1].numel() / (H / 32);
  for (const at::Tensor* w : {&hidden_norm, &input_norm, &final_norm})
    TORCH_CHECK(w->scalar_type() == at::kFloat && w->numel() == H && w->is_contiguous(),
                "draft_chain: norm weights must be (H,) float32");
  TORCH_CHECK(lm_head.size() == 4, "draft_chain: lm_head is [w, scale, offset, bias]");
  const int64_t Vd = d2t.numel();
  TORCH_CHECK(d2t.scalar_type() == at::kLong && d2t.is_contiguous() && Vd > 0, "draft_chain: d2t must be (Vd,) int64");
  check_linear(lm_head[0], lm_head[1], lm_head[2], lm_fmt, 32, Vd, H);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes(),
              "draft_chain: cos, sin must be (max_len, hd) tables");
  const Head m{embed, embed_fmt, V, H, hidden_norm.data_ptr<float>(), input_norm.data_ptr<float>(),
               final_norm.data_ptr<float>(), post_norm, qkv_p, o_p, gu_p, down_p, fmts, ns, lm_head, lm_fmt, Vd,
               d2t.data_ptr<int64_t>(), cos, sin, k_cache, v_cache, nh, nkv, eps, scale, norm_before_residual};
  auto tc = tokens.contiguous();
  auto fc = feats.contiguous();
  auto opts = feats.options();
  auto drafts = at::empty({k}, tokens.options());
  auto root = at::empty({Vd}, opts);
  auto boundary = at::empty({H}, opts);
  at::Tensor h = head_layer(m, tc.data_ptr<int64_t>(), fc.data_ptr<float>(), R, start);
  std::memcpy(boundary.data_ptr<float>(), h.data_ptr<float>() + (R - 1) * H, H * sizeof(float));
  head_logits(m, boundary.data_ptr<float>(), root.data_ptr<float>());
  thread_local std::vector<float> logits;
  if (static_cast<int64_t>(logits.size()) < Vd) logits.resize(Vd);
  const float* cur = root.data_ptr<float>();
  const auto argmax_row = kernels().argmax_row;
  int64_t* out = drafts.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) {
    const int64_t id = argmax_row(cur, Vd);
    out[i] = id + m.d2t[id];
    if (i == k - 1) break;
    const float* g = i == 0 ? boundary.data_ptr<float>() : h.data_ptr<float>();
    h = head_layer(m, out + i, g, 1, start + R + i);
    head_logits(m, h.data_ptr<float>(), logits.data());
    cur = logits.data();
  }
  return {drafts, root, boundary};
}
