"""KIVI: per-channel keys, per-token values, packed bytes, off at 16 bits, and fidelity rising with bits."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.engine.cache import SlotLayer
from kvlab.engine.facts import LoadedModel
from kvlab.engine.quantization import Kivi, quantize_keys, quantize_values
from kvlab.errors import KvlabError
from kvlab.policies import make_policy
from kvlab.workloads.chat.records import PolicyTurn, TurnResult
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

FACTS = "The locker code is 4127. The cat is called Miso and sleeps on the red chair all day long."


def test_keys_share_statistics_per_channel_and_values_per_token() -> None:
    x = torch.arange(4.0)[:, None] + 10 * torch.arange(4.0)[None, :] ** 2  # 4 tokens × 4 channels: t + 10c²
    # per channel over the 4 tokens: t + a constant, 4 levels at 2 bits: exact
    assert torch.equal(quantize_keys(x, 2, 4), x)
    # per token over its channels: t, t+10, t+40, t+90 cannot fit 4 evenly spaced levels
    assert not torch.allclose(quantize_values(x, 2, 4), x)
    assert torch.equal(quantize_values(x.T.contiguous(), 2, 4), x.T)  # transposed, each row is a channel: exact
    y = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    errors = [float((quantize_keys(y, b, 32) - y).abs().max()) for b in (2, 4, 8)]
    assert errors[0] > errors[1] > errors[2] > 0


def test_the_newest_tokens_stay_in_full_precision_and_bytes_count_the_packing() -> None:
    layer = SlotLayer(kv_heads=2, device=torch.device("cpu"))
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 100, 64), torch.randn(1, 2, 100, 64)
    layer.update(keys, values)
    layer.record(torch.arange(100), torch.arange(100))
    kivi = Kivi(bits=4, group=32, residual=32)
    before = layer.state()
    assert kivi.quantize(layer)
    assert not before["key_quantized"].any() and not before["value_quantized"].any()  # replaced, not written in place
    assert torch.equal(before["keys"], keys)
    assert layer.key_quantized.sum(-1).tolist() == [96, 96]  # three whole chunks of 32; 4 keys wait
    assert layer.value_quantized.sum(-1).tolist() == [68, 68]  # all but the newest 32
    assert torch.equal(layer.keys[..., 96:, :], keys[..., 96:, :])
    assert torch.equal(layer.values[..., 68:, :], values[..., 68:, :])
    assert not torch.equal(layer.keys[..., :96, :], keys[..., :96, :])
    full = (2 * 200 - 2 * 96 - 2 * 68) * 64 * 4  # float32 slots
    packed = math.ceil((2 * 96 + 2 * 68) * 64 * 4 / 8)
    scales = 2 * ((2 * 96 // 32) * 64 + 2 * 68 * (64 // 32)) * 4
    assert kivi.layer_bytes(layer, 64, 4) == full + packed + scales
    assert not kivi.quantize(layer)  # nothing new to quantize
    with pytest.raises(KvlabError, match="does not divide"):
        Kivi(bits=4, group=48, residual=48).quantize(layer)


@pytest.mark.slow
@pytest.mark.parametrize("evictor", ["streamingllm", "expected_attention"])  # the second reads query statistics
def test_sixteen_bits_is_the_eviction_policy_exactly(tiny: LoadedModel, evictor: str) -> None:
    turns = {}
    for name, params in ((evictor, {}), ("kivi", {"bits": 16, "evict_with": evictor})):
        session = ChatSession(tiny, ChatSettings(policies=("full", name), budget=24, max_new_tokens=4,
                                                 params={name: params}))
        session.run_turn(FACTS)
        turns[name] = session.run_turn("What is the cat called?", golden="Miso.").policies[name]
    a, b = turns[evictor], turns["kivi"]
    assert a.error is None
    assert (a.kl, a.top1, a.kv_bytes, a.retained, a.reply) == (b.kl, b.top1, b.kv_bytes, b.retained, b.reply)
    assert make_policy("kivi", evict_with="h2o").needs_accumulated


@pytest.mark.model
@pytest.mark.slow
def test_fidelity_rises_with_bits_on_the_embedded_model(model: LoadedModel) -> None:
    kl, held = {}, {}
    for bits in (2, 4, 8):
        session = ChatSession(model, ChatSettings(policies=("full", "kivi"), budget=128, max_new_tokens=8,
                                                  params={"kivi": {"bits": bits, "residual": 32}}))
        session.run_turn(FACTS + " Please remember these facts.", golden="I will remember them.")
        turn = session.run_turn("What is the locker code?", golden="The locker code is 4127.")
        kl[bits], held[bits] = turn.policies["kivi"].kl, turn.policies["kivi"].kv_bytes
        full_bytes = turn.policies["full"].kv_bytes
    assert kl[8] < kl[4] < kl[2]
    assert held[2] < held[4] < held[8] < full_bytes


@pytest.mark.parametrize("held, residual, noted", [(40.0, 128, True), (160.0, 128, False), (40.0, 32, False)])
def test_kivi_reads_like_full_while_it_holds_no_more_than_its_residual(held: float, residual: int, noted: bool) -> None:
    settings = ChatSettings(policies=("kivi",), params={"kivi": {"residual": residual}})
    kivi = PolicyTurn(policy="kivi", cache_tokens=[held, held])
    turn = TurnResult(index=1, user="", reply="", reply_source="full", prefill="", answer=None, total_tokens=40,
                      segments=[], profile=[], policies={"full": PolicyTurn(policy="full"), "kivi": kivi})
    assert settings.unquantized(turn) == ({"kivi": (residual, held)} if noted else {})
