"""Export to ExecuTorch (`eagle3 export`) and the `executorch` runtime backend."""

from .program import QUANTIZE_MODES, export_program
from .runtime import ExecutorchSpeculator, load_program

__all__ = ["QUANTIZE_MODES", "ExecutorchSpeculator", "export_program", "load_program"]
