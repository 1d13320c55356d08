"""Plug-in policies: from a file and from an installed package's entry point, in the registry, the CLI and the
chat page; every broken plug-in refused in one sentence naming its file while the rest of kvlab works on."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterator

import pytest
from page_helpers import open_page

import kvlab.cli.arena as arena_command
import kvlab.cli.chat as chat_command
import kvlab.cli.stream as stream_command
from kvlab.cli import main
from kvlab.engine.facts import LoadedModel
from kvlab.policies import POLICIES, make_policy, param_specs
from kvlab.policies.plugins import PATH_VARIABLE, load_plugins, unregister_plugins
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plugin_policy.py"
BUILT_IN = list(POLICIES)
CONV = [{"role": "user", "content": "My vault code is 27182. Please keep it in mind."},
        {"role": "assistant", "content": "Noted: your vault code is 27182."}]

HEAD = ("from dataclasses import dataclass\n\nimport torch\n\n"
        "from kvlab.policies.base import LayerView, Policy, param\n\n\n")
NEWEST = '''@dataclass
class Newest(Policy):
    name = "{name}"
    summary = "the newest tokens"
    recent: int = param(1, "unused")

    def scores(self, view: LayerView) -> torch.Tensor:
        return view.positions.float()
'''
BROKEN = {  # what is wrong → (the file's text, what the refusal says)
    "import": ("import kvlab_no_such_module\n", "fails to import (ModuleNotFoundError"),
    "exit": ("raise SystemExit(3)\n", "fails to import (SystemExit: 3)"),
    "no policy": ("X = 1\n", "defines no subclass of kvlab.policies.base.Policy"),
    "not a subclass": (HEAD + "class Lone:\n    name = 'lone'\n\n    def scores(self, view):\n        return view\n",
                       "Lone is not a subclass of kvlab.policies.base.Policy"),
    "no name": (HEAD + NEWEST.replace('    name = "{name}"\n', ""), "Newest has no name"),
    "scores": (HEAD + NEWEST.format(name="lazy").split("    def scores")[0], "evicts but does not override scores()"),
    "plain field": (HEAD + NEWEST.format(name="plain").replace('param(1, "unused")', "1"),
                    "Newest.recent is not declared with param(default, help)"),
    "no help": (HEAD + NEWEST.format(name="quiet").replace('"unused"', '""'), "Newest.recent is not declared"),
    "clash": (HEAD + NEWEST.format(name="snapkv"), "its policy name 'snapkv' is taken by kvlab's SnapKV"),
    "bad default": (HEAD + NEWEST.format(name="neg").replace('param(1, "unused")', 'param(1, "n", min=2)'),
                    "Newest() with its defaults fails (KvlabError: neg: recent must be ≥ 2, not 1)"),
}


@pytest.fixture(autouse=True)
def no_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts and ends with the built-in policies only."""
    monkeypatch.delenv(PATH_VARIABLE, raising=False)
    unregister_plugins()
    yield
    unregister_plugins()
    assert list(POLICIES) == BUILT_IN


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_the_example_plugin_registers_marked_and_runs_in_a_chat(tiny: LoadedModel) -> None:
    assert load_plugins([str(EXAMPLE)]) == []
    cls = POLICIES["sinkvote"]
    assert cls.plugin == str(EXAMPLE) and cls.label == "Sink + vote" and POLICIES["full"].plugin is None
    assert [s.name for s in param_specs("sinkvote")] == ["n_sink", "window"]
    assert "sinkvote" in param_specs("kivi")[-1].choices  # KIVI composes with it like with a built-in
    assert "sinkvote" in param_specs("adakv")[0].choices  # and AdaKV ranks its scores like a built-in's
    session = ChatSession(tiny, ChatSettings(policies=("sinkvote", "adakv"), budget=12, max_new_tokens=2,
                                             params={"sinkvote": {"n_sink": 2}, "adakv": {"scorer": "sinkvote"}}))
    turn = session.run_turn("Tell me about the harbour town and its lighthouse, please.")
    rec = turn.policies["sinkvote"]
    assert rec.error is None and rec.cache_tokens == [12] * tiny.facts.n_layers
    assert turn.policies["adakv"].error is None
    assert all(heads[:2] == [0, 1] for layer in rec.retained for heads in layer)  # its sinks stayed
    assert load_plugins([str(EXAMPLE)]) == []  # a source is read once: no clash with itself


