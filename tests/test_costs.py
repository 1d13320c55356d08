"""Cost accounting against hand calculations, on a model shape written out here (SmolLM2-135M's published one).

The shape is the test's own input, not read from a loaded model, so the hand numbers stay hand numbers and no
embedded model is loaded or pinned.
"""

from __future__ import annotations

import pytest

from kvlab.engine.facts import ModelFacts
from kvlab.sharing.schemes import make_scheme
from kvlab.viz.edits import cost_share_figure
from kvlab.workloads.code.costs import COMPONENTS, component_shares, cost_table, reprefill_flops, token_layer_flops

# hidden 576, 9 heads, 3 KV heads, head_dim 64, intermediate 1536, 30 layers, float32
Q = 2 * 576 * (9 * 64)  # 663_552
K = V = 2 * 576 * (3 * 64)  # 221_184
O = 2 * (9 * 64) * 576  # 663_552
MLP = 3 * 2 * 576 * 1536  # 5_308_416
PER_KEY = 2 * 9 * 64 + 2 * 9 * 64  # scores + weighted sum: 2_304 per attended key
KV_BYTES = 2 * 3 * 64 * 4  # K and V of one token in one layer: 1_536


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    return ModelFacts(name="smollm2-135m-shape", n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, hidden_size=576,
                      intermediate_size=1536, vocab_size=49152, rope_theta=1e5, context_length=8192, dtype="float32",
                      bytes_per_element=4, device="cpu")


def test_hand_numbers():
    assert (Q, K, O, MLP, PER_KEY) == (663_552, 221_184, 663_552, 5_308_416, 2_304)


def test_token_layer_flops(facts):
    assert token_layer_flops(facts, 100) == {
        "q_proj": Q, "k_proj": K, "v_proj": V, "o_proj": O, "attention": 230_400, "mlp": MLP}


def test_full_reprefill(facts):
    p, s = 100, 3  # new tokens attend 101, 102, 103 keys: 306 key visits per layer
    assert reprefill_flops(facts, make_scheme("full", 30), p, s) == {
        "q_proj": 30 * 3 * Q, "k_proj": 30 * 3 * K, "v_proj": 30 * 3 * V, "o_proj": 30 * 3 * O,
        "attention": 30 * PER_KEY * 306, "mlp": 30 * 3 * MLP,
    }


def test_cla_saves_only_kv_projections(facts):
    p, s = 100, 3
    full = reprefill_flops(facts, make_scheme("full", 30), p, s)
    cla2 = reprefill_flops(facts, make_scheme("cla2", 30), p, s)
    cla4 = reprefill_flops(facts, make_scheme("cla4", 30), p, s)
    assert cla2 == {**full, "k_proj": 15 * 3 * K, "v_proj": 15 * 3 * V}
    assert cla4 == {**full, "k_proj": 8 * 3 * K, "v_proj": 8 * 3 * V}  # producers 0, 4, …, 28


def test_yoco_runs_the_upper_half_for_the_last_token(facts):
    p, s = 100, 3
    assert reprefill_flops(facts, make_scheme("yoco", 30), p, s) == {
        "q_proj": (15 * 3 + 15 * 1) * Q,
        "k_proj": (15 + 1) * 3 * K,  # lower half + the global K/V of layer 15
        "v_proj": (15 + 1) * 3 * V,
        "o_proj": (15 * 3 + 15 * 1) * O,
        "attention": 15 * PER_KEY * 306 + 15 * PER_KEY * 103,
        "mlp": (15 * 3 + 15 * 1) * MLP,
    }


def test_cost_table_shares_and_claim(facts):
    p, s = 1000, 10
    schemes = [make_scheme(n, 30) for n in ("cla2", "cla3", "cla4", "yoco")]
    table = cost_table(facts, schemes, [(p, s)]).set_index("scheme")
    assert list(table.index) == ["Full", "CLA-2", "CLA-3", "CLA-4", "YOCO"]
    attention = PER_KEY * (s * p + s * (s + 1) // 2)
    full_total = 30 * (s * (Q + K + V + O + MLP) + attention)
    assert table.loc["Full", "total_flops"] == full_total
    assert table.loc["CLA-2", "compute_share"] == pytest.approx(1 - 15 * s * (K + V) / full_total, rel=1e-12)
    assert table["claim_share"].to_dict() == pytest.approx(
        {"Full": 1.0, "CLA-2": 0.5, "CLA-3": 10 / 30, "CLA-4": 8 / 30, "YOCO": 16 / 30})
    assert table.loc["Full", "kv_bytes_stored"] == 30 * (p + s) * KV_BYTES
    assert table.loc["CLA-3", "kv_bytes_share"] == pytest.approx(1 / 3)
    assert table.loc["YOCO", "kv_bytes_written"] == 16 * s * KV_BYTES
    # the claim overstates CLA's saving: attention and MLP still run in every layer
    assert table.loc["CLA-2", "compute_share"] > 0.9


def test_spans_sum_and_component_shares(facts):
    schemes = [make_scheme("cla2", 30), make_scheme("yoco", 30)]
    spans = [(10, 5), (0, 20)]
    table = cost_table(facts, schemes, spans).set_index("scheme")
    one = [cost_table(facts, schemes, [span]).set_index("scheme") for span in spans]
    assert table.loc["YOCO", "total_flops"] == one[0].loc["YOCO", "total_flops"] + one[1].loc["YOCO", "total_flops"]
    assert table.loc["Full", "kv_bytes_stored"] == 30 * 20 * KV_BYTES  # the last text's size
    shares = component_shares(table.reset_index())
    assert set(shares["component"]) == set(COMPONENTS)
    summed = shares.groupby("scheme")["share"].sum()
    assert summed.to_dict() == pytest.approx(table["compute_share"].to_dict())
    bars = [t for t in cost_share_figure(table.reset_index()).data if t.type == "bar"]  # one stacked bar a component
    assert [b.name for b in bars] == list(COMPONENTS)
    stacked = [sum(b.y[i] for b in bars) for i in range(len(bars[0].x))]
    assert dict(zip(bars[0].x, stacked)) == pytest.approx(table["compute_share"].to_dict())


def test_bad_spans(facts):
    with pytest.raises(ValueError):
        reprefill_flops(facts, make_scheme("full", 30), 10, 0)
    with pytest.raises(ValueError):
        cost_table(facts, [], [])
