"""The GPU check (``make gpu-check``): kvlab's exactness on an accelerator, its benchmark, a chat and two profiles.

One script, four steps, one summary (``artifacts/gpu-check/summary.md`` and ``summary.json``):

1. the architecture tests (``tests/test_architectures.py``: seven tiny architectures against transformers'
   own eager attention) on the device in the chosen dtype, with the tolerance ``tests/tiny_models.py`` states
   for it;
2. ``kvlab bench --quick`` on the device (the dtype the device picks: bfloat16 on a GPU, float32 on a CPU);
3. a scripted five-policy chat (``kvlab chat``) in the chosen dtype: each policy's KL to Full and answers;
4. where a follow-up's time goes on the device (``kvlab profile``, in the dtype the device picks, as the bench),
   Full alone against the five policies and against Quest: each phase's seconds, the operators' host and device
   time, the kernels launched, the host's waits for the device and its reads of values.

It runs on the CPU as well (``--device cpu``, the default where no GPU is found), so what "exact" means in
bfloat16 is checked before a GPU is at hand. A failed step is reported as failed and the exit code is 1;
every step runs whatever the others did.

    .venv/bin/python benchmarks/gpu_check.py [--device cuda] [--dtype bfloat16] [--skip-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

CONVERSATION = ROOT / "data" / "conversations" / "personal-facts.json"
POLICIES = "full,streamingllm,h2o,snapkv,pyramidkv"
PROFILES = {"five": POLICIES, "quest": "quest"}  # kvlab profile: Full alone against these


def run_step(name: str, command: list[str], env: dict[str, str], log: Path) -> dict:
    """Run one step's command, its output into ``log``; its wall time and exit code."""
    print(f"[gpu-check] {name}: {' '.join(command)}", flush=True)
    t0 = time.perf_counter()
    with log.open("w", encoding="utf-8") as out:
        code = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - t0
    print(f"[gpu-check] {name}: exit {code} after {seconds:.0f} s (log {log})", flush=True)
    shown = log.relative_to(ROOT) if log.is_relative_to(ROOT) else log  # --out may lie outside the checkout
    return {"step": name, "exit": code, "seconds": round(seconds, 1), "log": str(shown)}


def test_counts(junit: Path) -> dict:
    """Passed, failed, errors and skipped from pytest's JUnit XML (all zero when it wrote none)."""
    if not junit.exists():
        return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"passed": passed, "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"]}


def chat_summary(path: Path) -> list[dict]:
    """Per policy over the chat's turns: mean KL to Full, answers right of those scored, kept tokens at the end."""
    if not path.exists():
        return []
    turns = json.loads(path.read_text(encoding="utf-8"))["turns"]
    rows = []
    for name in turns[0]["policies"]:
        runs = [t["policies"][name] for t in turns]
        kl = [r["kl"] for r in runs if r.get("kl") is not None]
        scored = [r["correct"] for r in runs if r.get("correct") is not None]
        error = next((r["error"] for r in runs if r.get("error")), None)
        rows.append({"policy": name, "mean_kl": round(statistics.fmean(kl), 4) if kl else None,
                     "right": f"{sum(scored)}/{len(scored)}", "error": error})
    return rows


def measured(r: dict) -> str:
    """A bench row's value with its unit, or why it has none (its JSON value is null then)."""
    return f"{r['value']:.3g} {r['unit']}" if r["value"] is not None else r["detail"]


def markdown(summary: dict) -> str:
    """The summary as the README's GPU section takes it."""
    lines = [f"# kvlab GPU check — {summary['device_name']} ({summary['device']}), {summary['dtype']}", "",
             f"torch {summary['torch']}, CUDA {summary['cuda']}, started {summary['started']}", "",
             "| step | exit | seconds |", "|---|---|---|"]
    lines += [f"| {s['step']} | {s['exit']} | {s['seconds']} |" for s in summary["steps"]]
    t = summary["tests"]
    lines += ["", f"Architecture tests in {summary['dtype']} (tolerance {summary['tolerance']} × the reference's "
              f"largest value): {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
              f"{t['skipped']} skipped.", ""]
    if summary["bench"]:
        lines += ["| bench row | value | target | met |", "|---|---|---|---|"]
        lines += [f"| {r['label']} | {measured(r)} | {r['op']} {r['target']:g} | {'yes' if r['passed'] else 'NO'} |"
                  for r in summary["bench"]]
        lines.append("")
    if summary["chat"]:
        lines += [f"Five-policy chat ({CONVERSATION.stem}, {summary['dtype']}):", "",
                  "| policy | mean KL to Full | answers right | error |", "|---|---|---|---|"]
        lines += [f"| {r['policy']} | {r['mean_kl']} | {r['right']} | {r['error'] or ''} |" for r in summary["chat"]]
    for text in summary["profiles"]:
        lines += ["", "```text", text, "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    import torch
    from tiny_models import TOLERANCES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(TOLERANCES))
    p.add_argument("--skip-bench", action="store_true", help="leave out kvlab bench --quick (minutes on a CPU)")
    p.add_argument("--out", default=str(ROOT / "artifacts" / "gpu-check"))
    args = p.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "KVLAB_TEST_DEVICE": args.device, "KVLAB_TEST_DTYPE": args.dtype}
    py = sys.executable
    junit, bench, chat = out / "architectures.xml", out / "bench.json", out / "chat.json"
    profiles = {side: out / f"profile-{side}.json" for side in PROFILES}
    for stale in [junit, bench, chat, *profiles.values()]:
        stale.unlink(missing_ok=True)  # a step that fails writes none: the summary must not read an earlier run's
    steps = [run_step("architecture tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                             "tests/test_architectures.py", f"--junitxml={junit}"],
                      env, out / "architectures.log")]
    if not args.skip_bench:
        steps.append(run_step("kvlab bench --quick", [py, "-m", "kvlab", "bench", "--quick", "--device", args.device,
                                                      "--out", str(bench)], env, out / "bench.log"))
    steps.append(run_step("five-policy chat", [py, "-m", "kvlab", "chat", "--conversation", str(CONVERSATION),
                                               "--policies", POLICIES, "--max-new-tokens", "16", "--device",
                                               args.device, "--dtype", args.dtype, "--out", str(chat)],
                          env, out / "chat.log"))
    for side, policies in PROFILES.items():
        steps.append(run_step(f"profile: {side}", [py, "-m", "kvlab", "profile", "--policies", policies, "--runs", "3",
                                                   "--device", args.device, "--out", str(profiles[side])],
                              env, out / f"profile-{side}.log"))
    summary = {
        "device": args.device, "dtype": args.dtype, "tolerance": TOLERANCES[args.dtype],
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU",
        "torch": torch.__version__, "cuda": torch.version.cuda, "started": started,
        "steps": steps, "tests": test_counts(junit), "chat": chat_summary(chat),
        "bench": json.loads(bench.read_text())["rows"] if bench.exists() else [],
        "profiles": [json.loads(f.read_text())["text"] for f in profiles.values() if f.exists()],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    (out / "summary.md").write_text(markdown(summary), encoding="utf-8")
    print(markdown(summary))
    return 1 if any(s["exit"] != 0 for s in steps) else 0


if __name__ == "__main__":
    raise SystemExit(main())
