"""The arena grid on Ray workers: N local workers, or workers on an existing Ray cluster.

Each worker is a Ray actor that loads the model once and runs whole cells (``runner.run_cell``: one
workload at one budget, every policy side by side), so a cell's rows do not depend on where it ran;
the driver puts them back in grid order. A worker that dies is restarted and its cell retried once
(Ray's ``max_task_retries``); a cell that fails again becomes failed rows (``runner.failed_cell_rows``).
The plan (``RayPlan``, ``ModelSpec``) lives in ``kvlab.experiments.plan``, which imports no Ray.
Cancelling kills the workers and keeps every finished cell.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Callable

import pandas as pd
import ray
import torch
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from kvlab.engine.progress import Progress
from kvlab.engine.timing import host_clock
from kvlab.errors import KvlabError
from kvlab.experiments.plan import ArenaSettings, Cell, ModelSource, RayPlan, grid_cells, grid_size
from kvlab.experiments.runner import COLUMNS, ScriptPass, failed_cell_rows, run_cell
from kvlab.paths import ROOT  # workers import kvlab from here (local runs)
from kvlab.workloads.chat.conversation import Conversation

POLL_S = 0.25  # how often the driver looks at progress and cancel while cells run
_ONE_RUN = threading.Lock()  # Ray is one session per process: one distributed grid at a time
_STARTED_LOCAL: list[bool] = []  # whether this process has started a local Ray (see _start_ray)


class Tracker:
    """A Ray actor the workers tell which turn each cell is on, so the driver can draw one bar."""

    def __init__(self) -> None:
        self.turns: dict[int, int] = {}

    def report(self, cell: int, turns_done: int) -> None:
        self.turns[cell] = turns_done  # a retried cell starts again from 0

    def snapshot(self) -> dict[int, int]:
        return dict(self.turns)


class ArenaWorker:
    """A Ray actor: the model loaded once, then whole cells of the grid on request."""

    def __init__(self, shared: list, tracker) -> None:
        """``shared``: object refs to the model source, the conversations and the settings."""
        source, self.conversations, self.settings = ray.get(shared)
        self.tracker, self.script_pass = tracker, ScriptPass()
        self.lm = source.load()
        if self.lm.device.type == "cpu":
            torch.set_num_threads(1)  # one worker per core: more threads would only fight over the cores

    def ready(self) -> None:
        """Returns once the constructor has loaded the model (or raises its error)."""

    def run_cell(self, cell: int, workload: int, budget: int) -> list[dict]:
        return run_cell(self.lm, self.conversations[workload], budget, self.settings,
                        on_turn=lambda i: self.tracker.report.remote(cell, i), script_pass=self.script_pass)


REACH_S = 5.0  # how long joining a cluster waits for its head's port to answer


def check_reachable(address: str) -> None:
    """Refuse a cluster address whose head does not answer within ``REACH_S`` (Ray itself retries for minutes,
    printing its own warnings): ``host:port`` or ``ray://host:port``; ``auto`` is Ray's to resolve."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise KvlabError(f"a Ray cluster address is host:port (or ray://host:port, or auto), not {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_S).close()
    except OSError as exc:
        reason = "no answer" if isinstance(exc, TimeoutError) else exc.strerror or type(exc).__name__
        raise KvlabError(f"cannot reach the Ray cluster at {address}: {reason}") from None


def _start_ray(plan: RayPlan) -> None:
    """Start a local Ray (no dashboard, no usage report) or join the cluster at ``plan.address``."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # read by the Ray processes started below: nothing leaves the machine
    common = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if plan.address:
        if _STARTED_LOCAL:
            # a local ray.init switches this process to token authentication for good (Ray 2.60 sets
            # RAY_AUTH_MODE and keeps it): the cluster's workers would then never start
            raise KvlabError("this process already ran local Ray workers; restart it to join a Ray cluster")
        check_reachable(plan.address)
        try:
            # the cluster's nodes get kvlab's code from the driver; they need the pinned requirements only
            ray.init(address=plan.address, runtime_env={"py_modules": [str(ROOT / "kvlab")]}, **common)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise KvlabError(f"could not join the Ray cluster at {plan.address}: {exc}") from None
    else:
        ray.init(address="local", num_cpus=plan.workers, _node_ip_address="127.0.0.1",  # loopback only
                 job_config=ray.job_config.JobConfig(code_search_path=[str(ROOT)]), **common)
        _STARTED_LOCAL.append(True)


def _worker_count(plan: RayPlan, n_cells: int) -> tuple[int, bool]:
    """(workers to start, whether each gets a GPU): never more workers than cells."""
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 1))
    wanted = plan.workers or max(gpus or cpus, 1)
    return max(min(wanted, n_cells), 1), gpus > 0


def _reason(exc: RayError) -> str:
    """A Ray error in one line: the worker's own exception where there is one."""
    if isinstance(exc, RayTaskError) and exc.cause is not None:
        return f"{type(exc.cause).__name__}: {exc.cause}"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no details'}"


