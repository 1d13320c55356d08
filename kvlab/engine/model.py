"""Loading the language model kvlab drives: an embedded model, a hub id or a local folder, on its device.

The device is cuda when present, else mps, else cpu, and the dtype follows it; a hub id that is neither
cached nor reachable fails fast, and a model kvlab could not compute exactly is refused before its
weights are read. The embedded models' conversion is ``conversion.py``; what is known about a loaded
model is ``facts.py``.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
from huggingface_hub import scan_cache_dir
from huggingface_hub.errors import CacheNotFound
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.utils import logging as hf_logging

from kvlab.engine.architecture import causal_lm_class, refusal
from kvlab.engine.attention import ATTENTION_NAME, register_attention
from kvlab.engine.conversion import EMBEDDED, ModelLoadError, embedded_folder, embedded_model
from kvlab.engine.facts import LoadedModel, model_facts
from kvlab.engine.linear import onednn_linears
from kvlab.engine.progress import Progress

DEVICE = re.compile(r"cpu|mps|cuda(:\d+)?")  # what --device and the sidebar may name besides auto

def pick_device(requested: str | None = None) -> str:
    """cuda when present, else mps, else cpu; an explicit request wins if it is available."""
    if requested and requested != "auto":
        if not DEVICE.fullmatch(requested):
            raise ModelLoadError(f"{requested!r} is not a device kvlab runs on: auto, cpu, cuda, cuda:N or mps")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if requested.startswith("cuda:") and 0 < count <= int(requested[5:]):
            raise ModelLoadError(f"device {requested!r} was requested but CUDA has devices 0 to {count - 1} here")
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


DTYPES = ("auto", "float32", "bfloat16", "float16")


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


def cached_models(cache_dir: str | Path | None = None) -> list[str]:
    """The hub ids of the models already in the local Hugging Face cache (those with a ``config.json``), sorted;
    empty where there is no cache folder or it cannot be read, so a picker offers nothing rather than failing."""
    try:
        info = scan_cache_dir(cache_dir)
    except (CacheNotFound, OSError, ValueError):
        return []
    return sorted(repo.repo_id for repo in info.repos if repo.repo_type == "model"
                  and any(f.file_name == "config.json" for rev in repo.revisions for f in rev.files))


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
    onednn_linears(model)
    if progress:
        progress(1.0, f"Loaded {name} on {dev}")
    return LoadedModel(model=model, tokenizer=tokenizer, facts=model_facts(name, model, dev))
