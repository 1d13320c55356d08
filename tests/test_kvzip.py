"""KVzip: the repeat prompt as the authors build it, the scores against transformers' own eager attention of the
repeating queries, hand-computed keep sets (GQA max, sinks, one top-k over every layer and head, the budget), Full
at a covering budget, earlier turns' scores kept, its extra prefill in the records, and check-policy."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build
from transformers import PreTrainedTokenizerBase

from kvlab.engine.kvstate import KVState, to_kv_heads_max
from kvlab.engine.reconstruction import (
    CHUNK_SIZE,
    PREV_POSTFIX,
    RepeatSpec,
    reconstruct,
    repeat_inputs,
    repeat_suffix,
)
from kvlab.engine.tiny import byte_tokenizer
from kvlab.errors import KvlabError
from kvlab.experiments.conformance import check_policies
from kvlab.policies import LayerView, make_policy
from kvlab.policies.evict import evict, keep_model
from kvlab.workloads.chat.records import turn_table
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

TOL = 1e-5
TEXT = "The harbour town has a red lighthouse, a bakery and three goats."
TURNS = ("My locker code is 4127 and the lighthouse is red.", "Tell me about harbours, please.",
         "What is my locker code?")


def encoder(tokenizer: PreTrainedTokenizerBase):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


# --- the repeat prompt ------------------------------------------------------------------------------------------


def test_the_repeat_prompt_is_the_authors_template(tokenizer: PreTrainedTokenizerBase) -> None:
    encode = encoder(tokenizer)
    suffix = repeat_suffix(tokenizer)
    assert suffix == "<|im_end|>\n<|im_start|>assistant\n"  # model/template.py's postfix for ChatML (Qwen) models
    # kvpress's rule reads the same off the template: a user message up to a separator, the generation prompt after
    marked = tokenizer.apply_chat_template([{"role": "user", "content": "dummy context\n#############"}],
                                           add_generation_prompt=True, tokenize=False)
    assert marked.split("\n#############")[1] == suffix
    assert (CHUNK_SIZE, PREV_POSTFIX) == (2000, 8)  # ModelKVzip.self_task's chunk_size and prev_postfix_size
    ids = encode(TEXT * 3)
    inputs = repeat_inputs(encode, suffix, ids, chunk_size=20)
    assert [(a, b) for a, b, _ in inputs] == [(s, min(s + 20, len(ids))) for s in range(0, len(ids), 20)]
    # self_task written out: "\n\n" + the request, the previous chunk's last 8 tokens for later chunks, the postfix,
    # then the chunk itself, every piece encoded alone
    first = tokenizer.decode(inputs[0][2])
    assert first == "\n\nRepeat the previous context exactly.<|im_end|>\n<|im_start|>assistant\n" + \
        tokenizer.decode(ids[:20])
    assert inputs[0][2] == encode("\n\nRepeat the previous context exactly.") + encode(suffix) + ids[:20]
    assert inputs[1][2] == (encode("\n\nRepeat the part of the previous context exactly, starting with ") + ids[12:20]
                            + encode(suffix) + ids[20:40])
    assert tokenizer.decode(inputs[1][2]).startswith(
        "\n\nRepeat the part of the previous context exactly, starting with " + tokenizer.decode(ids[12:20]))
    assert len(repeat_inputs(encode, suffix, ids)) == 1  # under 2000 tokens: one chunk


def test_without_a_chat_template_the_suffix_is_a_line_break() -> None:
    assert repeat_suffix(byte_tokenizer()) == "\n"  # kvpress's default for a model without a template


# --- the scores against eager attention -------------------------------------------------------------------------


def eager_scores(lm, reference, ids: list[int], sinks: int, chunk: int) -> list[torch.Tensor]:
    """Per layer [kv_heads, len(ids)]: the authors' score from transformers' eager attention over ids + each
    chunk's repeat input: each repeat query's softmax renormalised over the sinks, the chunk and the repeat's own
    keys (``_get_score``), the max over the repeat queries, then over each KV head's query heads."""
    n, group = len(ids), lm.facts.n_heads // lm.facts.n_kv_heads
    out = [torch.zeros(lm.facts.n_kv_heads, n, dtype=torch.float64) for _ in range(lm.facts.n_layers)]
    for start, stop, rep in repeat_inputs(lm.encode, repeat_suffix(lm.tokenizer), ids, chunk):
        with torch.no_grad():
            maps = reference(input_ids=torch.tensor([ids + rep]), output_attentions=True).attentions
        cols = sorted(set(range(sinks)) | set(range(start, stop)) | set(range(n, n + len(rep))))
        chunk_cols = [cols.index(p) for p in range(start, stop)]
        for layer, attn in enumerate(maps):
            rows = attn[0, :, n:, cols].double()  # [heads, repeat queries, kept columns]
            rows = rows / rows.sum(-1, keepdim=True)
            best = rows[..., chunk_cols].amax(dim=1)  # [heads, chunk]: max over the repeat queries
            out[layer][:, start:stop] = best.view(lm.facts.n_kv_heads, group, -1).amax(dim=1)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2-window", "gemma2"])  # GQA; sliding layers; soft-capping
