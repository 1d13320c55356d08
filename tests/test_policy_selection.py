"""Which slots each policy keeps, pinned on hand-built evidence (keys, attention) with hand-computed answers.

Like kvpress's ``test_presses_keep_highest_score``, but with the expected keep sets written out, so a
sign flip, a wrong pooling or a wrong pyramid fails here. The last tests cover ``--param``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import kvlab.cli.arena as arena_command
import kvlab.cli.chat as chat_command
from kvlab.cli import main
from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import to_kv_heads
from kvlab.errors import KvlabError
from kvlab.policies import LayerView, Policy, make_policy, param_specs, parse_params, policy_params
from kvlab.policies.base import param
from kvlab.policies.evict import keep_index, keep_per_head
from kvlab.policies.pyramidkv import selected_pyramid, total_pyramid


def view(budget: int, slots: int, kv_heads: int = 1, *, positions: list[int] | None = None,
         keys: torch.Tensor | None = None, window_mean: dict[int, torch.Tensor] | None = None,
         accumulated: torch.Tensor | None = None) -> LayerView:
    """A LayerView by hand; positions default to 0..slots-1 in every head."""
    pos = torch.tensor(positions if positions is not None else list(range(slots))).expand(kv_heads, slots)
    return LayerView(layer=0, budget=budget, positions=pos,
                     keys=keys if keys is not None else torch.zeros(kv_heads, slots, 4),
                     window_mean=window_mean or {}, accumulated=accumulated)


def kept(policy: Policy, v: LayerView) -> list[list[int]]:
    """[kv_head] the original positions the policy keeps, as evict chooses them."""
    index = keep_index(policy.scores(v), v.budget)
    return v.positions.gather(-1, index).tolist()


# --- the tie rule evict applies to every policy -------------------------------------------------------------


def test_ties_go_to_the_older_slot() -> None:
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0], [3.0, 3.0, 3.0, 3.0, 3.0]])
    assert keep_index(scores, 2).tolist() == [[1, 2], [0, 1]]
    inf = float("inf")  # forced slots beat any score, and come back in slot order
    assert keep_index(torch.tensor([[inf, 5.0, inf, 9.0]]), 3).tolist() == [[0, 2, 3]]


def test_keep_per_head_is_a_stable_sort_s_choice() -> None:
    """``keep_per_head`` (one selection, then ties in slot order) keeps what ranking every slot by a stable sort
    keeps: many small heads with ties, ±inf, budgets of 0, past the slots, equal and per head."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(600):
        heads, slots = int(torch.randint(1, 5, (), generator=gen)), int(torch.randint(1, 30, (), generator=gen))
        scores = torch.randint(-3, 4, (heads, slots), generator=gen).float()
        scores[torch.rand(heads, slots, generator=gen) < 0.2] = -float("inf")
        scores[torch.rand(heads, slots, generator=gen) < 0.1] = float("inf")
        budget = (int(torch.randint(0, slots + 3, (), generator=gen)) if trial % 2
                  else torch.randint(0, slots + 3, (heads,), generator=gen).tolist())
        order = scores.sort(dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(slots).expand_as(order))
        assert torch.equal(keep_per_head(scores, budget), rank < torch.tensor(budget).view(-1, 1)), (scores, budget)


# --- StreamingLLM and Window ---------------------------------------------------------------------------------


def test_streamingllm_keeps_the_sinks_and_the_newest() -> None:
    positions = [0, 1, 2, 3, 4, 9, 10, 11, 15, 16]  # a cache that was evicted before: gaps in the middle
    v = view(6, 10, kv_heads=2, positions=positions)
    assert kept(make_policy("streamingllm"), v) == [[0, 1, 2, 3, 15, 16]] * 2
    assert kept(make_policy("streamingllm", n_sink=1), v) == [[0, 9, 10, 11, 15, 16]] * 2
    assert kept(make_policy("streamingllm", n_sink=0), v) == [[4, 9, 10, 11, 15, 16]] * 2


