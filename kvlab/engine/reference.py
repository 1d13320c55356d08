"""The model's own forward, called directly: the plain transformers runs kvlab's own runs are measured against.

Everything else runs the model through ``forward.run`` on kvlab's caches. These calls skip it on purpose:
no positions, padding, probes or sparse reads are set, and a cache, where there is one, is transformers'
own ``DynamicCache`` — the reference for exactness tests, sharing's support check and the benchmark's
baseline. Each takes the model lock and runs without gradients.
"""

from __future__ import annotations

import statistics

import torch
from transformers import DynamicCache

from kvlab.engine.attention import Probe, forward_context
from kvlab.engine.decode import greedy
from kvlab.engine.facts import LoadedModel
from kvlab.engine.tensor_memory import TensorMemory
from kvlab.engine.timing import clock


def plain_logits(lm: LoadedModel, ids: list[int], logits_to_keep: int = 0, cache: DynamicCache | None = None
                 ) -> torch.Tensor:
    """The model's own forward of ``ids`` [n] → logits [n or logits_to_keep, vocab] (float32).

    With ``cache`` (empty, or holding the tokens before ``ids``) the keys are kept there; without, none are.
    """
    with lm.lock, torch.no_grad():  # as forward.run: the baseline and kvlab's runs on an equal footing
        out = lm.model(input_ids=torch.tensor([ids], device=lm.device), cache=cache, use_cache=cache is not None,
                       logits_to_keep=logits_to_keep)
    return out.logits[0].float()


def plain_greedy(lm: LoadedModel, ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """One transformers prefill (last logits only, as ``generate`` does), then ``decode.greedy``'s steps."""
    cache = DynamicCache(config=lm.model.config)
    first = plain_logits(lm, ids, 1, cache)[-1]
    return greedy(first, lambda token, _: plain_logits(lm, [token], 1, cache)[-1], max_new_tokens, stop_ids)[0]


def plain_step_seconds(lm: LoadedModel, ids: list[int], rows: int, steps: int) -> float:
    """Seconds of ``steps`` greedy decoding steps of ``rows`` copies of ``ids`` in one batch (the model's own forward
    and cache; the prefill not timed)."""
    cache = DynamicCache(config=lm.model.config)
    with lm.lock, torch.no_grad():
        batch = torch.tensor([ids] * rows, device=lm.device)
        token = lm.model(input_ids=batch, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1)
        t0 = clock()
        for _ in range(steps):
            token = lm.model(input_ids=token[:, None], cache=cache).logits[:, -1].argmax(-1)
        return clock() - t0


def plain_rows_ratio(lm: LoadedModel, ids: list[int], rows: int, runs: int, steps: int = 8) -> float:
    """What a plain decoding step of ``rows`` rows costs over one of one row (the median of ``runs`` pairs, in
    alternating order): the least that decoding ``rows`` replies side by side can cost this machine, whatever kvlab
    does (on a CPU a few rows' matrix products cost more than one row's; on a GPU about the same)."""
    ratios = []
    for run in range(runs):
        t = {n: plain_step_seconds(lm, ids, n, steps) for n in ((1, rows) if run % 2 == 0 else (rows, 1))}
        ratios.append(t[rows] / t[1])
    return statistics.median(ratios)


def prefill_peak_bytes(lm: LoadedModel, ids: list[int], probe: Probe | None) -> int:
    """Peak tensor bytes alive during one plain prefill of ``ids`` (last-token logits only), ``probe`` attached."""
    with forward_context(probes=probe), TensorMemory() as mem:
        plain_logits(lm, ids, 1, DynamicCache(config=lm.model.config))
    return mem.peak
