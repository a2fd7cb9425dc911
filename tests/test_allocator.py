"""`steady_allocator`: a loop of ragged tensors stops handing pages back to the kernel and faulting
them in again. Each case runs in a fresh process: the setting is process-wide."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import resource, sys, torch
torch.set_num_threads(1)
if sys.argv[1] == "steady":
    from eagle3.train.allocator import steady_allocator
    assert steady_allocator() is True
else:  # glibc's behaviour for blocks below its current threshold, made deterministic: fresh mmaps
    import ctypes
    assert ctypes.CDLL(None).mallopt(-3, 1 << 20) == 1  # M_MMAP_THRESHOLD
def churn(rounds):  # 4 tensors of 2..20 MiB a round, a different mix each round, as ragged batches
    for i in range(rounds):
        blocks = [torch.ones(((i * 7 + j * 3) % 19 + 2) << 20, dtype=torch.uint8) for j in range(4)]
        del blocks
churn(20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn(100)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults_of_a_ragged_loop(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_a_ragged_loop_keeps_its_pages():
    # Left to itself glibc serves such blocks from mmaps until its threshold rises past them
    # (and trims the heap); how soon depends on what the process freed before. Served from
    # mmaps, the loop faults every page in again: ~1.1M faults of 4 KiB here.
    assert page_faults_of_a_ragged_loop("mmap") > 100_000
    assert page_faults_of_a_ragged_loop("steady") < 2_000  # the heap keeps them (measured 0)
