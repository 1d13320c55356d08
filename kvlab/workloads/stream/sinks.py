"""The sink ablation of StreamingLLM's Table 1: one stream at one cache size with 0, 1, 2, 4 and 8 sinks.

Xiao et al. (2023), Table 1: Llama-2-13B at a cache of 1024, window (0 + 1024) perplexity 5158, 1 + 1023
11.88, 2 + 1022 10.51, 4 + 1020 5.40, 8 + 1016 5.33. Every row here is kvlab's StreamingLLM policy
(mit-han-lab/streaming-llm ``streaming_llm/kv_cache.py``, ``start_size`` = sinks) at the same cache;
0 sinks is the plain window. All rows stream side by side over the same tokens.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvlab.engine.facts import LoadedModel
from kvlab.engine.progress import Progress
from kvlab.errors import KvlabError
from kvlab.lists import split_items
from kvlab.policies.streamingllm import StreamingLLM
from kvlab.workloads.stream.run import StreamResult, stream_with
from kvlab.workloads.stream.settings import StreamSettings

SINKS = (0, 1, 2, 4, 8)


def sink_name(sinks: int) -> str:
    """A row's runner name: ``"4 sinks"``, ``"0 sinks"``."""
    return f"{sinks} sink" + ("" if sinks == 1 else "s")


@dataclass
class SinkAblation:
    """The ablation's stream (one runner per sink count) and the cache size it ran at."""

    result: StreamResult
    sinks: tuple[int, ...]
    cache: int

    def table(self) -> pd.DataFrame:
        """One row per sink count: the split of the cache, perplexity over the whole stream and after the
        cache first filled (where the rows can differ), and whether any query sat past the trained context."""
        df = self.result.tokens()
        rows = []
        for k in self.sinks:
            mine = df[df.policy == sink_name(k)]
            after = mine[mine.position > self.cache]
            rows.append({
                "sinks": k, "recent": self.cache - k, "cache": f"{k} + {self.cache - k}",
                "ppl": float(np.exp(mine.nll.mean())) if len(mine) else None,
                "ppl_after_cache_filled": float(np.exp(after.nll.mean())) if len(after) else None,
                "tokens": len(mine), "past_context": bool(mine.past_context.any()),
                "error": self.result.traces[sink_name(k)].error,
            })
        return pd.DataFrame(rows)


def parse_sinks(text: str, cache: int) -> tuple[int, ...]:
    """Sink counts a user typed (``"0,1,2,4,8"``), checked against a cache of ``cache`` tokens."""
    parts = split_items(text, "sink counts")
    if not parts:
        raise KvlabError("give at least one sink count, e.g. 0,1,2,4,8")
    try:
        sinks = tuple(int(part) for part in parts)
    except ValueError:
        raise KvlabError(f"sink counts are whole numbers separated by commas, e.g. 0,1,2,4,8, not {text!r}") from None
    check_sinks(sinks, cache)
    return sinks


def check_sinks(sinks: tuple[int, ...], cache: int) -> None:
    """Refuse sink counts that are not distinct whole numbers, or that leave no recent tokens in the cache."""
    if not sinks or len(set(sinks)) != len(sinks) or any(not isinstance(k, int) or k < 0 for k in sinks):
        raise KvlabError(f"sink counts must be distinct whole numbers ≥ 0, not {', '.join(map(str, sinks)) or 'none'}")
    if max(sinks) >= cache:
        raise KvlabError(f"{max(sinks)} sinks leave no room for recent tokens in a cache of {cache}")


def ablation_settings(cache: int, sinks: tuple[int, ...], chunk: int, position_mode: str) -> StreamSettings:
    """What the ablation streams: one StreamingLLM cache per sink count, named by ``sink_name``."""
    return StreamSettings(policies=tuple(map(sink_name, sinks)), budget=cache, chunk=chunk,
                          position_mode=position_mode)


def sink_ablation(
    lm: LoadedModel,
    ids: list[int],
    cache: int = 1024,
    sinks: tuple[int, ...] = SINKS,
    chunk: int = 64,
    position_mode: str = "rerotated",
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
) -> SinkAblation:
    """Stream ``ids`` at a cache of ``cache`` tokens once per sink count, side by side."""
    check_sinks(sinks, cache)
    policies = {sink_name(k): StreamingLLM(n_sink=k) for k in sinks}
    settings = ablation_settings(cache, sinks, chunk, position_mode)
    settings.check()
    for policy in policies.values():
        policy.validate(cache, lm.facts.context_length)
    return SinkAblation(stream_with(lm, ids, settings, policies, progress, cancel), tuple(sinks), cache)


def stream_record(result: StreamResult, text_name: str, segment: int, ablation: SinkAblation | None) -> dict:
    """A stream's JSON file (``StreamResult.record``), with the table and seconds of the ``ablation`` run beside it."""
    if ablation is None:
        return result.record(text_name, segment)
    return result.record(text_name, segment, ablation.table(), ablation.result.time_s)
