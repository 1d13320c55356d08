"""RoPE re-rotation is exact; rotation angles and q·k drift behave as computed by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from tiny_models import build, eager_forward

from kvlab.engine.facts import LoadedModel
from kvlab.engine.rope import capture_qk, inverse_frequencies, qk_drift, rotate, rotation_angles
from kvlab.errors import KvlabError
from kvlab.viz.rag import rotation_heatmap
from kvlab.workloads.rag.corpus import load_corpus


def _assert_rerotation_exact(lm: LoadedModel, ids: list[int], delta: int, atol: float = 1e-4) -> None:
    _, keys0, values0 = eager_forward(lm, ids, 0)  # the model's own keys, at 0 and at delta
    _, keys_d, values_d = eager_forward(lm, ids, delta)
    for layer, (k0, kd) in enumerate(zip(keys0, keys_d)):
        moved = rotate(lm, k0, delta, layer)
        assert torch.allclose(moved, kd, atol=atol, rtol=0), f"layer {layer}: {(moved - kd).abs().max()}"
        assert float((moved - kd).norm() / kd.norm()) < 1e-5
        assert not torch.allclose(k0, kd, atol=1e-2), f"layer {layer}: the shift changed nothing"
    for v0, vd in zip(values0, values_d):
        assert torch.allclose(v0, vd, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_rerotated_chunk_equals_chunk_prefilled_at_offset_tiny(tiny: LoadedModel) -> None:
    ids = tiny.encode("The lamp room door code is 48213, and only the keeper may use it. " * 4)
    for delta in (1, 37, 1500):
        _assert_rerotation_exact(tiny, ids, delta)


@pytest.mark.model
def test_rerotated_chunk_equals_chunk_prefilled_at_offset_embedded(model: LoadedModel) -> None:
    ids = model.encode(load_corpus().documents[0].text)
    _assert_rerotation_exact(model, ids, 100)
    # float32 angles (p·θ) lose precision as p grows; keys reach |20| here: allow 2.5e-5 of that scale
    _assert_rerotation_exact(model, ids, 611, atol=5e-4)


def test_rotations_compose_and_invert(tiny: LoadedModel) -> None:
    x = torch.randn(2, 5, tiny.facts.head_dim)
    assert torch.allclose(rotate(tiny, rotate(tiny, x, 300, 0), -300, 0), x, atol=1e-5)
    assert torch.allclose(rotate(tiny, rotate(tiny, x, 120, 0), 80, 0), rotate(tiny, x, 200, 0), atol=1e-5)
    assert torch.equal(rotate(tiny, x, 0, 0), x)


def test_rotation_angles_by_hand() -> None:
    angles = rotation_angles(torch.tensor([1.0, 0.5]), torch.tensor([0, 1, 4]))
    expected = torch.tensor([[0.0, 1.0, 4.0 - 2 * math.pi], [0.0, 0.5, 2.0]], dtype=torch.float64)
    assert torch.allclose(angles, expected, atol=1e-12)
    assert float(angles.abs().max()) <= math.pi


def test_qk_drift_zero_at_no_shift_and_grows(tiny: LoadedModel) -> None:
    q, k = capture_qk(tiny, tiny.encode("A short text about lighthouses, bakeries and ferries. " * 6), layer=1)
    assert q.shape[0] == 4 and k.shape[0] == 2
    drift = qk_drift(tiny, q, k, head=3, deltas=[0, 5, 500], n_queries=16)
    assert drift["score_abs_error"][0] < 1e-6 and drift["attention_tv"][0] < 1e-6
    assert drift["score_abs_error"][1] > 1e-3 and drift["score_abs_error"][2] > 1e-3
    assert all(0.0 <= tv <= 1.0 for tv in drift["attention_tv"])


def test_model_without_rope_is_refused(tiny: LoadedModel) -> None:
    norope = replace(tiny, facts=replace(tiny.facts, rope_theta=None))
    with pytest.raises(KvlabError, match="rotary"):
        rotate(norope, torch.zeros(1, 2, tiny.facts.head_dim), 3, 0)


def test_each_layer_rotates_at_its_own_frequencies() -> None:
    lm, _ = build("gemma3")  # sliding layers rotate at base 10k, the global ones (2 and 5) at 1M
    local, glob = inverse_frequencies(lm, 0), inverse_frequencies(lm, 2)
    assert torch.equal(local, inverse_frequencies(lm, 1)) and torch.equal(glob, inverse_frequencies(lm, 5))
    assert glob[-1] < local[-1] and glob[0] == local[0] == 1  # the slowest pair slower, the fastest the same
    figure = rotation_heatmap(rotation_angles(glob, torch.tensor([0, 64])).numpy(), [0, 64], 2)
    assert figure.layout.title.text.endswith("layer 2")