def test_window_keeps_only_the_newest() -> None:
    v = view(3, 6, kv_heads=2, positions=[0, 2, 3, 5, 8, 13])
    assert kept(make_policy("window"), v) == [[5, 8, 13]] * 2


# --- H2O ----------------------------------------------------------------------------------------------------


def test_h2o_keeps_heavy_hitters_per_kv_head_plus_the_recent_half() -> None:
    acc = torch.tensor([
        [5.0, 0.1, 4.0, 0.2, 3.0, 0.3, 0.0, 0.0, 0.0, 0.0],  # head 0: heavy at 0, 2, 4
        [0.1, 6.0, 0.2, 0.3, 0.1, 7.0, 2.0, 9.0, 0.0, 0.0],  # head 1: heavy at 5, 1, 6 (7 is recent anyway)
    ])
    v = view(6, 10, kv_heads=2, accumulated=acc)
    # budget 6, recent_ratio 0.5: slots 7, 8, 9 are recent; three heavy hitters from slots 0..6
    assert kept(make_policy("h2o"), v) == [[0, 2, 4, 7, 8, 9], [1, 5, 6, 7, 8, 9]]
    # no recent window: the six heaviest, the recent slots with no attention are dropped
    assert kept(make_policy("h2o", recent_ratio=0.0), v) == [[0, 1, 2, 3, 4, 5], [1, 2, 3, 5, 6, 7]]
    assert kept(make_policy("h2o", recent_ratio=1.0), v) == [[4, 5, 6, 7, 8, 9]] * 2


# --- Knorm --------------------------------------------------------------------------------------------------


def test_knorm_keeps_the_smallest_key_norms_per_kv_head() -> None:
    norms = torch.tensor([[3.0, 1.0, 4.0, 1.5, 9.0, 2.0], [0.5, 8.0, 0.7, 6.0, 0.6, 7.0]])
    keys = torch.zeros(2, 6, 4)
    keys[..., 1] = -norms  # the sign of a component must not matter, only the norm
    v = view(3, 6, kv_heads=2, keys=keys)
    assert kept(make_policy("knorm"), v) == [[1, 3, 5], [0, 2, 4]]


# --- TOVA ---------------------------------------------------------------------------------------------------


def tova_evidence() -> tuple[torch.Tensor, torch.Tensor]:
    """The newest query's attention for 4 query heads sharing 2 KV heads (GQA), and its KV-head view."""
    q = torch.tensor([
        [0.70, 0.00, 0.10, 0.20],  # query heads 0, 1 → KV head 0
        [0.50, 0.00, 0.10, 0.40],
        [0.00, 0.60, 0.10, 0.30],  # query heads 2, 3 → KV head 1
        [0.00, 0.40, 0.30, 0.30],
    ])
    return q, to_kv_heads(q, 2)


def test_tova_keeps_one_set_per_layer_from_the_mean_over_all_query_heads() -> None:
    q, per_kv = tova_evidence()
    v = view(2, 4, kv_heads=2, window_mean={1: per_kv})
    # mean over the 4 query heads: [0.30, 0.25, 0.15, 0.30] → slots 0 and 3, in both KV heads
    assert torch.allclose(q.mean(0), torch.tensor([0.30, 0.25, 0.15, 0.30]))
    assert kept(make_policy("tova"), v) == [[0, 3], [0, 3]]
    # the variant scores each KV head by its own group: [0.6, 0, .1, .3] and [0, .5, .2, .3]
    assert kept(make_policy("tova", per_head=True), v) == [[0, 3], [1, 3]]


def test_tova_does_not_force_the_newest_token() -> None:
    attn = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert kept(make_policy("tova"), view(2, 4, window_mean={1: attn})) == [[0, 1]]


# --- SnapKV -------------------------------------------------------------------------------------------------

# window 3, kernel 3, budget 5: the prefix is slots 0..6, two of them are selected, 7..9 are the window
VOTES = torch.tensor([[0.9, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.9, 0.9, 0.9]])


def snap(**params) -> list[list[int]]:
    return kept(make_policy("snapkv", **{"window": 3, "kernel": 3, **params}), view(5, 10, window_mean={3: VOTES}))


