"""Shared fixtures: the embedded model (loaded once per test session), its tokenizer alone, a tiny random
Llama; and the markers that pick the fast subset (``make test-fast``).

Markers: ``model`` for a test that loads an embedded model (through a fixture below, or a page or CLI that
loads it), ``browser`` for one that drives a real Chromium, ``slow`` for a long model run. Fixture use and
the browser modules are marked here; a test that loads a model another way carries ``@pytest.mark.model``.
"""

from __future__ import annotations

import os
import signal
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
from transformers import (
    AutoConfig,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.engine import model as model_module  # noqa: E402
from kvlab.engine.attention import ATTENTION_NAME, register_attention  # noqa: E402
from kvlab.engine.conversion import embedded_folder
from kvlab.engine.facts import LoadedModel, model_facts
from kvlab.engine.model import load_model  # noqa: E402
from ui import common as ui_common  # noqa: E402

MODEL_FIXTURES = {"model", "gemma", "server"}  # each loads an embedded model (the server's app loads one)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Markers are declared where tests are defined (``slow``: a second or more of model passes on the tiny
    models, or Ray workers); this refuses a test that loads an embedded model or drives the browser unmarked,
    so `make test-fast` cannot start loading one by surprise."""
    unmarked = [item.nodeid for item in items
                if (MODEL_FIXTURES & set(item.fixturenames) and item.get_closest_marker("model") is None)
                or ("server" in item.fixturenames and item.get_closest_marker("browser") is None)]
    if unmarked:
        raise pytest.UsageError(f"tests that load an embedded model or drive the browser without the marker "
                                f"(model / browser): {', '.join(unmarked)}")


@pytest.fixture(autouse=True)
def weights_only_when_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test without the ``model`` mark fails where it loads a model's weights however it got there (a fixture
    looked up by name, a page, a CLI): the collection check sees only the fixtures a test names. Counted, and failed
    after the test, since a page's script thread swallows a failure raised in it; the pages' model cache is emptied
    for the test, so that a model an earlier test loaded does not hide the load. The embedded model's conversion on
    a first run (``embedded_folder``) reads the weights to write them, not to run them, and passes."""
    if request.node.get_closest_marker("model") is not None:
        yield
        return
    loads: list[str] = []

    class Refused:
        @staticmethod
        def from_pretrained(source, *args, **kwargs):
            loads.append(str(source))
            raise RuntimeError("a model's weights were loaded by a test without the model mark")

    monkeypatch.setattr(model_module, "AutoModelForCausalLM", Refused)
    monkeypatch.setattr(ui_common, "_MODELS", {})
    yield
    if loads:
        pytest.fail(f"this test loads a model's weights ({', '.join(loads)}) without the model mark")


@pytest.fixture
def terminal_sigint() -> Iterator[None]:
    """Ctrl-C as a terminal gives it, Python's own handler: a test run in the background inherits it ignored, and
    kvlab leaves an ignored Ctrl-C ignored."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def register_policy() -> Iterator:
    """Register test-only policies through the registry's own ``add``; they leave it when the test ends."""
    from kvlab.policies import POLICIES

    added: list[str] = []

    def add(cls: type) -> type:
        added.append(POLICIES.add(cls).name)
        return cls

    yield add
    for name in added:
        POLICIES.remove(name)


@pytest.fixture(scope="session")
def model() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct on the CPU in float32."""
    return load_model(device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    """The embedded SmolLM2's tokenizer, read from its converted folder without loading the weights."""
    return AutoTokenizer.from_pretrained(embedded_folder())


@pytest.fixture(scope="session")
def embedded_config() -> PretrainedConfig:
    """The embedded SmolLM2's config: its shape, for tests that check what a page or CLI loaded."""
    return AutoConfig.from_pretrained(embedded_folder())


@pytest.fixture(scope="session")
def tiny(tokenizer: PreTrainedTokenizerBase, embedded_config: PretrainedConfig) -> LoadedModel:
    """A randomly initialised 4-layer Llama (GQA 4→2 heads) sharing the embedded tokenizer."""
    register_attention()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=embedded_config.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0,
        attn_implementation=ATTENTION_NAME,
    )
    net = LlamaForCausalLM(cfg).eval()
    return LoadedModel(model=net, tokenizer=tokenizer, facts=model_facts("tiny-llama", net, "cpu"),
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
