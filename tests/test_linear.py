"""kvlab's linear layers (oneDNN on a reordered weight) against PyTorch's own ``linear``."""

from __future__ import annotations

import os
import platform

import pytest
import torch
from torch import nn

from kvlab.engine import linear
from kvlab.engine.linear import onednn_linears

ONEDNN = torch.backends.mkldnn.is_available() and platform.machine().lower() in linear.X86
pytestmark = pytest.mark.skipif(not ONEDNN, reason="kvlab uses oneDNN's linear layers on x86 CPUs only")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False)).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (1, 17, 64), (3, 9, 64)])
def test_onednn_linears_equal_pytorchs_within_float32_rounding(
    shape: tuple[int, ...], pack: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(linear, "PACK_BYTES", 1 << 30 if pack else 0)
    ours, reference = _model(), _model()
    onednn_linears(ours)
    assert all(m.__dict__["_onednn_pack"] is pack for m in ours)
    x = torch.randn(*shape)
    with torch.no_grad():
        assert _rel(ours(x), reference(x)) < 1e-5
        assert ("_onednn_weight" in ours[0].__dict__) is pack  # reordered once, when given oneDNN


def test_a_changed_weight_is_reordered_again_and_other_dtypes_keep_linear() -> None:
    ours, reference = _model(), _model()
    onednn_linears(ours)
    x = torch.randn(4, 64)
    with torch.no_grad():
        ours(x)
        for a, b in zip(ours.parameters(), reference.parameters()):
            a.mul_(2.0)
            b.mul_(2.0)
        assert _rel(ours(x), reference(x)) < 1e-5  # the in-place change reached the reordered weight
        ours[0].weight = nn.Parameter(reference[0].weight.clone() * 3)
        reference[0].weight = nn.Parameter(reference[0].weight * 3)
        assert _rel(ours(x), reference(x)) < 1e-5
        ours.to(torch.bfloat16)
        reference.to(torch.bfloat16)
        assert torch.equal(ours(x.bfloat16()), reference(x.bfloat16()))  # PyTorch's own linear
    y = ours.float()(x.requires_grad_())  # gradients: PyTorch's linear, which has them
    y.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_a_few_rows_go_to_linear_on_an_intel_cpu_and_to_onednn_elsewhere(
    vendor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(linear, "cpu_vendor", lambda: vendor)
    to_linear = vendor == "GenuineIntel"
    calls: list[int] = []
    pointwise = linear._pointwise
    monkeypatch.setattr(linear, "_pointwise", lambda m, x: calls.append(x.numel() // x.shape[-1]) or pointwise(m, x))
    ours, reference = _model(), _model()
    onednn_linears(ours)
    assert linear.few_rows_library(ours) == ("linear" if to_linear else "oneDNN")
    assert linear.FEW_ROWS == 3
    with torch.no_grad():
        one, three, four = torch.randn(1, 1, 64), torch.randn(3, 64), torch.randn(2, 2, 64)
        for x in (one, three):
            assert torch.equal(ours(x), reference(x)) or not to_linear  # PyTorch's own product, to the bit
            assert _rel(ours(x), reference(x)) < 1e-5
        assert _rel(ours(four), reference(four)) < 1e-5
    assert calls == ([4, 4] if to_linear else [1, 1, 1, 1, 3, 3, 3, 3, 4, 4])  # two layers per call; > 3 rows: oneDNN


def test_the_cpu_vendor_is_the_one_the_system_names() -> None:
    if not os.path.exists("/proc/cpuinfo"):  # not Linux: what platform names, if it names a vendor
        assert linear.cpu_vendor() in ("GenuineIntel", "AuthenticAMD", "")
        return
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        named = [line.split(":", 1)[1].strip() for line in info if line.startswith("vendor_id")]
    assert linear.cpu_vendor() == named[0] and named[0]
