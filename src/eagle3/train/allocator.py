"""Process memory: keep a long training or regeneration loop as fast at its end as at its start.

A loop whose tensors change shape every step (ragged batches) makes glibc hand pages back to the
kernel and fault them in again all the time: large blocks come from fresh mmaps (unmapped when
freed) until glibc's threshold rises past them, and the heap's free top is trimmed whenever it
exceeds twice that threshold, so a long train-draft run slowed step by step, and a small fixed
threshold made it worse (the profiles: docs/training.md, "Operations"). So: every block up to
glibc's largest threshold comes from the heap, and the heap keeps its pages.
"""

from __future__ import annotations

import ctypes
import sys

# glibc's mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # the most glibc allows (HEAP_MAX / 2): larger blocks still get mmaps
TRIM_THRESHOLD = 1 << 30  # the heap's free top is handed back only past 1 GiB
TOP_PAD = 64 << 20  # and grows by 64 MiB at a time


def steady_allocator() -> bool:
    """Fix glibc's thresholds for this process (setting them turns its dynamic adjustment off).
    True where it took effect (Linux with glibc); False elsewhere, where nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
