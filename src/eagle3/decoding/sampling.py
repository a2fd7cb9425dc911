"""Sampling (temperature, top-k, top-p) and the rejection rules that keep speculation lossless.

`Sampler.probs` turns logits into the distribution plain sampling draws from
(temperature, then top-k, then top-p: transformers' order and semantics, top-p's
cut made exact: `nucleus`);
every speculative path accepts or rejects against exactly these
probabilities, so speculative sampling draws from the same distribution as
plain sampling.

Rules (each lossless in distribution):
    speculative_accept   chain drafts sampled from the draft's q: accept d with
                         min(1, p(d)/q(d)), else resample from norm(max(p - q, 0));
                         `q=None` is the one-hot variant for argmax drafts
                         (accept with p(d), else resample from p without d)
    tree_accept          EAGLE's multi-candidate recursive rejection over a tree of
                         deterministic candidates: try each distinct child x with
                         probability p(x); on rejection zero p(x) and renormalise;
                         when every child fails, sample from the residual
Randomness comes from one `torch.Generator` per generation: same seed, same output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import Eagle3Error
from ..kernels import top_p_cut

MIN_TEMPERATURE = 1e-4  # below this, logits / T overflows float32 for typical logits


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_sampling(temperature: Any, top_p: Any, top_k: Any, seed: Any) -> SamplingParams:
    """Validate the sampling arguments (one clear error each)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            temperature == 0.0 or MIN_TEMPERATURE <= temperature < float("inf")):
        raise Eagle3Error(f"temperature must be 0 (greedy) or a number >= {MIN_TEMPERATURE:g}, "
                          f"got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise Eagle3Error(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise Eagle3Error(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise Eagle3Error(f"seed must be a non-negative integer or None, got {seed!r}")
    return SamplingParams(float(temperature), float(top_p), top_k, seed)


class Sampler:
    """The target's sampling distribution and one seeded random stream."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator = torch.Generator(device=device)
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(mix_seed(params.seed))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits (..., V) -> probabilities (..., V) in float32, after temperature, top-k, top-p."""
        p = self.params
        scores = logits.float() / p.temperature
        if 0 < p.top_k < scores.shape[-1]:
            kth = scores.topk(p.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))  # ties with the k-th stay
        if p.top_p < 1.0:
            if not top_p_cut(scores, scores.softmax(-1), p.top_p):  # in place, C++ where it runs
                scores = scores.masked_fill(~nucleus(scores, p.top_p), float("-inf"))
        return scores.softmax(-1)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One draw per row of probs (..., V), non-negative weights (normalised or not) -> ids (...).

        Inverse CDF in float64: one uniform u per row, the first id whose cumulative weight
        exceeds u x the total. An id of weight 0 adds nothing to the cumulative sum, so it is
        never the first to exceed it; the one case rounding could leave (u x total rounding up
        to the total) takes the last id of positive weight. `torch.multinomial` draws the same
        distribution at ~20x the cost over a 49,152-token vocabulary (docs/decoding.md)."""
        flat = probs.reshape(-1, probs.shape[-1])
        cdf = flat.double().cumsum(-1)  # (R, V)
        total = cdf[:, -1:].contiguous()
        u = torch.rand(flat.shape[0], 1, generator=self.generator, dtype=torch.float64, device=flat.device)
        ids = torch.searchsorted(cdf, u * total, right=True)  # first i with cdf[i] > u * total
        last = torch.searchsorted(cdf, total)  # the last id of positive weight
        return torch.minimum(ids, last).view(probs.shape[:-1])

    def uniform(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.rand(n, generator=self.generator, device=device)


# A probability as a whole number of 2^-40ths: a row's masses add up to about 2^40 (far below
# float64's 2^53), so every sum of them below is exact, whatever its order.
MASS_UNIT = 2.0 ** 40
FIRST_CANDIDATES = 64  # top-p looks at this many most likely tokens first, more as needed


def nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Scores (..., V) (logits after temperature) -> the tokens top-p keeps (..., V), bool.

    The rule (transformers' `TopPLogitsWarper`, made exact): a token is dropped when the total
    probability (softmax of the scores) of the tokens no more likely than it is <= 1 - top_p;
    the most likely tokens always survive. Each probability is rounded to a whole number of
    2^-40ths (`MASS_UNIT`, exact in float32) and every sum is taken over those whole numbers,
    which float64 adds exactly in any order; equally likely tokens are kept or dropped together
    (the cut never splits a tie, where a sort's float32 cumulative sum keeps whichever of them
    the sort put last).

    Partial selection, equal to the full sort by construction: with the m highest-scoring
    tokens' masses in descending order v_0 >= v_1 >= ..., the mass of the tokens no more
    likely than v_r's is total - (v_0 + ... + v_{r-1}) (every larger mass is among the m), so
    the first r where that is <= the budget, and the kept set {mass >= v_{r-1}}, are the full
    sort's as soon as one of the m, or the next, is dropped; otherwise m grows (at m = V the
    sort is complete).
    """
    shape, V = scores.shape, scores.shape[-1]
    flat = scores.reshape(-1, V)  # (R, V)
    mass = flat.softmax(-1).mul_(MASS_UNIT).round_()  # (R, V) whole numbers, exact in float32
    total = mass.sum(-1, keepdim=True, dtype=torch.float64)  # (R, 1), exact
    budget = math.floor((1.0 - top_p) * MASS_UNIT)
    m = min(V, FIRST_CANDIDATES)
    while True:
        top = mass.gather(-1, flat.topk(m, dim=-1).indices).double()  # (R, m) descending
        no_larger = total - (top.cumsum(-1) - top)  # (R, m): mass of the tokens <= v_r
        dropped = no_larger <= budget
        beyond = (total - top.sum(-1, keepdim=True) <= budget).squeeze(-1)  # v_m would be dropped
        if m == V or bool((dropped.any(-1) | beyond).all()):
            break
        m = V if 16 * m >= V else 4 * m  # a wide nucleus: the full sort costs less than more tries
    first = torch.where(dropped.any(-1), dropped.int().argmax(-1), m).clamp_min(1)  # (R,)
    threshold = top.gather(-1, (first - 1)[:, None]).float()  # (R, 1): the least likely kept mass
    return (mass >= threshold).view(shape)


