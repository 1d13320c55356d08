"""One forward context: a block sets some fields, keeps the enclosing block's others, and restores all on exit."""

from __future__ import annotations

import pytest
import torch

from kvlab.engine.attention import ForwardContext, Probe, forward_context


def current() -> ForwardContext:
    """The context a forward would read now (a block that sets nothing yields it)."""
    with forward_context() as now:
        return now


def test_a_nested_block_keeps_the_fields_it_does_not_set_and_every_one_comes_back() -> None:
    probe, where = Probe(windows=(4,)), [torch.zeros(1, 1, 3)]
    with forward_context(probes=probe, key_pos=where) as outer:
        assert outer.probes == (probe,) and outer.key_pos is where and outer.reads == ()
        with forward_context(probes=[None, probe], reads=None) as inner:
            assert inner.probes == (None, probe) and inner.key_pos is where and inner.reads == ()
        assert current() == outer
    assert current() == ForwardContext()


def test_an_unknown_field_is_refused_and_changes_nothing() -> None:
    with pytest.raises(TypeError):
        with forward_context(probe=None):
            pass
    assert current() == ForwardContext()
