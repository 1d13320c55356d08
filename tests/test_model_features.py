"""Your model: the sidebar lists the models in the local Hugging Face cache (free entry kept), and a model that
loads shows its architecture features (sliding windows, soft-cap, RoPE layout) with its facts."""

from __future__ import annotations

from pathlib import Path

import pytest
from page_helpers import APP
from streamlit.testing.v1 import AppTest
from tiny_models import build

import ui.common
from kvlab.engine.conversion import EMBEDDED
from kvlab.engine.facts import rope_summary, softcap_summary, window_summary
from kvlab.engine.model import cached_models


def test_each_tiny_architecture_states_its_features() -> None:
    gemma2, gemma3, phi3, llama = (build(arch)[0].facts for arch in ("gemma2", "gemma3", "phi3-partial-rotary",
                                                                      "llama"))
    assert gemma2.attn_softcap == 0.05 and softcap_summary(gemma2) == "tanh cap 0.05 on attention scores"
    assert phi3.rotary_fraction == 0.5 and rope_summary(phi3) == "partial: 8 of 16 dims turn"
    assert gemma3.rope_bases == (("full_attention", 1e6), ("sliding_attention", 1e4)) and gemma3.rope_theta == 1e6
    assert rope_summary(gemma3) == "all 16 dims turn; θ 1,000,000 full, 10,000 sliding"
    assert window_summary(gemma3) == "4 of 6 (window 8)"
    assert (llama.attn_softcap, llama.rotary_fraction, llama.rope_bases, llama.rope_scaling) == (None, 1.0, (), None)
    assert softcap_summary(llama) == "none" and rope_summary(llama) == "all 16 dims turn"
    assert gemma3.as_dict()["rope_bases"] == (("full_attention", 1e6), ("sliding_attention", 1e4))


def test_the_cache_scan_lists_models_with_a_config_and_no_folder_is_no_list(tmp_path: Path) -> None:
    for repo, files in {"models--acme--tiny-chat": ["config.json", "model.safetensors"],
                        "models--acme--only-tokenizer": ["tokenizer.json"],
                        "datasets--acme--facts": ["config.json"]}.items():
        snapshot = tmp_path / repo / "snapshots" / "abc123"
        snapshot.mkdir(parents=True)
        for name in files:
            (snapshot / name).write_text("{}")
        (tmp_path / repo / "refs").mkdir()
        (tmp_path / repo / "refs" / "main").write_text("abc123")
    assert cached_models(tmp_path) == ["acme/tiny-chat"]
    assert cached_models(tmp_path / "missing") == []


def test_the_sidebar_offers_cached_models_keeps_free_entry_and_shows_the_features(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the picked id is not really cached: refused without the network
    monkeypatch.setitem(ui.common._MODELS, (EMBEDDED, "auto", "auto", False), build("gemma3")[0])
    monkeypatch.setattr(ui.common, "_cached_models", lambda: ["kvlab-test/not-really-cached"])
    at = AppTest.from_file(APP, default_timeout=120).run()
    facts = dict(at.sidebar.table[0].value.values)
    assert facts["RoPE layout"] == "all 16 dims turn; θ 1,000,000 full, 10,000 sliding"
    assert facts["soft-cap"] == "none" and facts["sliding layers"] == "4 of 6 (window 8)"
    at.sidebar.radio(key="model_source").set_value("Hub id or local folder").run()
    picker = at.sidebar.selectbox(key="model_cached")
    assert picker.options == ["kvlab-test/not-really-cached"] and picker.value is None
    picker.set_value("kvlab-test/not-really-cached").run()
    assert at.sidebar.text_input(key="model_id").value == "kvlab-test/not-really-cached"  # filled, still free
    assert any("not in the local Hugging Face cache" in e.value for e in at.sidebar.error)
    assert any("Still on **tiny-gemma3**" in w.value for w in at.sidebar.warning)
    at.sidebar.text_input(key="model_id").set_value("./no-such-model-folder").run()
    assert any("no model folder" in e.value for e in at.sidebar.error) and not at.exception
    monkeypatch.setattr(ui.common, "_cached_models", lambda: [])
    at.run()
    assert any("No models in the local Hugging Face cache yet" in c.value for c in at.sidebar.caption)