def test_the_readme_block_is_the_example_file() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Writing a plug-in policy", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert block == EXAMPLE.read_text(encoding="utf-8")


def install_package(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed package (on sys.path, with its dist-info) whose entry points offer ``newest_pkg`` and a
    ``missing`` class; returns its module file."""
    package = folder / "kvlab_test_plugin"
    package.mkdir()
    module = write(package, "__init__.py", HEAD + NEWEST.format(name="newest_pkg"))
    info = folder / "kvlab_test_plugin-0.1.dist-info"
    info.mkdir()
    write(info, "METADATA", "Metadata-Version: 2.1\nName: kvlab-test-plugin\nVersion: 0.1\n")
    write(info, "entry_points.txt", "[kvlab.policies]\nnewest_pkg = kvlab_test_plugin:Newest\n"
                                    "missing = kvlab_test_plugin:Missing\n")
    monkeypatch.syspath_prepend(str(folder))
    return module


def test_an_installed_package_plugs_in_through_its_entry_point(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    package = install_package(tmp_path, monkeypatch).parent
    refusals = load_plugins()
    assert POLICIES["newest_pkg"].plugin == f"kvlab-test-plugin ({package / '__init__.py'})"
    assert len(refusals) == 1 and "missing = kvlab_test_plugin:Missing of kvlab-test-plugin" in refusals[0]
    assert str(package / "__init__.py") in refusals[0] and "fails to import (AttributeError" in refusals[0]
    assert make_policy("newest_pkg").scores is not None


@pytest.mark.parametrize("breakage", list(BROKEN))
def test_a_broken_plugin_is_refused_naming_its_file(tmp_path: Path, breakage: str) -> None:
    text, says = BROKEN[breakage]
    bad = write(tmp_path, "bad.py", text)
    good = write(tmp_path, "good.py", HEAD + NEWEST.format(name="good"))
    refusals = load_plugins([str(bad), str(good)])
    assert len(refusals) == 1 and refusals[0].startswith(f"kvlab refused the plug-in policy file {bad}: ")
    assert says in refusals[0] and refusals[0].endswith(".") and "\n" not in refusals[0]
    assert list(POLICIES) == [*BUILT_IN, "good"]  # nothing of the broken file, the good one and the rest work
    assert make_policy("snapkv", window=8).window == 8 and POLICIES["good"].plugin == str(good)


def test_two_plugins_of_one_name_the_second_is_refused(tmp_path: Path) -> None:
    first = write(tmp_path, "first.py", HEAD + NEWEST.format(name="twin"))
    second = write(tmp_path, "second.py", HEAD + NEWEST.format(name="twin"))
    refusals = load_plugins([str(first), str(second), str(tmp_path / "absent.py")])
    assert refusals == [f"kvlab refused the plug-in policy file {second}: its policy name 'twin' is taken by the "
                        f"plug-in from {first}.",
                        f"kvlab refused the plug-in policy file {tmp_path / 'absent.py'}: there is no such file."]
    assert POLICIES["twin"].plugin == str(first)


def test_the_cli_runs_a_plugin_refuses_a_file_it_names_and_goes_on_past_one_of_the_path(
        tmp_path: Path, tiny: LoadedModel, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_command, "load_model", lambda *a, **k: tiny)
    conv = write(tmp_path, "c.json", json.dumps(CONV))
    bad = write(tmp_path, "bad.py", BROKEN["import"][0])
    args = ["chat", "--conversation", str(conv), "--budget", "12", "--max-new-tokens", "2",
            "--policy-file", str(EXAMPLE), "--param", "sinkvote.window=4", "--policies", "sinkvote,snapkv"]
    for named in (str(bad), str(tmp_path / "typo.py")):  # a file asked for that cannot load: nothing runs
        assert main([*args, "--policy-file", named, "--out", str(tmp_path / "r.json")]) == 2
        assert f"kvlab: error: kvlab refused the plug-in policy file {named}: " in capsys.readouterr().err
        assert not (tmp_path / "r.json").exists()
    monkeypatch.setenv(PATH_VARIABLE, str(bad))  # the path's file: a warning, and the run goes on
    assert main([*args, "--out", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert f"kvlab: warning: kvlab refused the plug-in policy file {bad}: it fails to import" in err
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["settings"]["params"]["sinkvote"] == {"n_sink": 4, "window": 4}
    assert data["turns"][0]["policies"]["sinkvote"]["error"] is None
    unregister_plugins()
    monkeypatch.setenv(PATH_VARIABLE, str(bad))  # the refused policy asked for: the run does not start
    assert main(["chat", "--conversation", str(conv), "--policies", "sinkvote", "--out", str(tmp_path / "s.json")]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "kvlab: error: unknown policy 'sinkvote'" in err and not (tmp_path / "s.json").exists()


def test_the_stream_command_runs_a_plugin_policy(tmp_path: Path, tiny: LoadedModel,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_command, "load_model", lambda *a, **k: tiny)
    text = write(tmp_path, "prose.txt", "The mill wheel turned and the miller counted the sacks. " * 30)
    out = tmp_path / "stream"
    assert main(["stream", "--text", str(text), "--tokens", "80", "--budget", "24", "--chunk", "16",
                 "--policies", "sinkvote,streamingllm", "--policy-file", str(EXAMPLE), "--sinks", "0",
                 "--out", str(out)]) == 0
    assert set(json.loads((out / "result.json").read_text())["settings"]["policies"]) >= {"sinkvote"}


def test_arena_refuses_plugins_on_ray_workers(tmp_path: Path, capsys: pytest.CaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena_command, "load_model", lambda *a, **k: pytest.fail("no model before the refusal"))
    conv = write(tmp_path, "c.json", json.dumps(CONV))
    assert main(["arena", "--workload", str(conv), "--policies", "sinkvote", "--policy-file", str(EXAMPLE),
                 "--workers", "2", "--out", str(tmp_path / "out")]) == 2
    assert "plug-in policies (sinkvote) run in this process only; run the grid here, not on Ray workers" in \
        capsys.readouterr().err


@pytest.mark.model
def test_the_chat_arena_and_streams_pages_list_plugins_and_warn_of_a_refused_one(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    bad = write(tmp_path, "bad.py", BROKEN["scores"][0])
    monkeypatch.setenv(PATH_VARIABLE, os.pathsep.join([str(EXAMPLE), str(bad)]))
    at = open_page("app_pages/chat.py")
    assert not at.exception
    assert any(str(bad) in w.value and "does not override scores()" in w.value for w in at.warning)
    chooser = at.multiselect(key="chat_policies")
    assert "sinkvote (plug-in)" in chooser.options and "snapkv" in chooser.options
    chooser.set_value(["sinkvote"]).run()
    assert at.number_input(key="chat_sinkvote_window").value == 8  # its widgets, like a built-in's
    at.number_input(key="chat_budget").set_value(16)
    at.number_input(key="chat_max_new").set_value(2)
    at.chat_input[0].set_value("Hello there.").run()
    assert not at.exception and not at.error
    turn = at.session_state["chat"].turns[0]
    assert turn.policies["sinkvote"].error is None
    arena = open_page("app_pages/arena.py")
    assert not arena.exception and any(str(bad) in w.value for w in arena.warning)
    assert "sinkvote (plug-in)" in arena.multiselect(key="arena_policies").options
    streams = open_page("app_pages/streams.py")  # its picker shows labels, marked alike
    assert not streams.exception and "Sink + vote (plug-in)" in streams.multiselect(key="stream_policies").options


def test_an_installed_plugin_runs_in_check_policy_and_an_arena_grid(tmp_path: Path, tiny: LoadedModel,
                                                                   capsys: pytest.CaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    install_package(tmp_path, monkeypatch)
    assert main(["check-policy", "newest_pkg"]) == 0
    printed = capsys.readouterr()
    assert "newest_pkg" in printed.out and "missing = kvlab_test_plugin:Missing" in printed.err
    monkeypatch.setattr(arena_command, "load_model", lambda *a, **k: tiny)
    conv = write(tmp_path, "c.json", json.dumps(CONV))
    out = tmp_path / "arena"
    assert main(["arena", "--workload", str(conv), "--policies", "full,newest_pkg,sinkvote", "--budgets", "8,12",
                 "--policy-file", str(EXAMPLE), "--max-new-tokens", "2", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["policy"] for r in rows} == {"full", "newest_pkg", "sinkvote"}
    assert all(r["error"] is None for r in rows) and {r["budget"] for r in rows} == {8, 12}
