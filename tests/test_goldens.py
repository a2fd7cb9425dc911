"""The same bits on every machine: the row-invariant kernels reproduce the committed goldens.

Every other bitwise test compares two computations on one machine (a path against the scalar
path, verify rows against decode rows); a change that moved every path together (an epilogue,
a rounding, a norm's order of operations) would pass them all. `tests/data/goldens.json`
(written by `recipes/goldens.py`, see `tests/goldens.py`) says what the bits must be: seeded
random checkpoints of six families in four weight formats and the real default target, on
every kernel path this CPU runs. A change that moves the bits on purpose regenerates the file
and says so in its commit.
"""

from __future__ import annotations

import pytest

import eagle3
import goldens
from eagle3.kernels import isa_paths, use_isa

CASES = [f"{n}-{f}" for n in goldens.FAMILIES for f in goldens.FORMATS]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return goldens.cases(tmp_path_factory.mktemp("goldens"))


def test_the_goldens_cover_every_case():
    want = goldens.read()
    assert sorted(want["random"]) == sorted(CASES) and want["default"]["ids"]


@pytest.mark.parametrize("case", CASES)
def test_random_targets_reproduce_their_goldens(built, case):
    want = goldens.read()["random"][case]
    t = goldens.load(*built[case])
    for path in isa_paths():
        with use_isa(path):
            assert goldens.record(t) == want, (case, path)


def test_the_default_target_reproduces_its_goldens():
    want = goldens.read()["default"]
    t = eagle3.load("default", "none", max_seq_len=goldens.MAX_LEN, calibrate=False).target
    for path in isa_paths():
        with use_isa(path):
            assert goldens.record(t) == want, path


def test_a_moved_weight_fails_the_goldens(built):
    """Negative control: one weight of the last MLP moved by 2^-12 of itself changes the
    record (a 1-ulp move of one weight can round away inside a 128-term sum)."""
    import torch

    t = goldens.load(*built["llama-fp32"])
    w = t.model.layers[-1].mlp.down_proj.w
    assert w.dtype == torch.float32
    w[0, 0] *= 1 + 2 ** -12
    assert goldens.record(t) != goldens.read()["random"]["llama-fp32"]
