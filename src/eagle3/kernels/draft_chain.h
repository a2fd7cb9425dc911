// An EAGLE-3 head's greedy chain as one op (`eagle3::draft_chain`): the catch-up over a row's
// backlog and k greedy drafts, with no Python between the steps; and its dynamic tree the same
// way (`eagle3::draft_tree`: the catch-up, then `decoding.tree.expand_tree` and `select_tree`
// level by level, their tensor ops called here in the same order). Included by kernels.cpp after
// `decoder_layer`, whose kernels and order it reuses, so every number is the one the head's
// module (`draft.model.Eagle3Draft.forward`) computes op by op with the kernels:
//   emb = embedding(token)                       (a float32 table, or a tied LM head's codes)
//   a = [input_layernorm(emb) | hidden_norm(g)]  (T, 2H); residual = g (or hidden_norm(g))
//   h = decoder_layer(residual, attn_in = a)     (RoPE at the row's position, causal)
//   logits = lm_head(norm(h)); draft = argmax; target id = draft + d2t[draft]
// What it saves is the ~25 Python-level ops of each step (docs/weight-formats.md) and the LM
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

// T rows of tokens (target ids) with features g (T, H) through the head's layer, written at cache
// slots `slots` (T,) with RoPE rows cos, sin (T, hd), attending where mask (T, kv_len) holds: the
// next features h (T, H).
at::Tensor head_layer_at(const Head& m, const int64_t* tokens, const float* g, int64_t T, const at::Tensor& slots,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask, int64_t kv_len) {
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
  return decoder_layer(residual, m.post_norm, m.post_norm, m.qkv, m.o, m.gate_up, m.down, m.fmts, m.ns, cos, sin,
                       m.k_cache, m.v_cache, slots, mask, kv_len, m.nh, m.nkv, m.eps, m.scale, 0.0, a)
      .view({T, H});
}

// T consecutive rows at positions p0..p0+T-1, causal over the cache's first p0 + T slots.
at::Tensor head_layer(const Head& m, const int64_t* tokens, const float* g, int64_t T, int64_t p0) {
  auto pos = at::arange(p0, p0 + T, at::TensorOptions().dtype(at::kLong));
  auto mask = at::ones({T, p0 + T}, at::TensorOptions().dtype(at::kBool)).tril(p0);
  return head_layer_at(m, tokens, g, T, pos, m.cos.narrow(0, p0, T), m.sin.narrow(0, p0, T), mask, p0 + T);
}

// logits (T, Vd) = lm_head(norm(h)) for T feature rows h (T, H).
void head_logits(const Head& m, const float* h, float* logits, int64_t T = 1) {
  thread_local std::vector<float> xn;
  if (static_cast<int64_t>(xn.size()) < T * m.H) xn.resize(T * m.H);
  rms_norm_into(h, m.final_norm, xn.data(), T, m.H, m.eps, false);
  project_into(xn.data(), T, m.H, m.lm_head, m.lm_fmt, m.Vd, logits);
}

// The head's arguments checked (the ops' shared tail, from embed to norm_before_residual) as a Head.
Head make_head(const at::Tensor& feats, at::TensorList embed, int64_t embed_fmt, const at::Tensor& hidden_norm,
               const at::Tensor& input_norm, const at::Tensor& post_norm, const at::Tensor& final_norm,
               at::TensorList qkv_p, at::TensorList o_p, at::TensorList gu_p, at::TensorList down_p,
               at::IntArrayRef fmts, at::IntArrayRef ns, at::TensorList lm_head, int64_t lm_fmt, const at::Tensor& d2t,
               const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, int64_t nh,
               int64_t nkv, double eps, double scale, bool norm_before_residual) {
  const int64_t H = feats.size(1);
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
  return Head{embed, embed_fmt, V, H, hidden_norm.data_ptr<float>(), input_norm.data_ptr<float>(),
              final_norm.data_ptr<float>(), post_norm, qkv_p, o_p, gu_p, down_p, fmts, ns, lm_head, lm_fmt, Vd,
              d2t.data_ptr<int64_t>(), cos, sin, k_cache, v_cache, nh, nkv, eps, scale, norm_before_residual};
}

