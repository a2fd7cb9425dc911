"""The draft vocabulary: the most frequent target tokens in the training responses."""

from __future__ import annotations

import torch

from ..errors import Eagle3Error


def build_draft_vocab(tokens: torch.Tensor, mask: torch.Tensor, vocab_size: int,
                      draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids (dv,) ascending, d2t (dv,) int64, t2d (V,) bool) from masked token counts.

    Takes the `draft_vocab_size` most frequent tokens where `mask` is set; when
    fewer distinct tokens occur, pads with the lowest unused ids, so `lm_head`
    always has exactly `draft_vocab_size` rows. target id = i + d2t[i].
    """
    if not 1 <= draft_vocab_size <= vocab_size:
        raise Eagle3Error(f"--draft-vocab {draft_vocab_size} must be in 1..{vocab_size} (the target's "
                          "vocabulary size)")
    counts = torch.bincount(tokens[mask.bool()].flatten(), minlength=vocab_size)[:vocab_size]
    # Stable order: by count descending, ties by id, so the choice is deterministic.
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))
    seen = [t for t in order if counts[t] > 0][:draft_vocab_size]
    chosen = set(seen)
    pad = [t for t in range(vocab_size) if t not in chosen][:draft_vocab_size - len(seen)]
    ids = torch.tensor(sorted(seen + pad), dtype=torch.long)
    d2t = ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids, d2t, t2d
