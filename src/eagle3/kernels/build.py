"""Building the C++ kernels on first use and choosing their instruction-set path (the package's
docstring says what they compute)."""

from __future__ import annotations

import contextlib
import hashlib
import platform
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from ..errors import Eagle3Error

_DIR = Path(__file__).parent
_SOURCE = _DIR / "kernels.cpp"
_HEADERS = tuple(sorted(_DIR.glob("*.h")))  # common.h, one per path, the shared bodies


_STATUS: str | None = None
_BUILD_LOCK = threading.Lock()


def kernel_available() -> bool:
    """Whether the compiled kernels run here (built on the first call)."""
    return (_STATUS if _STATUS is not None else kernel_status()) == ""


def kernel_status() -> str:
    """'' when the compiled kernels run here, else why not (not an x86-64 CPU)."""
    global _STATUS
    if _STATUS is None:
        with _BUILD_LOCK:
            if _STATUS is None:
                _STATUS = _build()
    return _STATUS


def _build() -> str:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernels are written for x86-64, not {platform.machine()}"
    from torch.utils.cpp_extension import load

    # Built for the baseline x86-64: each path carries its own target attributes and is
    # chosen at run time. -ffp-contract=off: the epilogue's multiply and add must stay two
    # roundings on every path, as the PyTorch reference computes them.
    # cpp_extension rebuilds when a listed source or a flag changes: the headers' hash rides
    # along as a define so that editing a header alone rebuilds too.
    body = hashlib.sha256(b"".join(h.read_bytes() for h in _HEADERS)).hexdigest()[:16]
    try:
        load(name="eagle3_kernels", sources=[str(_SOURCE)], is_python_module=False,
             extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off", f"-I{_DIR}",
                           f"-DEAGLE3_FLOAT_BODY={body}"],
             extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler or headers: a failure a user must see, not a fallback
        raise Eagle3Error(f"the eagle3 kernels did not build ({str(e).splitlines()[0][:160]}); "
                          "install a C++ compiler (g++) and the Python headers") from None
    try:
        torch.ops.eagle3.isa()
    except RuntimeError as e:  # EAGLE3_ISA names no path (kernels.cpp's PATHS), or one this CPU cannot run
        raise Eagle3Error(str(e).splitlines()[0]) from None
    torch.library.register_fake("eagle3::wlinear")(_wlinear_fake)
    torch.library.register_fake("eagle3::attention")(_attention_fake)
    return ""


def isa() -> str:
    """The instruction-set path the kernels run ('avx512', 'avxvnni', 'avx2', 'scalar'), or why
    none."""
    return torch.ops.eagle3.isa() if kernel_available() else f"none ({kernel_status()})"


def isa_paths() -> list[str]:
    """Every kernel path this CPU can run, best first (empty where the kernels do not run)."""
    return list(torch.ops.eagle3.isa_paths()) if kernel_available() else []


def cpu_name() -> str:
    """The CPU's model name and the instruction sets the kernels care about, for reports."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
                 platform.processor() or platform.machine())
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    have = [f for f in ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "amx_int8") if f in flags]
    return f"{model} ({', '.join(have) or 'no AVX2'})"


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Run the kernels on path `name` within (for tests and comparisons; not thread-safe)."""
    kernel_status()
    before = torch.ops.eagle3.set_isa(name)
    try:
        yield
    finally:
        torch.ops.eagle3.set_isa(before)


def _wlinear_fake(x, w, scale, offset, fmt, group, N):  # shapes for torch.compile
    return x.new_empty(x.shape[0], N)


def _attention_fake(q, k, v, mask, scale, softcap):
    B, nh, T, hd = q.shape
    return q.new_empty(B, T, nh * hd)