void check_backlog(const at::Tensor& tokens, const at::Tensor& feats) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.size(0) > 0,
              "draft_chain: tokens must be (R,) int64, R > 0");
  TORCH_CHECK(feats.dim() == 2 && feats.size(0) == tokens.size(0) && feats.scalar_type() == at::kFloat,
              "draft_chain: feats must be (R, H) float32");
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
  check_backlog(tokens, feats);
  const int64_t R = tokens.size(0), H = feats.size(1);
  TORCH_CHECK(k >= 1 && start >= 0, "draft_chain: k >= 1 and start >= 0");
  TORCH_CHECK(start + R + k - 1 <= std::min(k_cache.size(2), cos.size(0)),
              "draft_chain: positions up to ", start + R + k - 2, " pass the cache's end");
  const Head m = make_head(feats, embed, embed_fmt, hidden_norm, input_norm, post_norm, final_norm, qkv_p, o_p, gu_p,
                           down_p, fmts, ns, lm_head, lm_fmt, d2t, cos, sin, k_cache, v_cache, nh, nkv, eps, scale,
                           norm_before_residual);
  const int64_t Vd = m.Vd;
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

// `decoding.tree.select_tree` for one row (G = 1): the n best candidates as a connected tree.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> select_tree_row(
    const at::Tensor& tokens, const at::Tensor& scores, const at::Tensor& parents, const at::Tensor& levels,
    int64_t n, int64_t depth) {
  auto lopt = at::TensorOptions().dtype(at::kLong);
  auto keep = std::get<0>(at::sort(std::get<1>(at::sort(scores, true, 1, true)).narrow(1, 0, n), 1));
  auto node_of = at::zeros_like(tokens).scatter_(1, keep, at::arange(1, n + 1, lopt).expand({1, n}));
  auto par = parents.gather(1, keep);
  auto tree_parents = at::where(par >= 0, node_of.gather(1, par.clamp_min(0)), 0);  // (1, n)
  auto node_depth = at::cat({at::zeros({1, 1}, lopt), levels.gather(1, keep)}, 1);
  auto up = at::cat({at::zeros({1, 1}, lopt), tree_parents}, 1).unsqueeze(2).expand({1, n + 1, n + 1});
  auto mask = at::eye(n + 1, at::TensorOptions().dtype(at::kBool)).expand({1, n + 1, n + 1});
  for (int64_t i = 0; i < depth; ++i) mask = mask.bitwise_or(mask.gather(1, up));
  return {tokens.gather(1, keep), tree_parents, node_depth, mask};
}