def run_arena_ray(
    source: ModelSource,
    conversations: list[Conversation],
    settings: ArenaSettings,
    plan: RayPlan,
    cancel: threading.Event | None = None,
    progress: Progress | None = None,
    first_worker_up: Callable[[], None] | None = None,
) -> pd.DataFrame:
    """Run the grid on Ray workers; the same rows, in the same order, as ``runner.run_arena``.

    The caller checks the grid (``runner.check_grid``) first. ``progress`` gets (share of the grid's
    turns done, a label with cells done and each worker's throughput). ``cancel`` stops the workers:
    the table then holds the cells that finished. ``first_worker_up`` is called when the first worker
    has loaded the model (the benchmark times the grid from there).
    """
    cells = grid_cells(conversations, settings)
    turns = [settings.turns_of(conversations[c.workload]) for c in cells]
    total = grid_size(conversations, settings)
    if not _ONE_RUN.acquire(blocking=False):
        raise KvlabError("another grid is running on Ray in this process; wait for it or cancel it")
    try:
        if ray.is_initialized():
            raise KvlabError("Ray is already initialised in this process by something other than kvlab")
        if progress:
            progress(0.0, f"starting Ray: {plan.describe()}")
        _start_ray(plan)
        try:
            results = _run_cells(source, conversations, settings, plan, cells, turns, total, cancel, progress,
                                 first_worker_up)
        finally:
            ray.shutdown()
    finally:
        _ONE_RUN.release()
    return pd.DataFrame([row for i in sorted(results) for row in results[i]], columns=COLUMNS)


def _run_cells(source: ModelSource, conversations: list[Conversation], settings: ArenaSettings, plan: RayPlan,
               cells: list[Cell], turns: list[int], total: int, cancel: threading.Event | None,
               progress: Progress | None, first_worker_up: Callable[[], None] | None) -> dict[int, list[dict]]:
    """Keep every ready worker busy with the next cell until the grid is done or cancelled."""
    n, gpu = _worker_count(plan, len(cells))
    worker_cls = ray.remote(ArenaWorker).options(
        num_cpus=1, num_gpus=1 if gpu else 0,
        max_restarts=2 * len(cells),  # each cell may kill its worker twice: the first try and Ray's one retry
        max_task_retries=1,
    )
    tracker = ray.remote(Tracker).options(num_cpus=0).remote()
    # refs held here until the run ends, and fetched by the worker itself: a restarted worker needs them again,
    # and Ray does not keep large constructor arguments alive for restarts (ray-project/ray#53727)
    shared = [ray.put(source), ray.put(conversations), ray.put(settings)]
    actors = [worker_cls.remote(shared, tracker) for _ in range(n)]
    starting = {actor.ready.remote(): w for w, actor in enumerate(actors)}
    queue = list(range(len(cells)))
    running: dict = {}  # task ref -> (cell, worker)
    idle: list[int] = []
    results: dict[int, list[dict]] = {}
    worker_turns = [0] * n
    since: list[float | None] = [None] * n  # when each worker was ready: its throughput counts from then

    def stopped() -> bool:
        return cancel is not None and cancel.is_set()

    while (queue or running) and not stopped():
        ready, _ = ray.wait([*starting, *running], num_returns=1, timeout=POLL_S)
        for ref in ready:
            if ref in starting:
                w = starting.pop(ref)
                try:
                    ray.get(ref)
                except RayError as exc:  # the model did not load there: every other worker would fail alike
                    raise KvlabError(f"Ray worker {w + 1} could not start: {_reason(exc)}") from None
                if first_worker_up is not None and not any(since):
                    first_worker_up()
                since[w] = host_clock()
                idle.append(w)
                continue
            cell, w = running.pop(ref)
            try:
                results[cell] = ray.get(ref)
                worker_turns[w] += turns[cell]
            except RayError as exc:
                if stopped():  # killed by the cancel itself: the cell did not run
                    continue
                conv = conversations[cells[cell].workload]
                results[cell] = failed_cell_rows(conv, cells[cell].budget, settings,
                                                 f"cell failed on a Ray worker (retried once): {_reason(exc)}")
            idle.append(w)
        while idle and queue:
            w, cell = idle.pop(0), queue.pop(0)
            running[actors[w].run_cell.remote(cell, cells[cell].workload, cells[cell].budget)] = (cell, w)
        if progress:
            progress(*_progress(tracker, running, results, turns, total, worker_turns, since, len(cells)))
    if stopped():
        ready, _ = ray.wait(list(running), num_returns=len(running), timeout=0) if running else ([], [])
        for ref in ready:
            try:
                results[running[ref][0]] = ray.get(ref)
            except RayError:
                pass  # a cell cut short by the cancel did not run
        for actor in actors:
            ray.kill(actor, no_restart=True)
    elif progress:
        progress(1.0, "done")
    return results


def _progress(tracker, running: dict, results: dict[int, list[dict]], turns: list[int], total: int,
              worker_turns: list[int], since: list[float | None], n_cells: int) -> tuple[float, str]:
    """(share of the turns done, label): finished cells plus the turns the running cells report."""
    try:
        now = ray.get(tracker.snapshot.remote(), timeout=10)
    except (GetTimeoutError, RayError):  # a slow tracker only delays the bar
        now = {}
    per_worker = list(worker_turns)
    for cell, w in running.values():
        per_worker[w] += now.get(cell, 0)
    done = sum(turns[c] for c in results) + sum(now.get(cell, 0) for cell, _ in running.values())
    now_s = host_clock()
    rates = ", ".join("loading" if t0 is None else f"{per_worker[w] / max(now_s - t0, 1e-9):.2f}"
                      for w, t0 in enumerate(since))
    return done / total, f"{len(results)}/{n_cells} cells · turns/s per worker: {rates}"
