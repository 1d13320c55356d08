"""Where a follow-up turn's time goes: its phases and its operators, Full alone against several policies.

The bench's turn rows say what a multi-policy follow-up costs over Full alone; this says where. Each side runs a
first turn of prose, then the bench's short follow-up. The phases (the session's own marks: the message, the
evictions, the decoding, the reply fed) are timed without a profiler, the median of ``runs`` sessions; one more
follow-up runs under ``torch.profiler`` for its operators: calls, the host's self time and, on a GPU, the
device's self time and the kernels launched, and the values read back from the device (``item``, ``int``,
``bool``: on a GPU each waits for the device's queue). ``kvlab bench --profile`` prints it; the GPU check keeps
it beside the bench, so one lease of a GPU shows where its ratios come from.
"""

from __future__ import annotations

import statistics
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from kvlab.engine.facts import LoadedModel
from kvlab.engine.progress import Progress
from kvlab.engine.timing import clock
from kvlab.experiments.bench import FOLLOW_UP, TURN_REQUEST, prose_ids
from kvlab.workloads.chat.session import ChatSession, OnPhase
from kvlab.workloads.chat.settings import ChatSettings

READ_OPS = ("aten::_local_scalar_dense",)  # what item, int and bool dispatch to: a value copied to the host
BEFORE = "before the first phase"  # the turn's setup before its first mark
LAUNCH_OPS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


@dataclass(frozen=True)
class OpTime:
    """One operator over a profiled follow-up: its calls and self time on the host and on the device (ms)."""

    name: str
    calls: int
    host_ms: float
    device_ms: float


@dataclass(frozen=True)
class SideProfile:
    """One side of the comparison: its policies, its follow-up's seconds by phase (median of the runs) and, from
    one profiled follow-up, its operators by host self time, the device reads and the kernels launched."""

    policies: tuple[str, ...]
    seconds: list[float]  # the follow-up's wall time, one per run
    phases: dict[str, float]  # phase → median seconds, in the order the turn runs them
    ops: list[OpTime]
    device_reads: int
    kernels: int


def phase_name(what: str) -> str:
    """A phase's mark without its counts ("prefilling your message (12 tokens)" → "prefilling your message")."""
    return what.split(" (")[0]


def _follow_up(lm: LoadedModel, settings: ChatSettings, user: str, on_phase: OnPhase | None = None,
               around: AbstractContextManager | None = None) -> tuple[float, float]:
    """A fresh session's first turn (``user``), then the follow-up inside ``around``; the clock as the follow-up
    starts and ends."""
    session = ChatSession(lm, settings)
    session.run_turn(user)
    with around or nullcontext():
        start = clock()
        session.run_turn(FOLLOW_UP, on_phase=on_phase)
        end = clock()
    return start, end


def _timed_phases(lm: LoadedModel, settings: ChatSettings, user: str) -> tuple[float, dict[str, float]]:
    """One follow-up's seconds and each phase's, from its mark to the next (the last to the turn's end; what
    comes before the first mark is "before the first phase")."""
    marks: list[tuple[str, float]] = []
    start, end = _follow_up(lm, settings, user, lambda what: marks.append((phase_name(what), clock())))
    phases = {BEFORE: marks[0][1] - start if marks else end - start}
    for (name, at), (_, until) in zip(marks, [*marks[1:], ("", end)]):
        phases[name] = phases.get(name, 0.0) + until - at
    return end - start, phases


def _profiled(lm: LoadedModel, settings: ChatSettings, user: str, top: int) -> tuple[list[OpTime], int, int]:
    """One follow-up under the profiler → (the ``top`` operators by host self time, device reads, launches)."""
    on_gpu = torch.device(lm.facts.device).type == "cuda"
    prof = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])])
    _follow_up(lm, settings, user, around=prof)
    events = prof.key_averages()
    count = {e.key: e.count for e in events}
    ops = sorted((OpTime(e.key, e.count, e.self_cpu_time_total / 1e3, e.self_device_time_total / 1e3)
                  for e in events if e.key not in LAUNCH_OPS), key=lambda o: -o.host_ms)
    return ops[:top], sum(count.get(k, 0) for k in READ_OPS), sum(count.get(k, 0) for k in LAUNCH_OPS)