def test_snapkv_pools_the_prefix_only_with_zero_padding_counted() -> None:
    # avg over 3 with the pad counted: slot 0 → (0 + .9 + 0)/3 = .30, slot 4 → (0 + .5 + .5)/3 = .33,
    # slot 5 → .33, slot 6 → (.5 + 0 + pad 0)/3 = .17 (the window's .9 is not its neighbour)
    assert snap() == [[4, 5, 7, 8, 9]]


def test_snapkv_variants_and_the_pooling_edges_differ() -> None:
    # the pad not counted: slot 0 → .9/2 = .45 wins, then slots 4 and 5 tie at .33: the older one
    # and pooling over the window as well: slot 6 → (.5 + 0 + .9)/3 = .47
    assert snap(pool_scope="all") == [[0, 6, 7, 8, 9]]
    assert snap(kernel=1) == [[0, 4, 7, 8, 9]]  # raw votes: .9, then the tie .5/.5 goes to the older slot
    assert snap(pooling="max") == [[0, 1, 7, 8, 9]]  # max over 3: slots 0 and 1 both see the .9


def test_snapkv_keeps_the_window_even_when_the_budget_is_smaller() -> None:
    assert kept(make_policy("snapkv", window=3, kernel=3), view(2, 10, window_mean={3: VOTES})) == [[8, 9]]
    short = torch.tensor([[0.2, 0.5, 0.3]])  # fewer slots than the window: no prefix at all
    assert kept(make_policy("snapkv", window=5), view(2, 3, window_mean={5: short})) == [[1, 2]]


def test_snapkv_gqa_votes_equal_pooling_each_query_head_then_averaging_its_group() -> None:
    g = torch.Generator().manual_seed(0)
    per_query = torch.rand(4, 24, generator=g)  # 4 query heads, 2 KV heads, 24 slots
    window, kernel, budget = 4, 5, 10
    v = view(budget, 24, kv_heads=2, window_mean={window: to_kv_heads(per_query, 2)})
    # the reference, as kvpress's snapkv_press.py: pool every query head's prefix votes, average per group
    pooled = F.avg_pool1d(per_query[None, :, :-window], kernel, stride=1, padding=kernel // 2)[0]
    scores = pooled.view(2, 2, -1).mean(1)
    expected = [sorted([*s.topk(budget - window).indices.tolist(), *range(24 - window, 24)]) for s in scores]
    assert kept(make_policy("snapkv", window=window, kernel=kernel), v) == expected
    assert expected[0] != expected[1]  # each KV head chooses its own


# --- PyramidKV ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget, bottom, top, step, total", [
    # C=64, w=32: min = 32 // 20 = 1, max = 2·32 − 1 = 63, step = (63 − 1) // 29 = 2 → 32 + 63 … 32 + 5
    (64, 95, 37, 2, 1980),
    # C=128: min = 96 // 20 = 4, max = 192 − 4 = 188, step = 184 // 29 = 6 → 32 + 188 … 32 + 14
    (128, 220, 46, 6, 3990),
])
def test_pyramid_budgets_follow_the_official_formula(budget: int, bottom: int, top: int, step: int,
                                                     total: int) -> None:
    budgets = make_policy("pyramidkv").layer_budgets(budget, 30)
    assert budgets == list(range(bottom, top - 1, -step)) and len(budgets) == 30
    assert budgets[-1] == top and sum(budgets) == total  # the floors leave the total above 30 × budget
    assert min(budgets) > 32  # the window fits in every layer


def test_pyramid_edges_and_the_total_variant() -> None:
    assert selected_pyramid(32, 30, 20, 32) == [32] * 30  # nothing beyond the window to shape
    assert selected_pyramid(100, 1, 20, 32) == [100]
    assert selected_pyramid(12, 4, 2, 4) == [16, 14, 12, 10]  # min 4, max 12, step 8 // 3 = 2
    total = make_policy("pyramidkv", allocation="total").layer_budgets(64, 30)
    assert total == total_pyramid(64, 30, 20) and sum(total) == 30 * 64
    assert total[0] == 125 and total[-1] == 3  # 2·64 − 3.2 … 3.2: the top layer cannot hold the window


