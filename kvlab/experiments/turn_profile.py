"""Where a follow-up turn's time goes: its phases and its operators, Full alone against several policies.

The bench's turn rows say what a multi-policy follow-up costs over Full alone; this says where. Each side runs a
first turn of prose, then the bench's short follow-up. The phases (the session's own marks: the message, the
evictions, the decoding, the reply fed, the records) are timed without a profiler over ``runs`` sessions, the sides
alternating; the run of median length is shown, so its phases add up to the time shown. One more follow-up runs
under ``torch.profiler`` for its operators (calls, the host's self time and, on a GPU, the device's), the
``item``/``int``/``bool`` reads of a value (on a GPU each waits for the device's queue) and, on a GPU, the kernels
launched and the host's explicit waits. ``kvlab profile`` prints it; the GPU check keeps it beside the bench, so a
lease of a GPU shows where its ratios come from.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from kvlab.engine.facts import LoadedModel
from kvlab.engine.progress import Progress
from kvlab.engine.timing import SINGLE_RUN_NOTE, clock
from kvlab.experiments.bench import FOLLOW_UP, TURN_REQUEST, prose_ids, turn_errors
from kvlab.workloads.chat.session import ChatSession, OnPhase, TurnResult
from kvlab.workloads.chat.settings import ChatSettings

BUDGET = 256  # tokens per layer and KV head, as the bench's turn rows
NEW_TOKENS = 16  # as the issue's own measurement of a follow-up
BEFORE = "before the first phase"  # the turn's setup before its first mark
READ_OPS = ("aten::_local_scalar_dense",)  # what item, int and bool dispatch to: a value copied to the host
LAUNCH_OPS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
WAIT_OPS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


@dataclass(frozen=True)
class OpTime:
    """One operator over a profiled follow-up: its calls and self time on the host and on the device (ms)."""

    name: str
    calls: int
    host_ms: float
    device_ms: float


@dataclass(frozen=True)
class SideProfile:
    """One side of the comparison: its policies, its follow-ups' seconds, the phases of the run of median length
    and, from one profiled follow-up, its operators by host self time and its counts; ``errors``: "policy: error"
    of every policy that failed in any of its turns (its times would not measure the side asked for: it then has
    no seconds, phases, operators or counts)."""

    policies: tuple[str, ...]
    seconds: list[float]  # the follow-up's wall time, one per run
    phases: dict[str, float]  # phase → seconds in the run of median length, in the order the turn ran them
    ops: list[OpTime]
    reads: int | None  # item, int and bool reads of a value (None: the side failed)
    kernels: int | None  # kernels launched (a GPU's)
    waits: int | None  # the host's explicit waits for the device (a GPU's)
    errors: list[str]


def phase_name(what: str) -> str:
    """A phase's mark without its counts: "feeding the reply (17 tokens) to …" → "feeding the reply",
    "KVzip: repeating 18 new tokens" → "KVzip: repeating N new tokens"."""
    return re.sub(r"\d[\d,]*", "N", what.split(" (")[0])


def tokens_needed(lm: LoadedModel, context_tokens: int, new_tokens: int = NEW_TOKENS) -> int:
    """Tokens a profiled conversation holds at its end: the first message, the follow-up, both replies and each
    turn's end-of-turn tokens."""
    session = ChatSession(lm, ChatSettings(policies=("full",), budget=BUDGET, max_new_tokens=new_tokens))
    first = session.user_ids(lm.decode(prose_ids(lm, context_tokens)) + TURN_REQUEST, "", first=True)
    follow = session.user_ids(FOLLOW_UP, "", first=False)
    return len(first) + len(follow) + 2 * (new_tokens + len(lm.encode(session.format.assistant_end)))


def _follow_up(lm: LoadedModel, settings: ChatSettings, user: str, on_phase: OnPhase | None = None,
               around: AbstractContextManager | None = None) -> tuple[float, float, list[TurnResult]]:
    """A fresh session's first turn (``user``), then the follow-up inside ``around`` → the clock as the follow-up
    starts and ends, and both turns."""
    session = ChatSession(lm, settings)
    first = session.run_turn(user)
    with around or nullcontext():
        start = clock()
        follow = session.run_turn(FOLLOW_UP, on_phase=on_phase)
        end = clock()
    return start, end, [first, follow]


