"""eagle3: lossless EAGLE-3 speculative decoding in plain PyTorch.

    import eagle3
    spec = eagle3.load("path/to/target", "path/to/head")
    result = spec.generate(prompt_ids, max_new_tokens=64)
    result.token_ids, result.stats
"""

from .api import load
from .errors import Eagle3Error
from .speculator import Eagle3Speculator, GenerationResult

__all__ = ["load", "Eagle3Speculator", "GenerationResult", "Eagle3Error"]
__version__ = "0.1.0"