@pytest.mark.parametrize("chunk", [CHUNK_SIZE, 23])  # one chunk (every key in the softmax), or three
def test_scores_are_the_most_eager_attention_a_repeat_query_gives(arch: str, chunk: int) -> None:
    lm, reference = build(arch, tokenizer=byte_tokenizer())
    ids = lm.encode(TEXT)
    sinks = 3
    state = KVState(lm)
    state.append(ids)
    before = state.snapshot()
    cost = reconstruct(state, RepeatSpec(n_sink=sinks, chunk_size=chunk))
    inputs = repeat_inputs(lm.encode, "\n", ids, chunk)
    assert (cost.tokens, cost.chunks) == (sum(len(r) for *_, r in inputs), len(inputs))
    assert state.reconstructed == len(ids) and state.tokens == ids
    for lay, saved in zip(state.layers, before["layers"]):  # the pass left the cache as it was
        assert torch.equal(lay.keys, saved["keys"]) and torch.equal(lay.values, saved["values"])
        assert torch.equal(lay.positions, saved["positions"])
    want = eager_scores(lm, reference, ids, sinks, chunk)
    checked = 0
    for lay, expected in zip(state.layers, want):
        for head in range(lm.facts.n_kv_heads):
            pos = lay.positions[head]  # a sliding layer holds only its window's slots
            assert (lay.reconstruction[head].double() - expected[head, pos]).abs().max() < TOL
            checked += len(pos)
    assert checked >= len(ids) * lm.facts.n_kv_heads  # every full layer's slots, at least


@pytest.mark.parametrize("chunk", [CHUNK_SIZE, 23])
def test_one_compression_keeps_the_authors_top_scores_over_the_whole_model(chunk: int) -> None:
    """The kept positions after one compression: kvpress's rule on the eager scores (the first n_sink scored 1,
    one sort over every layer and head) against kvlab's cache."""
    lm, reference = build("llama", tokenizer=byte_tokenizer())
    ids, sinks, budget = lm.encode(TEXT), 4, 10
    want = eager_scores(lm, reference, ids, sinks, chunk)
    for scores in want:
        scores[:, :sinks] = 1.0  # kvpress's score_val[..., :n_sink] = 1
    flat = torch.cat([s.reshape(-1) for s in want])
    top = set(flat.sort(descending=True).indices[: budget * lm.facts.n_layers * lm.facts.n_kv_heads].tolist())
    n, kv = len(ids), lm.facts.n_kv_heads
    expected = [[[p for p in range(n) if (layer * kv + head) * n + p in top] for head in range(kv)]
                for layer in range(lm.facts.n_layers)]
    state = KVState(lm)
    state.append(ids)
    evict(state, make_policy("kvzip", n_sink=sinks, chunk_size=chunk), [budget] * lm.facts.n_layers, None)
    assert [[kept.tolist() for kept in heads] for heads in state.kept_positions()] == expected
    assert len({len(h) for heads in expected for h in heads}) > 1  # layers and heads keep different numbers


def test_gqa_takes_the_max_over_each_kv_heads_query_heads() -> None:
    per_query_head = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.1, 0.2], [0.0, 0.3, 0.9], [0.4, 0.3, 0.1]])
    assert torch.equal(to_kv_heads_max(per_query_head, 2), torch.tensor([[0.5, 0.7, 0.2], [0.4, 0.3, 0.9]]))


# --- selection -------------------------------------------------------------------------------------------------

# reconstruction scores of 2 layers × 2 KV heads × 5 slots (positions 0…4)
SCORES = [torch.tensor([[0.90, 0.10, 0.50, 0.20, 0.30], [0.30, 0.80, 0.05, 0.60, 0.00]]),
          torch.tensor([[0.40, 0.45, 0.00, 0.70, 0.10], [0.20, 0.10, 0.15, 0.35, 0.01]])]


def view(layer: int, budget: int) -> LayerView:
    return LayerView(layer=layer, budget=budget, positions=torch.arange(5).expand(2, 5), keys=torch.zeros(2, 5, 4),
                     window_mean={}, accumulated=None, reconstruction=SCORES[layer])


def test_one_top_k_over_every_layer_and_head_keeps_the_sinks_within_the_budget() -> None:
    policy = make_policy("kvzip", n_sink=1)
    assert policy.model_budget and not policy.shared_budget and policy.needs_reconstruction
    keep = keep_model([policy.scores(view(layer, 2)) for layer in (0, 1)], [2, 2])
    # 2 × 2 layers × 2 heads = 8 keys: the 4 sinks (position 0 everywhere), then 0.80, 0.70, 0.60, 0.50
    assert [[torch.nonzero(h).flatten().tolist() for h in k] for k in keep] == [[[0, 2], [0, 1, 3]], [[0, 3], [0]]]
    assert sum(int(k.sum()) for k in keep) == 8
    with pytest.raises(KvlabError, match="no reconstruction scores"):
        policy.scores(LayerView(layer=0, budget=2, positions=torch.arange(5).expand(2, 5),
                                keys=torch.zeros(2, 5, 4), window_mean={}, accumulated=None))


