"""The embedded Gemma-3-270M through kvlab equals its own eager forward past its 512-token window."""

from __future__ import annotations

import pytest
import torch
from tiny_models import eager

from kvlab.engine.batched import append_together
from kvlab.engine.conversion import GEMMA
from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import KVState
from kvlab.engine.model import load_model
from kvlab.policies import make_policy
from kvlab.policies.evict import evict
from kvlab.workloads.rag.corpus import load_corpus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma() -> LoadedModel:
    return load_model(GEMMA, device="cpu", dtype="float32")


def _text_ids(lm: LoadedModel, n: int) -> list[int]:
    text = " ".join(d.text for d in load_corpus().documents)
    ids = lm.tokenizer(text)["input_ids"]  # with <bos>, as the tokenizer builds prompts
    assert ids[0] == lm.tokenizer.bos_token_id and len(ids) >= n
    return ids[:n]


@pytest.mark.model
@torch.no_grad()
def test_full_equals_gemmas_own_forward_past_its_window(gemma: LoadedModel) -> None:
    ids = _text_ids(gemma, 700)
    with eager(gemma):
        own = gemma.model(input_ids=torch.tensor([ids]), logits_to_keep=200).logits[0].float()  # positions 500…699
    state = KVState(gemma)
    state.append(ids[:500], logits_to_keep=1)
    ours = torch.cat([state.append(ids[500:690]), *(state.append([t]) for t in ids[690:])])
    assert (ours - own).abs().max() < 1e-3 * own.abs().max()
    assert torch.equal(ours.argmax(-1), own.argmax(-1))
    windows = gemma.facts.layer_windows
    assert state.lengths() == [700 if w is None else w - 1 for w in windows]


@pytest.mark.model
@torch.no_grad()
def test_gemma_eviction_equals_its_own_forward_with_the_evicted_keys_masked(gemma: LoadedModel) -> None:
    ids = _text_ids(gemma, 660)
    full, sink = KVState(gemma), KVState(gemma)
    append_together([full, sink], ids[:600], logits_to_keep=1)
    evict(sink, make_policy("streamingllm"), [128] * gemma.facts.n_layers, None)
    kept = {"full_attention": set(sink.positions[5][0].tolist()),
            "sliding_attention": set(sink.positions[0][0].tolist())}
    assert kept["full_attention"] == set(range(4)) | set(range(476, 600))  # the sinks and the last 124
    assert kept["sliding_attention"] == set(range(472, 600))  # the last 128 of the 511 the window left
    ours = sink.append(ids[600:])
    n = len(ids)
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]

    def visible(kind: str) -> torch.Tensor:
        gone = torch.zeros(n, n, dtype=torch.bool)
        gone[600:, sorted(set(range(600)) - kept[kind])] = True
        return (k <= q) & ~gone

    allowed = {"full_attention": visible("full_attention"),
               "sliding_attention": visible("sliding_attention") & (q - k < 512)}
    masks = {kind: torch.zeros(n, n).masked_fill(~a, torch.finfo(torch.float32).min)[None, None]
             for kind, a in allowed.items()}
    with eager(gemma):
        own = gemma.model(input_ids=torch.tensor([ids]), attention_mask=masks, logits_to_keep=60).logits[0].float()
    assert (ours - own).abs().max() < 1e-3 * own.abs().max()
    assert torch.equal(ours.argmax(-1), own.argmax(-1))
