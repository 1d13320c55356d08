"""``kvlab check-policy``: every built-in policy has every property; planted broken policies fail the property
they break, by name, and the command exits 1."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvlab.cli import main
from kvlab.experiments.conformance import Check, check_policies
from kvlab.policies import POLICIES
from kvlab.policies.base import LayerView, Policy
from kvlab.policies.plugins import unregister_plugins

BUILT_IN = [n for n in POLICIES if POLICIES[n].plugin is None]  # kvlab's own, not plug-ins loaded later
PROPERTIES = ["a budget covering the conversation equals Full", "the budget is never exceeded",
              "kept positions are valid (in range, unique, sorted)", "deterministic (two runs equal)",
              "re-rotated positions run", "a sliding-window architecture runs, within its budget",
              "multi-turn runs", "bytes held match the cache tensors"]


@dataclass
class Overfull(Policy):
    """Forgets to evict (``evicts = False``) yet declares a budget: it holds more than that."""

    name, summary, evicts = "overfull", "declares a budget, keeps everything", False

    def scores(self, view: LayerView) -> torch.Tensor:
        return view.positions.float()


@dataclass
class Dice(Policy):
    """Keeps random slots: a different set every run."""

    name, summary = "dice", "random slots"

    def scores(self, view: LayerView) -> torch.Tensor:
        return torch.rand(view.positions.shape)


@dataclass
class Blank(Policy):
    """Scores every slot NaN: a top-k over them would keep an arbitrary set, fewer keys than its budget."""

    name, summary = "blank", "NaN scores"

    def scores(self, view: LayerView) -> torch.Tensor:
        return torch.full(view.positions.shape, float("nan"))


@dataclass
class Unasked(Policy):
    """Reads a window's attention without asking for it in ``probe_windows()``."""

    name, summary = "unasked", "reads an observation window it did not ask for"

    def scores(self, view: LayerView) -> torch.Tensor:
        return view.window_mean[8]


@pytest.fixture(scope="module")
def built_in_checks() -> dict[str, list[Check]]:
    """Every built-in policy's properties, run side by side once."""
    return check_policies({name: {} for name in BUILT_IN})


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILT_IN)
def test_every_built_in_policy_passes(built_in_checks: dict[str, list[Check]], name: str) -> None:
    checks = built_in_checks[name]
    assert [c.prop for c in checks] == PROPERTIES
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]


@pytest.mark.slow
def test_adakv_passes_with_uneven_heads() -> None:
    # Knorm's scores leave no window every head keeps: at budget 16 the heads of a layer hold different numbers
    checks = check_policies({"adakv": {"scorer": "knorm"}})["adakv"]
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    assert next(c for c in checks if c.prop == "bytes held match the cache tensors").detail == "48 slots, 24576 bytes"


@pytest.mark.slow
def test_adakv_over_kvzip_passes_every_property() -> None:
    checks = check_policies({"adakv": {"scorer": "kvzip"}})["adakv"]
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]


@pytest.mark.slow
def test_planted_broken_policies_fail_the_property_they_break(register_policy) -> None:
    for planted in (Overfull, Dice, Blank, Unasked):
        register_policy(planted)
    out = check_policies({"overfull": {}, "dice": {}, "blank": {}, "unasked": {}})
    failed = {name: {c.prop: c.detail for c in checks if not c.passed} for name, checks in out.items()}
    # keeping everything it equals Full and keeps valid positions; its budget is broken, also inside the
    # sliding-window model's window, which is wider than the budget
    assert list(failed["overfull"]) == ["the budget is never exceeded",
                                        "a sliding-window architecture runs, within its budget"]
    for detail in failed["overfull"].values():
        assert detail.startswith("turn 1: layer 0 holds ") and detail.endswith("tokens, its budget is 16")
    assert list(failed["dice"]) == ["deterministic (two runs equal)"]
    assert failed["dice"]["deterministic (two runs equal)"] == "turn 1: the second run kept other positions"
    # NaN scores fail every run that evicts (the covering budget never asks for them), the sliding window's too
    assert list(failed["blank"]) == PROPERTIES[1:]
    for detail in failed["blank"].values():
        assert "ValueError: blank.scores() at layer 0 returned NaN" in detail
    assert list(failed["unasked"]) == PROPERTIES[1:]  # says how to ask, not a bare KeyError: 8
    assert all("window_mean[8] was not collected" in d and "returning 8 from probe_windows()" in d
               for d in failed["unasked"].values()), failed["unasked"]


@pytest.mark.slow
def test_the_command_prints_the_table_and_exits_1_on_a_failure(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    plugin = tmp_path / "overfull.py"
    plugin.write_text("from dataclasses import dataclass\n\nfrom kvlab.policies.base import Policy\n\n\n"
                      "@dataclass\nclass Overfull(Policy):\n"
                      "    name, summary, evicts = 'overfull', 'keeps everything', False\n\n"
                      "    def scores(self, view):\n        return view.positions.float()\n")
    try:
        assert main(["check-policy", "overfull", "--policy-file", str(plugin)]) == 1
    finally:
        unregister_plugins()
    out = capsys.readouterr().out
    rows = {prop: line for line in out.splitlines() for prop in PROPERTIES if prop in line}
    assert len(rows) == len(PROPERTIES)
    assert "FAIL" in rows["the budget is never exceeded"] and "its budget is 16" in rows["the budget is never exceeded"]
    assert "PASS" in rows["kept positions are valid (in range, unique, sorted)"]
    assert "FAIL" in rows["a sliding-window architecture runs, within its budget"]
    assert out.strip().endswith("overfull: 2 of 8 properties fail")


def test_the_command_refuses_a_file_it_was_given_that_was_refused(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    plugin = tmp_path / "clash.py"  # a policy named as a built-in: checking the built-in instead would mislead
    plugin.write_text("from dataclasses import dataclass\n\nfrom kvlab.policies.base import Policy\n\n\n"
                      "@dataclass\nclass Mine(Policy):\n    name, summary = 'snapkv', 'mine'\n\n"
                      "    def scores(self, view):\n        return view.positions.float()\n")
    try:
        assert main(["check-policy", "snapkv", "--policy-file", str(plugin)]) == 2
    finally:
        unregister_plugins()
    captured = capsys.readouterr()
    assert captured.err.count("its policy name 'snapkv' is taken by kvlab's SnapKV") == 1 and captured.out == ""
    assert captured.err.startswith("kvlab: error: ")  # said once, as the error it is


def test_the_command_refuses_an_unknown_name_and_a_bad_parameter(capsys: pytest.CaptureFixture) -> None:
    assert main(["check-policy", "nope"]) == 2
    assert "unknown policy 'nope'; choose from full," in capsys.readouterr().err
    assert main(["check-policy", "snapkv", "--param", "window=0"]) == 2
    assert "snapkv: window must be ≥ 1, not 0" in capsys.readouterr().err
    # the other commands' form names the policy too: the same parameter, the same refusal
    assert main(["check-policy", "snapkv", "--param", "SnapKV.window=0"]) == 2
    assert "snapkv: window must be ≥ 1, not 0" in capsys.readouterr().err
    assert main(["check-policy", "snapkv", "--param", "h2o.recent_ratio=0.3"]) == 2  # another policy's
    assert "--param h2o.recent_ratio=0.3 is h2o's; check-policy snapkv takes snapkv's own" in capsys.readouterr().err