def test_pyramidkv_selects_like_snapkv_within_its_layer_budget() -> None:
    policy = make_policy("pyramidkv", window=3, kernel=3)
    # each layer applies SnapKV's rule within its own budget: the window, then the best pooled prefix slots
    assert kept(policy, view(5, 10, window_mean={3: VOTES})) == [[4, 5, 7, 8, 9]]
    assert kept(policy, view(4, 10, window_mean={3: VOTES})) == [[4, 7, 8, 9]]


# --- parameters: specs, parsing, the command line ------------------------------------------------------------


def test_param_specs_come_from_the_dataclass_fields() -> None:
    specs = {s.name: s for s in param_specs("pyramidkv")}
    assert list(specs) == ["window", "kernel", "pooling", "pool_scope", "beta", "allocation"]
    assert (specs["window"].kind, specs["window"].default, specs["window"].min) == ("int", 32, 1)
    assert specs["allocation"].choices == ("selected", "total") and specs["allocation"].default == "selected"
    assert specs["beta"].kind == "float" and specs["beta"].min == 1.0
    h2o = param_specs("h2o")[0]
    assert (h2o.min, h2o.max, h2o.default) == (0.0, 1.0, 0.5)
    assert h2o.described() == h2o.help + " — 0 to 1" and specs["window"].described().endswith(" — at least 1")
    assert specs["allocation"].described() == specs["allocation"].help  # a choice has no range to say
    assert param_specs("tova")[0].kind == "bool" and param_specs("knorm") == []
    # kvpress's defaults (expected_attention_press.py), the KeyDiff paper's block (block_press.py's default)
    assert policy_params("expected_attention") == {"n_future_positions": 512, "n_sink": 4, "use_covariance": True,
                                                   "use_vnorm": True, "epsilon": 0.0}
    assert policy_params("keydiff") == {"block_size": 128} and policy_params("oracle") == {}
    for name in ("streamingllm", "h2o", "snapkv", "pyramidkv", "tova", "expected_attention", "keydiff"):
        make_policy(name, **{s.name: s.default for s in param_specs(name)})


def test_a_bound_declared_alone_is_checked_too() -> None:
    @dataclass
    class Capped(Policy):
        name = "capped"
        share: float = param(0.5, "a share", max=1.0)
        floor: int = param(2, "a floor", min=1)

    assert Capped(share=1.0, floor=1).share == 1.0
    with pytest.raises(KvlabError, match="capped: share must be ≤ 1.0, not 7.0"):
        Capped(share=7.0)
    with pytest.raises(KvlabError, match="capped: floor must be ≥ 1, not 0"):
        Capped(floor=0)


def test_parse_params() -> None:
    assert parse_params(["snapkv.window=16", "SnapKV.pooling=max", "tova.per_head=true", "h2o.recent_ratio=0.25"]) == {
        "snapkv": {"window": 16, "pooling": "max"}, "tova": {"per_head": True}, "h2o": {"recent_ratio": 0.25}}
    for bad, message in [(["snapkv.windw=3"], "snapkv has no parameter 'windw'; it takes window"),
                         (["snapkv.window=abc"], "snapkv.window must be a whole number, not 'abc'"),
                         (["snapkv.window=0"], "window must be ≥ 1, not 0"),
                         (["snapkv.window=100000000000000000000"],
                          "window must be at most 2,147,483,647 in size, not 100,000,000,000,000,000,000"),
                         (["pyramidkv.allocation=half"], "allocation must be one of 'selected', 'total'"),
                         (["tova.per_head=maybe"], "true or false"),
                         (["lru.size=3"], "unknown policy 'lru'"),
                         (["snapkv"], "policy.name=value")]:
        with pytest.raises(KvlabError, match=message):
            parse_params(bad)


