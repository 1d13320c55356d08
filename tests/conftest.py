"""Shared fixtures: the embedded model (loaded once per test session), its tokenizer alone, a tiny random
Llama; and the markers that pick the fast subset (``make test-fast``).

Markers: ``model`` for a test that loads an embedded model (through a fixture below, or a page or CLI that
loads it), ``browser`` for one that drives a real Chromium, ``slow`` for a long model run. Fixture use and
the browser modules are marked here; a test that loads a model another way carries ``@pytest.mark.model``.
"""

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
from transformers import (AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PretrainedConfig,
                          PreTrainedTokenizerBase)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.engine.attention import ATTENTION_NAME, register_attention  # noqa: E402
from kvlab.engine.conversion import embedded_folder
from kvlab.engine.facts import LoadedModel, model_facts
from kvlab.engine.model import load_model# noqa: E402

MODEL_FIXTURES = {"model", "gemma", "server"}  # each loads an embedded model (the server's app loads one)
BROWSER_MODULES = {"test_browser", "test_browser_lessons"}
# Tests that load no embedded model but take about a second of CPU or more each (measured on this machine's
# two cores with the tiny models): slow, so that `make test-fast` stays well under a minute.
SLOW_TESTS = {
    "test_architectures.py::test_batched_appends_equal_each_cache_alone",
    "test_architectures.py::test_cacheblend_recomputing_everything_equals_full_prefill",
    "test_architectures.py::test_full_equals_the_models_own_forward_past_the_window",
    "test_architectures.py::test_greedy_decoding_and_batches_equal_the_models_own_forward",
    "test_arena.py::test_a_chat_in_progress_becomes_a_workload_that_replays_it",
    "test_arena.py::test_cancel_stops_between_turns",
    "test_arena.py::test_cancel_stops_inside_a_turn",
    "test_arena.py::test_cli_writes_csv_json_and_html",
    "test_batched.py::test_a_long_cache_runs_apart_from_short_ones_when_padding_is_costly",
    "test_batched.py::test_a_reply_kept_from_decoding_equals_a_reply_fed_again",
    "test_batched.py::test_an_interrupted_turn_leaves_the_session_as_before",
    "test_batched.py::test_append_together_equals_each_alone",
    "test_batched.py::test_identical_caches_decode_once_with_the_same_reply",
    "test_batched.py::test_last_logits_only",
    "test_batched.py::test_reduce_sees_every_state_once",
    "test_batched.py::test_session_with_a_budget_above_the_chat_matches_full_exactly",
    "test_chat_settings.py::test_a_stopped_turn_leaves_the_session_as_before",
    "test_chat_settings.py::test_settings_changed_clears_after_new_conversation",
    "test_edits.py::test_scripted_steps_chain_exactly",
    "test_failures.py::test_a_failed_policy_has_no_score_on_its_turn_and_after",
    "test_failures.py::test_arena_command_prints_the_error_and_exits_1",
    "test_failures.py::test_arena_rows_and_summaries_have_no_score_for_a_failed_policy",
    "test_kivi.py::test_sixteen_bits_is_the_eviction_policy_exactly",
    "test_kvstate.py::test_batched_generation_equals_each_cache_alone",
    "test_kvstate.py::test_budget_covering_everything_is_full",
    "test_kvstate.py::test_full_state_equals_one_forward",
    "test_kvstate.py::test_generate_kept_equals_generate_then_append_and_drop_last_undoes_it",
    "test_memory_equal.py::test_bytes_read_per_generated_token",
    "test_oracle.py::test_a_budget_covering_the_conversation_equals_full",
    "test_oracle.py::test_an_arena_cell_gives_the_oracle_its_script_and_rows_in_both_modes",
    "test_oracle.py::test_in_a_scripted_conversation_the_oracle_keeps_the_top_of_fulls_future",
    "test_oracle.py::test_the_oracle_fails_in_words_off_its_script_and_the_others_go_on",
    "test_policy_selection.py::test_cli_params_reach_the_run_and_its_records",
    "test_policy_selection.py::test_pages_draw_a_widget_per_parameter_and_use_it",
    "test_properties.py::test_engine_paging_figures_match_the_cache",
    "test_properties.py::test_eviction_invariants",
    "test_quest.py::test_quest_in_a_chat_keeps_every_key_and_counts_its_metadata",
    "test_rag.py::test_cacheblend_recomputing_everything_equals_full_prefill",
    "test_rag.py::test_run_end_to_end_on_tiny",
    "test_rope.py::test_rerotated_chunk_equals_chunk_prefilled_at_offset_tiny",
    "test_ruler.py::test_lengths_are_within_two_percent_of_the_request",
    "test_ruler.py::test_the_command_writes_workloads_and_a_manifest",
    "test_ruler.py::test_the_same_seed_gives_the_same_samples",
    "test_scbench.py::test_a_long_context_is_cut_in_the_middle_to_fit",
    "test_scbench.py::test_both_modes_run_and_score_by_the_tasks_metric",
    "test_scbench.py::test_chat_command_runs_a_record_and_says_what_it_cut",
    "test_sharing.py::test_cla1_equals_the_unshared_model",
    "test_sharing.py::test_cla2_shares_the_producers_kv",
    "test_single_shot.py::test_a_single_shot_turn_is_turn_one_then_that_question",
    "test_single_shot.py::test_report_and_cli_show_both_modes",
    "test_single_shot.py::test_rows_per_mode_and_turn",
    "test_stream.py::test_chunk_one_is_token_by_token_and_differs_from_chunks_only_where_it_must",
    "test_stream.py::test_dense_within_the_context_equals_one_plain_forward",
    "test_stream.py::test_recompute_equals_a_fresh_eager_forward_over_each_window",
    "test_stream.py::test_rerotated_positions_never_exceed_cache_plus_chunk",
    "test_stream.py::test_sinks_and_window_in_original_positions_equal_the_eager_masked_forward",
    "test_timings.py::test_rag_ttft_is_a_median_with_its_range",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests by what they load: ``model`` by fixture use, ``browser`` (and ``model``) by module,
    ``slow`` by ``SLOW_TESTS``, whose every name must still be a test of its module."""
    for item in items:
        if item.module.__name__ in BROWSER_MODULES:
            item.add_marker(pytest.mark.browser)
        if MODEL_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.model)
        if f"{item.path.name}::{item.originalname}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
    modules = {item.path.name: item.module for item in items}
    stale = []
    for name in SLOW_TESTS:
        file, test = name.split("::")
        if file in modules and not hasattr(modules[file], test):
            stale.append(name)
    if stale:
        raise pytest.UsageError(f"SLOW_TESTS names tests that no longer exist: {', '.join(stale)}")


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
