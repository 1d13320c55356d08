"""What a stream runs: its settings and their checks, the runners' names and labels, and the work each chunk costs.

A runner is a cache policy, Full (the dense baseline) or ``recompute`` (the sliding window with recomputation, which
is no cache policy: ``run.py`` runs it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import POSITION_MODES
from kvlab.errors import KvlabError
from kvlab.policies import POLICIES, Policy, make_policy

RECOMPUTE = "recompute"
BASELINE_LABELS = {"full": "dense (Full)", RECOMPUTE: "sliding window + recompute"}
MAX_CHUNK = 4096
DEFAULT_POLICIES = ("full", "window", "streamingllm", RECOMPUTE)


def label_of(name: str) -> str:
    """How tables and charts name a runner: a baseline's label, a policy's own, or the name itself."""
    return BASELINE_LABELS.get(name) or POLICIES.label(name)


@dataclass(frozen=True)
class StreamSettings:
    """What a stream runs: which policies (and baselines), at which cache size, chunk and position mode."""

    policies: tuple[str, ...] = DEFAULT_POLICIES
    budget: int = 1024  # tokens each cache keeps after every chunk (the recompute baseline's window)
    chunk: int = 64  # tokens read per forward; 1 is StreamingLLM's token-by-token protocol
    position_mode: str = "rerotated"
    params: dict[str, dict] = field(default_factory=dict)  # policy -> parameter overrides

    def check(self) -> None:
        """Refuse settings no stream can run (KvlabError), before any model work; names are checked where
        they become policies (``stream_policies``)."""
        if not self.policies:
            raise KvlabError("choose at least one policy to stream")
        if len(set(self.policies)) != len(self.policies):
            raise KvlabError("each policy may be streamed once")
        if not isinstance(self.budget, int) or self.budget < 1:
            raise KvlabError(f"the cache size must be a whole number of tokens ≥ 1, not {self.budget!r}")
        if not isinstance(self.chunk, int) or not 1 <= self.chunk <= MAX_CHUNK:
            raise KvlabError(f"the chunk must be a whole number of tokens from 1 to {MAX_CHUNK}, not {self.chunk!r}")
        if self.position_mode not in POSITION_MODES:
            raise KvlabError(f"position mode must be one of {', '.join(POSITION_MODES)}, not {self.position_mode!r}")
        if stray := sorted(set(self.params) - set(self.policies)):
            raise KvlabError(f"parameters given for {', '.join(stray)}, which is not among the policies streamed")


def streamable() -> list[str]:
    """The names a stream can run: Full, the policies that bound the cache without a script's future queries, and
    the recompute baseline (``stream_policies`` refuses the others in words)."""
    def bounded(name: str) -> bool:
        policy = make_policy(name)
        return not policy.needs_future and not policy.keeps_growing()

    return [n for n in POLICIES if n == "full" or bounded(n)] + [RECOMPUTE]


def check_names(settings: StreamSettings) -> None:
    """Refuse the settings, or a name that is neither a registered policy nor the recompute baseline."""
    settings.check()
    if unknown := [n for n in settings.policies if n not in POLICIES and n != RECOMPUTE]:
        raise KvlabError(f"unknown policy {unknown[0]!r}; a stream runs {', '.join(streamable())}")


def stream_policies(lm: LoadedModel, settings: StreamSettings) -> dict[str, Policy]:
    """The settings' cache policies (the recompute baseline is none), refused where they cannot stream."""
    check_names(settings)
    policies = {}
    for name in settings.policies:
        if name == RECOMPUTE:
            continue
        policy = make_policy(name, **settings.params.get(name, {}))
        if policy.needs_future:
            raise KvlabError(f"{policy.label} reads what a scripted conversation's later queries attend to; a stream "
                             "has no script")
        if policy.keeps_growing() and name != "full":
            raise KvlabError(f"{name} keeps every key (in some heads at least), so its cache grows with the stream; "
                             "streams compare policies that bound the cache (Full is the dense baseline)")
        policies[name] = policy
    refused = []  # every policy the budget does not suit, said at once
    for name, policy in policies.items():
        try:
            policy.validate(settings.budget, lm.facts.context_length)
        except KvlabError as exc:
            refused.append(str(exc))
    if refused:
        raise KvlabError("; ".join(refused))
    if settings.position_mode == "rerotated" and not lm.facts.has_rope:
        raise KvlabError("re-rotated positions need a model with rotary embeddings")
    return policies


def check_length(n_tokens: int, settings: StreamSettings) -> None:
    """Refuse a stream too short for its cache to evict anything."""
    needed = settings.budget + settings.chunk + 1
    if n_tokens < needed:
        raise KvlabError(f"a stream of {n_tokens:,} tokens is too short: a cache of {settings.budget:,} read in "
                         f"chunks of {settings.chunk:,} needs at least {needed:,} for anything to be evicted")


def chunk_work(settings: StreamSettings, start: int, end: int) -> int:
    """Tokens the chunk ``start`` … ``end`` − 1 runs through the model: each cache's chunk (fed side by side, but
    rows of a chunk are compute-bound, so each costs its own) and the recompute baseline's window read again.
    Progress and time left count these: the baseline's chunks cost more than a cache's, and more as its window
    fills, so tokens streamed alone misjudged the time left by about 2×."""
    n = end - start
    caches = sum(name != RECOMPUTE for name in settings.policies)
    return caches * n + (min(start, settings.budget) + n if RECOMPUTE in settings.policies else 0)


def chunks(n_tokens: int, chunk: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each chunk a stream of ``n_tokens`` reads: the last token predicts nothing, so is never read."""
    total = n_tokens - 1
    for start in range(0, total, chunk):
        yield start, min(start + chunk, total)


def stream_work(settings: StreamSettings, n_tokens: int) -> int:
    """``chunk_work`` over a whole stream of ``n_tokens``."""
    return sum(chunk_work(settings, start, end) for start, end in chunks(n_tokens, settings.chunk))