CONV = [{"role": "user", "content": "My vault code is 27182. Please keep it in mind."},
        {"role": "assistant", "content": "Noted: your vault code is 27182."}]


@pytest.mark.parametrize("param, message", [
    ("snapkv.windw=8", "snapkv has no parameter 'windw'"),
    ("snapkv.window=eight", "snapkv.window must be a whole number, not 'eight'"),
    ("snapkv.kernel=0", "snapkv: kernel must be ≥ 1, not 0"),
    ("h2o.recent_ratio=0.5", "parameters given for h2o, which is not among the policies run"),
])
def test_cli_bad_param_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, param: str,
                                              message: str) -> None:
    conv = tmp_path / "c.json"
    conv.write_text(json.dumps(CONV))
    code = main(["chat", "--conversation", str(conv), "--policies", "snapkv", "--param", param,
                 "--out", str(tmp_path / "o.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0]


@pytest.mark.slow
def test_cli_params_reach_the_run_and_its_records(tmp_path: Path, tiny: LoadedModel,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_command, "load_model", lambda *a, **k: tiny)
    monkeypatch.setattr(arena_command, "load_model", lambda *a, **k: tiny)
    conv = tmp_path / "c.json"
    conv.write_text(json.dumps(CONV))
    params = ["--param", "snapkv.window=8", "--param", "tova.per_head=true"]
    snapkv = {"window": 8, "kernel": 5, "pooling": "avg", "pool_scope": "prefix"}
    assert main(["chat", "--conversation", str(conv), "--policies", "snapkv,tova", "--budget", "16", *params,
                 "--max-new-tokens", "2", "--out", str(tmp_path / "chat.json")]) == 0
    recorded = json.loads((tmp_path / "chat.json").read_text())["settings"]["params"]
    assert recorded == {"full": {}, "snapkv": snapkv, "tova": {"per_head": True}}

    assert main(["arena", "--workload", str(conv), "--policies", "snapkv,tova", "--budgets", "16", *params,
                 "--max-new-tokens", "2", "--out", str(tmp_path / "arena")]) == 0
    table = pd.read_csv(tmp_path / "arena" / "results.csv")
    by_policy = dict(zip(table["policy"], table["params"].map(json.loads)))
    assert by_policy == {"full": {}, "snapkv": snapkv, "tova": {"per_head": True}}
    data = json.loads((tmp_path / "arena" / "results.json").read_text())
    assert data["settings"]["params"]["snapkv"] == snapkv


@pytest.mark.slow
@pytest.mark.model  # the pages load the embedded model (the weights guard found it unmarked)
def test_pages_draw_a_widget_per_parameter_and_use_it() -> None:
    from page_helpers import open_page

    at = open_page("app_pages/chat.py")
    at.multiselect(key="chat_policies").set_value(["tova", "pyramidkv"]).run()
    assert at.checkbox(key="chat_tova_per_head").value is False
    assert at.selectbox(key="chat_pyramidkv_allocation").value == "selected"
    assert at.number_input(key="chat_pyramidkv_beta").value == 20.0
    at.checkbox(key="chat_tova_per_head").check()
    at.selectbox(key="chat_pyramidkv_allocation").set_value("total")
    at.number_input(key="chat_budget").set_value(16)
    at.number_input(key="chat_max_new").set_value(2)
    at.chat_input[0].set_value("Hello there.").run()
    assert not at.exception and not at.error
    params = at.session_state["chat"].settings.params
    assert params["tova"] == {"per_head": True} and params["pyramidkv"]["allocation"] == "total"

    at = open_page("app_pages/arena.py")
    at.multiselect(key="arena_policies").set_value(["h2o"]).run()
    ratio = at.number_input(key="arena_h2o_recent_ratio")
    assert ratio.value == 0.5 and ratio.min is None  # not clamped: a value out of range is refused in words
    ratio.set_value(1.5)
    at.button(key="arena_run").click().run()
    assert any("recent_ratio" in e.value and "between 0.0 and 1.0" in e.value for e in at.error)
    assert "arena_job" not in at.session_state