// A lone row's catch-up over its backlog (as `draft_chain`), then its dynamic tree
// (`decoding.tree.expand_tree` at G = 1 with the head's forward, then `select_tree`): the top_k
// children of each of the top_k best frontier nodes for `depth` levels, level l's nodes at cache
// slots p + (l-1) top_k + i with RoPE position p + min(l - 1, max_rope) (p = start + R), each
// seeing the committed prefix and its ancestors. Returns the tree's tokens (1, n) in target ids,
// parents (1, n), depth (1, n+1), ancestor mask (1, n+1, n+1), the root logits (Vd,) and the
// boundary feature (H,).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_tree(
    const at::Tensor& tokens, const at::Tensor& feats, int64_t start, int64_t top_k, int64_t depth, int64_t n,
    int64_t max_rope, at::TensorList embed, int64_t embed_fmt, const at::Tensor& hidden_norm,
    const at::Tensor& input_norm, const at::Tensor& post_norm, const at::Tensor& final_norm, at::TensorList qkv_p,
    at::TensorList o_p, at::TensorList gu_p, at::TensorList down_p, at::IntArrayRef fmts, at::IntArrayRef ns,
    at::TensorList lm_head, int64_t lm_fmt, const at::Tensor& d2t, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor k_cache, at::Tensor v_cache, int64_t nh, int64_t nkv, double eps, double scale,
    bool norm_before_residual) {
  check_backlog(tokens, feats);
  const int64_t R = tokens.size(0), H = feats.size(1), k = top_k, p = start + R;
  TORCH_CHECK(k >= 1 && depth >= 1 && start >= 0 && max_rope >= 0, "draft_tree: top_k, depth >= 1; start, max_rope >= 0");
  TORCH_CHECK(n >= 1 && n <= k + (depth - 1) * k * k, "draft_tree: n must be 1 .. top_k + (depth - 1) top_k^2");
  TORCH_CHECK(p + k * (depth - 1) <= k_cache.size(2) && p <= cos.size(0) &&
                  p + std::min(max_rope, std::max<int64_t>(depth - 2, 0)) < cos.size(0),
              "draft_tree: the tree's slots or positions pass the cache's end");
  const Head m = make_head(feats, embed, embed_fmt, hidden_norm, input_norm, post_norm, final_norm, qkv_p, o_p, gu_p,
                           down_p, fmts, ns, lm_head, lm_fmt, d2t, cos, sin, k_cache, v_cache, nh, nkv, eps, scale,
                           norm_before_residual);
  auto tc = tokens.contiguous();
  auto fc = feats.contiguous();
  auto fopt = feats.options();
  auto lopt = at::TensorOptions().dtype(at::kLong);
  auto bopt = at::TensorOptions().dtype(at::kBool);
  at::Tensor h = head_layer(m, tc.data_ptr<int64_t>(), fc.data_ptr<float>(), R, start);
  auto boundary = h[R - 1].clone();
  auto root = at::empty({1, m.Vd}, fopt);
  head_logits(m, boundary.data_ptr<float>(), root.data_ptr<float>());
  auto to_target = [&](const at::Tensor& ids) { return ids + d2t.index({ids}); };
  // From here on expand_tree's ops, in its order, on its (G = 1) shapes.
  const int64_t scratch = k * (depth - 1);
  auto ar = at::arange(k, lopt);
  auto scratch_ar = at::arange(scratch, lopt);
  auto top = at::topk(at::log_softmax(root, -1), k);  // (1, k)
  std::vector<at::Tensor> toks{to_target(std::get<1>(top))}, scores{std::get<0>(top)};
  std::vector<at::Tensor> parents{at::full({1, k}, -1, lopt)}, levels{at::ones({1, k}, lopt)};
  auto front = ar.expand({1, k});
  auto front_tok = toks[0], front_score = std::get<0>(top);
  auto front_feat = boundary.expand({k, H}).contiguous();  // (k, H)
  auto front_anc = at::zeros({1, k, scratch}, bopt);
  int64_t n_cand = k;
  auto logits = at::empty({k, m.Vd}, fopt);
  for (int64_t level = 1; level < depth; ++level) {
    auto own = scratch_ar.unsqueeze(0) == ((level - 1) * k + ar).unsqueeze(1);  // (k, scratch)
    auto tree_mask = front_anc.bitwise_or(own);  // (1, k, scratch)
    auto mask = at::cat({at::ones({k, p}, bopt), tree_mask[0].narrow(1, 0, level * k)}, 1);
    auto slots = p + (level - 1) * k + ar;
    auto rope = at::full({k}, p + std::min(max_rope, level - 1), lopt);
    auto ft = front_tok.contiguous();
    auto hl = head_layer_at(m, ft.data_ptr<int64_t>(), front_feat.data_ptr<float>(), k, slots,
                            m.cos.index_select(0, rope), m.sin.index_select(0, rope), mask, p + level * k);
    head_logits(m, hl.data_ptr<float>(), logits.data_ptr<float>(), k);
    auto child = at::topk(at::log_softmax(logits.view({1, k, m.Vd}), -1), k);  // (1, k, k)
    auto child_score = (front_score.unsqueeze(2) + std::get<0>(child)).flatten(1);  // (1, k*k)
    auto child_tok = to_target(std::get<1>(child)).flatten(1);
    toks.push_back(child_tok);
    scores.push_back(child_score);
    parents.push_back(front.repeat_interleave(k, 1));
    levels.push_back(at::full({1, k * k}, level + 1, lopt));
    if (level < depth - 1) {
      auto best = std::get<1>(at::topk(child_score, k));  // (1, k) the next frontier
      auto par = best.div(k, "floor");
      front = n_cand + best;
      front_tok = child_tok.gather(1, best);
      front_score = child_score.gather(1, best);
      front_feat = hl.index_select(0, par[0]);
      front_anc = tree_mask.gather(1, par.unsqueeze(2).expand({1, k, scratch}));
    }
    n_cand += k * k;
  }
  auto [t, par, dep, mask] = select_tree_row(at::cat(toks, 1), at::cat(scores, 1), at::cat(parents, 1),
                                             at::cat(levels, 1), n, depth);
  return {t, par, dep, mask, root[0], boundary};
}