@pytest.mark.parametrize(("level", "want"), [
    ("pair", [[[0, 2], [0, 1, 3]], [[0, 3], [0]]]),  # one budget over the model (as above)
    ("layer", [[[0], [0, 1, 3]], [[0, 1, 3], [0]]]),  # 2 × 2 heads per layer (kvpress's layerwise)
    ("pair-uniform", [[[0, 2], [0, 1]], [[0, 3], [0, 3]]]),  # 2 per head
])
def test_evict_applies_each_level_to_the_stored_scores(level: str, want: list) -> None:
    lm, _ = build("llama", layers=2, tokenizer=byte_tokenizer())
    state = KVState(lm)
    state.append(lm.encode("abcde"))
    for lay, scores in zip(state.layers, SCORES):
        lay.reconstruction = scores.clone()
    state.reconstructed = state.seen  # every slot scored: evict runs no pass
    dropped = evict(state, make_policy("kvzip", n_sink=1, level=level), [2, 2], None)
    assert [[kept.tolist() for kept in heads] for heads in state.kept_positions()] == want
    assert dropped == 20 - 8 and sum(sum(map(len, heads)) for heads in state.kept_positions()) == 8
    kept_scores = [lay.reconstruction[lay.real].tolist() for lay in state.layers]  # scores moved with their slots
    assert kept_scores == [SCORES[i][torch.tensor([[p in w for p in range(5)] for w in want[i]])].tolist()
                           for i in range(2)]


# --- in a conversation ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(tokenizer: PreTrainedTokenizerBase):
    """A tiny random Llama with the embedded tokenizer and its chat template."""
    return build("llama", tokenizer=tokenizer, context=4096)[0]


def repeat_tokens(lm, ids: list[int]) -> int:
    """Tokens the reconstruction of ``ids`` runs."""
    return sum(len(r) for *_, r in repeat_inputs(lm.encode, repeat_suffix(lm.tokenizer), ids))


@pytest.mark.slow
def test_a_budget_covering_the_conversation_equals_full_and_its_extra_prefill_is_recorded(chat_model) -> None:
    session = ChatSession(chat_model, ChatSettings(policies=("full", "kvzip"), budget=2048, max_new_tokens=5))
    phases: list[str] = []
    seen = 0
    for message in TURNS:
        turn = session.run_turn(message, on_phase=phases.append)
        full, kvzip = turn.policies["full"], turn.policies["kvzip"]
        assert kvzip.retained == full.retained and kvzip.reply == full.reply
        assert kvzip.kl < 1e-6 and kvzip.top1 == 1.0
        tokens = session.states["full"].tokens
        message_end = turn.segments[-2]["end"]  # the user message's span, then the reply's
        assert kvzip.extra_prefill_tokens == (repeat_tokens(chat_model, tokens[seen:message_end])
                                              + repeat_tokens(chat_model, tokens[message_end:]))
        assert kvzip.extra_prefill_s > 0 and kvzip.time_s >= kvzip.extra_prefill_s
        assert full.extra_prefill_tokens == 0
        seen = len(tokens)
    assert sum(p.startswith("KVzip: repeating ") and "extra prefill" in p for p in phases) == 2 * len(TURNS)
    table = turn_table(session.turns)
    assert {"extra_prefill_tokens", "extra_prefill_s"} <= set(table.columns)
    assert (table[table["policy"] == "kvzip"]["extra_prefill_tokens"] > 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["original", "rerotated"])
def test_each_turn_reconstructs_only_its_new_tokens_and_earlier_scores_stay(chat_model, mode: str) -> None:
    budget = 24
    session = ChatSession(chat_model, ChatSettings(policies=("full", "kvzip"), budget=budget, max_new_tokens=4,
                                                   position_mode=mode))
    state = session.states["kvzip"]
    seen, before = 0, {}
    for message in TURNS:
        turn = session.run_turn(message)
        tokens = state.tokens
        message_end = turn.segments[-2]["end"]
        rec = turn.policies["kvzip"]
        assert rec.error is None
        assert rec.extra_prefill_tokens == (repeat_tokens(chat_model, tokens[seen:message_end])
                                            + repeat_tokens(chat_model, tokens[message_end:]))
        now = {(layer, head, int(p)): float(s)
               for layer, lay in enumerate(state.layers) for head in range(lay.positions.shape[0])
               for p, s, real in zip(lay.positions[head], lay.reconstruction[head], lay.real[head]) if real}
        kept_before = [k for k in now if k[2] < seen]
        assert kept_before or seen == 0
        assert all(now[k] == before[k] for k in kept_before)  # never recomputed
        assert any(k[2] >= seen and now[k] > 0 for k in now)  # the new tokens were scored
        assert len(now) <= budget * chat_model.facts.n_layers * chat_model.facts.n_kv_heads
        seen, before = len(tokens), now


@pytest.mark.slow
@pytest.mark.parametrize("level", ["layer", "pair-uniform"])  # the default level runs in test_check_policy
def test_check_policy_passes_for_every_level(level: str) -> None:
    checks = check_policies({"kvzip": {"level": level}})["kvzip"]
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
