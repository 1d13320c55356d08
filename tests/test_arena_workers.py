"""The arena grid on local Ray workers: the same rows as in-process, a killed worker, failed cells, Cancel."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import ray.cloudpickle

import kvlab.cli.arena as arena_command
from kvlab.cli import main
from kvlab.engine.attention import register_attention
from kvlab.engine.facts import LoadedModel, ModelFacts
from kvlab.errors import KvlabError
from kvlab.experiments.job import ArenaJob
from kvlab.experiments.plan import ArenaSettings, RayPlan
from kvlab.experiments.runner import COLUMNS, cells_not_run, run_arena
from kvlab.experiments.tables import failures, results_json
from kvlab.experiments.workers import REACH_S, check_reachable, run_arena_ray
from kvlab.saved import TIMED
from kvlab.workloads.chat.conversation import Conversation, load_conversation

# the workers cannot import this test module: the model source below travels by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "data" / "retrieval" / "community-garden.json"
SETTINGS = ArenaSettings(policies=("streamingllm", "window"), budgets=(16, 32, 48), max_new_tokens=3, max_turns=2)
TIMINGS = [c for c in COLUMNS if TIMED.search(c)]  # the wall-clock columns, the only ones runs differ in
LIMIT_S = 600  # per Ray run: generous for a loaded 2-core machine (a run takes 30-60 s there), but bounded


@dataclass
class Shipped:
    """The tiny model itself, sent to the workers; with ``crashes``, a worker dies on its third forward
    while a crash token is left in that folder (each death uses one)."""

    model: Any
    tokenizer: Any
    facts: ModelFacts
    crashes: Path | None = None

    def load(self) -> LoadedModel:
        register_attention()
        lm = LoadedModel(model=self.model, tokenizer=self.tokenizer, facts=self.facts, lock=threading.RLock())
        if self.crashes is not None:
            forward, calls, folder = lm.model.forward, [0], self.crashes

            def crashing(*args, **kwargs):
                calls[0] += 1
                if calls[0] == 3:
                    for token in sorted(folder.iterdir()):
                        try:
                            token.unlink()  # claimed: this worker dies
                        except FileNotFoundError:
                            continue
                        os._exit(1)
                return forward(*args, **kwargs)

            lm.model.forward = crashing
        return lm


def shipped(tiny: LoadedModel, crashes: Path | None = None) -> Shipped:
    return Shipped(tiny.model, tiny.tokenizer, tiny.facts, crashes)


def crash_tokens(folder: Path, n: int) -> Path:
    folder.mkdir()
    for i in range(n):
        (folder / f"crash-{i}").touch()
    return folder


@pytest.fixture(scope="module")
def conv() -> Conversation:
    return load_conversation(WORKLOAD)


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel, conv: Conversation) -> pd.DataFrame:
    """The in-process run of the grid."""
    return run_arena(tiny, [conv], SETTINGS)


def on_ray(source: Shipped, plan: RayPlan, cancel: threading.Event | None = None, **kwargs) -> pd.DataFrame:
    """``run_arena_ray`` on the grid, failing the test after LIMIT_S instead of stalling CI (cancelled first)."""
    cancel = cancel or threading.Event()
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["table"] = run_arena_ray(source, [load_conversation(WORKLOAD)], SETTINGS, plan, cancel=cancel, **kwargs)
        except BaseException as exc:  # re-raised in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    if thread.is_alive():
        cancel.set()
        thread.join(120)
        pytest.fail(f"the Ray run gave no result within {LIMIT_S} s")
    if "error" in out:
        raise out["error"]
    return out["table"]


def same(a: pd.DataFrame, b: pd.DataFrame, check_dtype: bool = True) -> None:
    pd.testing.assert_frame_equal(a.drop(columns=TIMINGS).reset_index(drop=True),
                                  b.drop(columns=TIMINGS).reset_index(drop=True), check_exact=True,
                                  check_dtype=check_dtype)


@pytest.mark.slow  # starts Ray workers
def test_two_local_workers_give_the_in_process_rows(tiny: LoadedModel, reference: pd.DataFrame) -> None:
    seen: list[tuple[float, str]] = []
    table = on_ray(shipped(tiny), RayPlan(workers=2), progress=lambda *a: seen.append(a))
    same(table, reference)  # same rows, same order, every number bit for bit
    assert seen[0] == (0.0, "starting Ray: 2 workers on local Ray") and seen[-1] == (1.0, "done")
    assert any("3/3 cells · turns/s per worker: " in label for *_, label in seen)
    assert [d for d, *_ in seen] == sorted(d for d, *_ in seen)  # one bar that only moves forward


@pytest.mark.slow  # starts Ray workers
def test_a_killed_worker_has_its_cell_retried(tiny: LoadedModel, reference: pd.DataFrame, tmp_path: Path) -> None:
    tokens = crash_tokens(tmp_path / "crashes", 1)
    table = on_ray(shipped(tiny, tokens), RayPlan(workers=2))
    assert not any(tokens.iterdir())  # a worker did die mid-cell
    same(table, reference)  # and Ray's retry ran that cell again in full


@pytest.mark.slow  # starts Ray workers
def test_a_cell_that_kills_its_worker_twice_is_a_failed_row(tiny: LoadedModel, reference: pd.DataFrame,
                                                            tmp_path: Path) -> None:
    tokens = crash_tokens(tmp_path / "crashes", 2)
    table = on_ray(shipped(tiny, tokens), RayPlan(workers=1))
    assert len(table) == len(reference)  # never dropped: the first cell is there, failed
    first = table["budget"] == 16
    assert table[first]["error"].str.startswith("cell failed on a Ray worker (retried once)").all()
    assert not table[first]["scored"].any() and table[first]["kl"].isna().all()
    # the restarted worker ran the other cells (their columns are objects here, next to the failed rows' None)
    same(table[~first], reference[reference["budget"] != 16], check_dtype=False)
    assert set(failures(table)["policy"]) == {"full", "streamingllm", "window"}


@pytest.mark.slow  # starts Ray workers
def test_cancel_keeps_the_finished_cells(tiny: LoadedModel, conv: Conversation, reference: pd.DataFrame) -> None:
    cancel = threading.Event()

    def progress(fraction: float, label: str) -> None:
        if label.startswith("1/3 cells"):
            cancel.set()

    table = on_ray(shipped(tiny), RayPlan(workers=1), cancel=cancel, progress=progress)
    assert set(table["budget"]) == {16}  # the second cell was cut short, the third never started
    same(table, reference[reference["budget"] == 16])
    assert cells_not_run(table, [conv], SETTINGS) == 2


# A Ray cluster started by another process, from a folder without kvlab: its workers get kvlab's code from
# the driver. Token authentication is off here; on a real cluster the driver needs the cluster's token.
HEAD = """import os, sys, ray
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
"""


# The driver joins from a fresh process, as `kvlab arena --ray-address` does: this one has run local Ray
# workers, after which Ray 2.60 cannot join another cluster (run_arena_ray says so, tested below).
DRIVER = """import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import conftest, test_arena_workers as t
tiny = conftest.tiny.__wrapped__(conftest.tokenizer.__wrapped__(), conftest.embedded_config.__wrapped__())
seen = []
table = t.on_ray(t.shipped(tiny), t.RayPlan(address=sys.argv[2]), progress=lambda *a: seen.append(a))
table.to_pickle(sys.argv[3])
print(seen[0][1], "|", seen[-2][1])
"""


@pytest.mark.slow  # starts Ray workers
def test_a_ray_cluster_address_gives_the_in_process_rows(reference: pd.DataFrame, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}  # as a fresh shell has it
    head = subprocess.Popen([sys.executable, "-c", HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=env | {"PYTHONPATH": ""})
    try:
        address = head.stdout.readline().strip()
        assert address, "the Ray head did not start"
        driver = subprocess.run([sys.executable, "-c", DRIVER, str(ROOT), address, str(tmp_path / "table.pkl")],
                                capture_output=True, text=True, cwd=ROOT, env=env, timeout=LIMIT_S + 120)
        assert driver.returncode == 0, driver.stderr[-3000:]
        same(pd.read_pickle(tmp_path / "table.pkl"), reference)
        first, last = driver.stdout.strip().splitlines()[-1].split(" | ")
        assert first == f"starting Ray: its workers on the Ray cluster at {address}"
        assert "turns/s per worker: " in last and last.count(",") == 1  # two workers: the cluster's two CPUs
    finally:
        head.stdin.close()  # the head's script ends, and Ray with it
        try:
            head.wait(120)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(30)


@pytest.mark.slow  # starts Ray workers
def test_joining_a_cluster_after_local_workers_is_refused_in_words(tiny: LoadedModel) -> None:
    on_ray(shipped(tiny), RayPlan(workers=1))
    with pytest.raises(KvlabError, match="restart it to join a Ray cluster"):
        run_arena_ray(shipped(tiny), [load_conversation(WORKLOAD)], SETTINGS, RayPlan(address="127.0.0.1:1"))


@pytest.mark.slow  # starts Ray workers
def test_job_runs_on_ray_workers(tiny: LoadedModel, conv: Conversation, reference: pd.DataFrame) -> None:
    job = ArenaJob(tiny, [conv], SETTINGS, plan=RayPlan(workers=2), source=shipped(tiny)).start()
    job.join(600)
    assert not job.running and job.error is None and not job.cancelled
    assert (job.done, job.total) == (6, 6)
    same(job.table, reference)


def test_bad_plans_are_refused() -> None:
    with pytest.raises(Exception, match="between 1 and 64"):
        RayPlan(workers=0)
    with pytest.raises(Exception, match="number of local workers or a Ray cluster address"):
        RayPlan(address="  ")


@pytest.mark.slow  # starts Ray workers
def test_cli_with_two_workers_writes_the_in_process_files(tiny: LoadedModel, conv: Conversation,
                                                          reference: pd.DataFrame, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena_command, "load_model", lambda *a, **k: tiny)
    monkeypatch.setattr(arena_command, "ModelSpec", lambda *a, **k: shipped(tiny))
    out = tmp_path / "run"
    code = main(["arena", "--workload", str(WORKLOAD), "--policies", "streamingllm,window", "--budgets", "48,16,32",
                 "--max-new-tokens", "3", "--max-turns", "2", "--workers", "2", "--out", str(out)])
    assert code == 0
    reference.to_csv(tmp_path / "reference.csv", index=False)
    same(pd.read_csv(out / "results.csv"), pd.read_csv(tmp_path / "reference.csv"))
    data = json.loads((out / "results.json").read_text())
    expected = json.loads(json.dumps(results_json(reference, SETTINGS, "tiny-llama", ["community-garden"])))
    for rows in (data["rows"], expected["rows"]):
        for row in rows:
            for column in TIMINGS:
                del row[column]
    assert data["rows"] == expected["rows"] and data["accuracy_grid"] == expected["accuracy_grid"]
    assert (out / "report.html").read_text().count('class="plotly-graph-div"') == 7  # five, then the seed's two


def test_cli_refuses_bad_worker_counts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["arena", "--workload", str(WORKLOAD), "--workers", "0", "--out", str(tmp_path / "o")]) == 2
    assert "workers must be between 1 and 64" in capsys.readouterr().err


def test_a_cluster_that_does_not_answer_is_refused_before_the_model_loads(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as unused:  # a port nothing listens on: bound, never listening
        unused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{unused.getsockname()[1]}"
        started = time.monotonic()
        code = main(["arena", "--workload", str(WORKLOAD), "--ray-address", address, "--out", str(tmp_path / "o")])
    assert code == 2 and time.monotonic() - started < REACH_S + 5  # Ray alone retried for minutes
    assert f"cannot reach the Ray cluster at {address}" in capsys.readouterr().err
    for bad in ("nohost", "ray://:x"):
        with pytest.raises(KvlabError, match="address is host:port"):
            check_reachable(bad)
    check_reachable("auto")  # Ray's own to resolve