def _timed_phases(lm: LoadedModel, settings: ChatSettings, user: str
                  ) -> tuple[float, dict[str, float], list[TurnResult]]:
    """One follow-up's seconds and each phase's, from its mark to the next (the last to the turn's end), and the
    turns."""
    marks: list[tuple[str, float]] = []
    start, end, turns = _follow_up(lm, settings, user, lambda what: marks.append((phase_name(what), clock())))
    phases = {BEFORE: marks[0][1] - start if marks else end - start}
    for (name, at), (_, until) in zip(marks, [*marks[1:], ("", end)]):
        phases[name] = phases.get(name, 0.0) + until - at
    return end - start, phases, turns


def _profiled(lm: LoadedModel, settings: ChatSettings, user: str, top: int
              ) -> tuple[list[OpTime], dict[str, int], list[TurnResult]]:
    """One follow-up under the profiler → the ``top`` operators by host self time, the counts, the turns."""
    on_gpu = torch.device(lm.facts.device).type == "cuda"
    prof = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])])
    *_, turns = _follow_up(lm, settings, user, around=_quietly(prof))
    events = prof.key_averages()
    count = {e.key: e.count for e in events}
    ops = sorted((OpTime(e.key, e.count, e.self_cpu_time_total / 1e3, e.self_device_time_total / 1e3)
                  for e in events if e.key not in LAUNCH_OPS + WAIT_OPS), key=lambda o: -o.host_ms)
    counts = {name: sum(count.get(k, 0) for k in keys)
              for name, keys in (("reads", READ_OPS), ("kernels", LAUNCH_OPS), ("waits", WAIT_OPS))}
    return ops[:top], counts, turns


@contextmanager
def _quietly(prof: profile) -> Iterator[profile]:
    """``prof`` entered and left without libkineto's trace lines on stderr."""
    with _without_trace_lines():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _without_trace_lines():
            prof.__exit__(*sys.exc_info())


@contextmanager
def _without_trace_lines() -> Iterator[None]:
    """Standard error's file descriptor (libkineto writes there from C++) through a temporary file, every line passed
    on but libkineto's ``USDT:`` trace lines, which it writes at each profiler start and stop at a level that no
    environment variable turns off (tried: KINETO_LOG_LEVEL, TORCH_CPP_LOG_LEVEL, GLOG_minloglevel). For the command
    line's one thread: the descriptor is the process's. Where it cannot be redirected, the lines pass."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (AttributeError, OSError, ValueError):  # no stderr, or none on descriptor 2
        yield
        return
    with tempfile.TemporaryFile() as caught:
        try:
            os.dup2(caught.fileno(), 2)
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = b"".join(line for line in caught.read().splitlines(keepends=True) if not line.startswith(b"USDT:"))
            if kept:
                os.write(2, kept)


def profile_follow_up(
    lm: LoadedModel, sides: list[tuple[str, ...]], context_tokens: int, new_tokens: int = NEW_TOKENS,
    budget: int = BUDGET, runs: int = 3, top: int = 15, progress: Progress | None = None,
    params: dict[str, dict] | None = None,
) -> list[SideProfile]:
    """Each side's follow-up after a first turn of ``context_tokens`` tokens of prose: phases timed over ``runs``
    sessions (the sides alternating, so a load that comes and goes meets both) and one profiled follow-up.
    ``params``: policy → its parameters, for the sides that run it."""
    user = lm.decode(prose_ids(lm, context_tokens)) + TURN_REQUEST
    settings = [ChatSettings(policies=side, budget=budget, max_new_tokens=new_tokens,
                             params={n: p for n, p in (params or {}).items() if n in side}) for side in sides]
    _follow_up(lm, settings[-1], lm.decode(prose_ids(lm, 16)))  # warm-up: first-call allocations stay out
    timed: list[list[tuple[float, dict[str, float], list[TurnResult]]]] = [[] for _ in sides]
    steps, done = runs * len(sides) + len(sides), 0
    for run in range(runs):
        for i in (range(len(sides)) if run % 2 == 0 else reversed(range(len(sides)))):
            if progress:
                progress(done / steps, f"{'+'.join(sides[i])}: run {run + 1} of {runs}")
            timed[i].append(_timed_phases(lm, settings[i], user))
            done += 1
    out = []
    for i, side in enumerate(sides):
        if progress:
            progress(done / steps, f"{'+'.join(side)}: profiled")
        ops, counts, turns = _profiled(lm, settings[i], user, top)
        done += 1
        seconds = [s for s, _, _ in timed[i]]
        shown = timed[i][seconds.index(statistics.median_low(seconds))][1]
        errors = sorted(turn_errors(*turns, *(t for _, _, run_turns in timed[i] for t in run_turns)))
        if errors:  # its times are those of a side with a policy missing: no number is kept
            seconds, shown, ops, counts = [], {}, [], dict.fromkeys(counts)
        out.append(SideProfile(tuple(settings[i].policies), seconds, shown, ops, **counts, errors=errors))
    if progress:
        progress(1.0, "done")
    return out


def side_name(policies: tuple[str, ...]) -> str:
    """A side's column head: "full alone" or "N policies"."""
    return "full alone" if policies == ("full",) else f"{len(policies)} policies"


