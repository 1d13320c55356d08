"""The one fidelity measure every page uses: KL and top-1 agreement against a reference, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.engine.fidelity import fidelity


def test_fidelity_by_hand():
    ref = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    other = torch.log(torch.tensor([[0.25, 0.75], [0.9, 0.1]]))
    fid = fidelity(ref, other)
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert fid.kl == pytest.approx(kl0 / 2, abs=1e-6) and fid.kl_max == pytest.approx(kl0, abs=1e-6)
    assert fid.top1 == 0.5 and fid.positions == 2  # argmax 0 vs 1 at the first position, 0 vs 0 at the second


def test_fidelity_refuses_mismatched_shapes_and_handles_no_positions():
    with pytest.raises(ValueError, match="shapes differ"):
        fidelity(torch.zeros(2, 3), torch.zeros(3, 3))
    empty = fidelity(torch.zeros(0, 3), torch.zeros(0, 3))
    assert (empty.kl, empty.top1, empty.positions) == (0.0, 1.0, 0)