def profile_follow_up(
    lm: LoadedModel, sides: list[tuple[str, ...]], context_tokens: int, new_tokens: int = 16, budget: int = 256,
    runs: int = 3, top: int = 15, progress: Progress | None = None,
) -> list[SideProfile]:
    """Each side's follow-up after a first turn of ``context_tokens`` tokens of prose: phases timed over ``runs``
    sessions (the sides alternating, so a load that comes and goes meets both) and one profiled follow-up."""
    user = lm.decode(prose_ids(lm, context_tokens)) + TURN_REQUEST
    settings = [ChatSettings(policies=side, budget=budget, max_new_tokens=new_tokens) for side in sides]
    _follow_up(lm, settings[-1], lm.decode(prose_ids(lm, 16)))  # warm-up: first-call allocations stay out
    timed: list[list[tuple[float, dict[str, float]]]] = [[] for _ in sides]
    steps, done = runs * len(sides) + len(sides), 0
    for run in range(runs):
        order = range(len(sides)) if run % 2 == 0 else reversed(range(len(sides)))
        for i in order:
            if progress:
                progress(done / steps, f"{'+'.join(sides[i])}: run {run + 1} of {runs}")
            timed[i].append(_timed_phases(lm, settings[i], user))
            done += 1
    out = []
    for i, side in enumerate(sides):
        if progress:
            progress(done / steps, f"{'+'.join(side)}: profiled")
        ops, reads, kernels = _profiled(lm, settings[i], user, top)
        done += 1
        names = list(dict.fromkeys(name for _, phases in timed[i] for name in phases))
        phases = {n: statistics.median(p.get(n, 0.0) for _, p in timed[i]) for n in names}
        out.append(SideProfile(tuple(side), [s for s, _ in timed[i]], phases, ops, reads, kernels))
    return out


def side_name(policies: tuple[str, ...]) -> str:
    """A side's column head: "full alone" or "N policies"."""
    return "full alone" if policies == ("full",) else f"{len(policies)} policies"


def profile_text(profiles: list[SideProfile], context_tokens: int, device: str) -> str:
    """The profiles as plain text: seconds by phase side by side (each over the first side), then each side's top
    operators (the device's self time only where a device timed them)."""
    names = list(dict.fromkeys(n for p in profiles for n in p.phases)) + ["whole follow-up"]
    width = max(map(len, names))
    runs = len(profiles[0].seconds)
    lines = [f"A follow-up after {context_tokens} tokens on {device}: seconds by phase, the median of {runs} "
             f"run{'s' * (runs != 1)} (the whole follow-up's fastest–slowest in brackets)"]
    lines += [f"  {side_name(p.policies)}: {', '.join(p.policies)}" for p in profiles]
    lines += ["", f"{'':{width}}  " + "  ".join(f"{side_name(p.policies):>13}{'':9}" for p in profiles)]
    for n in names:
        cells = []
        for p in profiles:
            value = statistics.median(p.seconds) if n == "whole follow-up" else p.phases.get(n, 0.0)
            base = statistics.median(profiles[0].seconds) if n == "whole follow-up" else profiles[0].phases.get(n, 0.0)
            ratio = f"{value / base:.2f}×" if p is not profiles[0] and base >= 0.01 else ""  # not over a few ms
            cells.append(f"{value:11.3f} s {ratio:>8}")
        lines.append(f"{n:{width}}  " + "  ".join(cells))
    lines.append(f"{'':{width}}  " + "  ".join(f"{f'({min(p.seconds):.2f}–{max(p.seconds):.2f} s)':>13}{'':9}"
                                                for p in profiles))
    timed_on_device = any(o.device_ms for p in profiles for o in p.ops)
    for p in profiles:
        lines += ["", f"{side_name(p.policies)}, one profiled follow-up (the profiler's own cost is in its times): "
                      f"{p.device_reads} values read from the device, {p.kernels} kernels launched",
                  f"{'operator':48} {'calls':>7} {'host ms':>9}" + (f" {'device ms':>10}" if timed_on_device else "")]
        lines += [f"{o.name[:48]:48} {o.calls:7d} {o.host_ms:9.1f}" + (f" {o.device_ms:10.1f}" if timed_on_device
                                                                       else "") for o in p.ops]
    return "\n".join(line.rstrip() for line in lines)