def profile_text(profiles: list[SideProfile], context_tokens: int, setup: str) -> str:
    """The profiles as plain text: seconds by phase side by side (each over the first side), then each side's top
    operators (the device's self time only where a device timed them). ``setup``: the model, device and sizes."""
    names = list(dict.fromkeys(n for p in reversed(profiles) for n in p.phases))  # the fullest side's order first
    width = max(len(n) for n in [*names, "whole follow-up"])
    runs = max(len(p.seconds) for p in profiles)  # 0: every side failed
    lines = [f"A follow-up after {context_tokens} tokens of prose: {setup}",
             "Every side failed: no time to show." if runs == 0 else
             SINGLE_RUN_NOTE if runs == 1 else f"Seconds by phase in the run of median length of {runs} (the "
                                               "fastest and slowest runs in brackets).",
             *(f"  {side_name(p.policies)}: {', '.join(p.policies)}" for p in profiles), "",
             f"{'':{width}}  " + "  ".join(f"{side_name(p.policies):>13}{'':9}" for p in profiles)]
    whole = {id(p): statistics.median_low(p.seconds) for p in profiles if not p.errors}
    for n in [*names, "whole follow-up"]:
        cells = []
        for p in profiles:
            if p.errors:
                cells.append(f"{'FAILED':>13}{'':9}")
                continue
            value, base = ((whole[id(p)], whole.get(id(profiles[0]))) if n == "whole follow-up"
                           else (p.phases.get(n, 0.0), profiles[0].phases.get(n)))
            # no ratio over a few ms, nor over a side that failed
            ratio = f"{value / base:.2f}×" if p is not profiles[0] and base is not None and base >= 0.01 else ""
            cells.append(f"{value:11.3f} s {ratio:>8}")
        lines.append(f"{n:{width}}  " + "  ".join(cells))
    if runs > 1:
        lines.append(f"{'':{width}}  " + "  ".join(
            f"{f'({min(p.seconds):.2f}–{max(p.seconds):.2f} s)' if p.seconds else '':>13}{'':9}" for p in profiles))
    on_device = any(o.device_ms for p in profiles for o in p.ops) or any(p.kernels for p in profiles)
    for p in profiles:
        if p.errors:
            lines += ["", f"{side_name(p.policies)}: not profiled", *(f"FAILED: {e}" for e in p.errors)]
            continue
        counts = f"{p.reads} item/int/bool reads" + (f", {p.kernels} kernels launched, {p.waits} waits for the "
                                                     "device" if on_device else "")
        lines += ["", f"{side_name(p.policies)}, one profiled follow-up (the profiler's own cost is in its times): "
                      f"{counts}",
                  f"{'operator':48} {'calls':>7} {'host ms':>9}" + (f" {'device ms':>10}" if on_device else "")]
        lines += [f"{o.name[:48]:48} {o.calls:7d} {o.host_ms:9.1f}" + (f" {o.device_ms:10.1f}" if on_device else "")
                  for o in p.ops]
    return "\n".join(line.rstrip() for line in lines)