def mix_seed(seed: int) -> int:
    """splitmix64 of `seed`: torch's generator seeded with nearby small integers (0, 1, 2, ...)
    gives measurably correlated first draws; mixed seeds give independent streams."""
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def speculative_accept(sampler: Sampler, p: torch.Tensor, drafts: torch.Tensor,
                       q: torch.Tensor | None = None) -> tuple[int, int]:
    """Accept a prefix of k chain drafts against the target; returns (accepted a, next token).

    p (k+1, V): target probabilities after the anchor and after each draft;
    drafts (k,): the draft tokens; q (k, V): the draft's probabilities each was
    sampled from, or None for drafts chosen deterministically (argmax). The next
    token is the resample at the first rejection, or the bonus drawn from p[k].
    One host synchronisation for the acceptance, one draw for the next token.
    """
    k = drafts.shape[0]
    if k:
        rows = torch.arange(k, device=p.device)
        p_d = p[rows, drafts]
        q_d = torch.ones_like(p_d) if q is None else q[rows, drafts]
        accepted = sampler.uniform(k, p.device) * q_d < p_d  # r < p/q, without dividing
        a = int(torch.cat([~accepted, accepted.new_ones(1)]).int().argmax())
    else:
        a = 0
    if a == k:
        return a, int(sampler.sample(p[k]))
    if q is None:
        residual = p[a].clone()
        residual[drafts[a]] = 0.0
    else:
        residual = (p[a] - q[a]).clamp_min(0.0)
    total = residual.sum()
    # p == q leaves no residual but then every draft is accepted; guard rounding only.
    residual = residual / total if float(total) > 0 else p[a]
    return a, int(sampler.sample(residual))


def tree_accept(sampler: Sampler, probs: torch.Tensor, tokens: list[int],
                parents: list[int]) -> tuple[list[int], int]:
    """Walk a draft tree with recursive rejection; returns (accepted node path, next token).

    probs (N+1, V): the target's sampling distribution at the root (row 0) and
    after each node; node j (1..N) has token tokens[j-1] and parent parents[j-1];
    a node's children are tried in node order (best draft score first). Zeroing
    the rejected children and renormalising is kept as bookkeeping: a child x is
    accepted with p(x) / (1 - rejected mass), so the walk needs only the children's
    p values (one gather, one host sync) and one uniform per node; the path
    excludes the root.
    """
    N = len(tokens)
    device = probs.device
    node_idx = torch.tensor(parents, device=device)
    tok_idx = torch.tensor(tokens, device=device)
    host = torch.cat([probs[node_idx, tok_idx].double(), sampler.uniform(N, device).double()])
    host = host.tolist() if N else []
    p_child, u = host[:N], host[N:]
    children: dict[int, list[int]] = {}
    for j, par in enumerate(parents, start=1):
        children.setdefault(par, []).append(j)
    path: list[int] = []
    node = 0
    while True:
        rejected: list[int] = []
        rejected_mass = 0.0
        chosen = None
        for child in children.get(node, ()):
            tok = tokens[child - 1]
            if tok in rejected:  # a duplicate token: already tried at this node
                continue
            if u[child - 1] * (1.0 - rejected_mass) < p_child[child - 1]:
                chosen = child
                break
            rejected.append(tok)
            rejected_mass += p_child[child - 1]
        if chosen is None:
            residual = probs[node].clone()
            if rejected:
                residual[rejected] = 0.0
            total = residual.sum()
            # Only rounding can leave no mass (the children held all of it): fall back to p.
            return path, int(sampler.sample(residual / total if float(total) > 0 else probs[node]))
        path.append(chosen)
        node = chosen
