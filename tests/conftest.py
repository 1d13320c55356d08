"""Shared fixtures: the embedded model (loaded once per test session) and a tiny random Llama."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.engine.attention import ATTENTION_NAME, register_attention  # noqa: E402
from kvlab.engine.model import LoadedModel, _facts, load_model  # noqa: E402


@pytest.fixture(scope="session")
def model() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct on the CPU in float32."""
    return load_model(device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny(model: LoadedModel) -> LoadedModel:
    """A randomly initialised 4-layer Llama (GQA 4→2 heads) sharing the embedded tokenizer."""
    register_attention()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=model.facts.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0,
        attn_implementation=ATTENTION_NAME,
    )
    net = LlamaForCausalLM(cfg).eval()
    return LoadedModel(model=net, tokenizer=model.tokenizer, facts=_facts("tiny-llama", net, "cpu"),
                       lock=threading.RLock())


@pytest.fixture(scope="session")
def server() -> Iterator[str]:
    """The app under `streamlit run`, headless on a free local port: one for every browser test."""
    root = Path(__file__).resolve().parents[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(root / "app.py"), "--server.port", str(port),
         "--server.headless", "true"],
        cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/_stcore/health", timeout=2)
            break
        except OSError:
            time.sleep(1)
    yield url
    proc.terminate()
    proc.wait(timeout=30)
