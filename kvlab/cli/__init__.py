"""``python -m kvlab <command>``: the headless side of every page.

Each command lives in ``kvlab/cli/<name>.py`` (``check-policy``: ``check_policy.py``) with
``add_parser(subparsers)`` (which sets ``func`` to a ``run(args) -> int``). Bad input raises ``KvlabError``:
one line on stderr, exit 2. A policy that fails during a run is reported on stderr after the results are
written: exit 1. Ctrl-C stops a command with exit 130 (chat after its current turn, writing the turns that
finished; rag after its current question, arena and stream likewise; bench at once, writing the benchmarks that
finished; the others without writing). Commands that
take ``--policy-file`` register plug-in policies first (those files, the files of ``KVLAB_POLICY_PATH`` and
installed packages' entry points): a refused file named by ``--policy-file`` is exit 2; one of the others is one
warning line on stderr, and the command goes on (asking for the refused policy is then an unknown name: exit 2).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from kvlab.cli.interrupt import INTERRUPTED
from kvlab.errors import KvlabError
from kvlab.policies.plugins import env_policy_files, load_file, load_plugins

COMMANDS = ("chat", "edit", "rag", "arena", "bench", "profile", "check-policy", "stream", "tasks")


class _Help(argparse.HelpFormatter):
    """Each option's help ends with its default, unless it has none or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # by identity: 0 == False, and a default of 0 is worth saying where a flag's False is not
        unsaid = any(action.default is d for d in (None, False, argparse.SUPPRESS)) or action.default == []
        if not action.option_strings or unsaid or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)
        # a value that starts as a negative number does ("--sinks -1,-4", "--budgets -.5", "-1e9", "-inf") is a value
        # to refuse in words, not an unknown option (argparse's own pattern takes "-1" but not "-1,4"); no kvlab
        # option starts so
        self._negative_number_matcher = re.compile(r"^-(?:\d|\.\d|inf|nan)", re.IGNORECASE)

    def error(self, message: str) -> None:  # one clear line, exit 2 (argparse would print usage too)
        print(f"kvlab: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m kvlab", description="Which KV-cache algorithm fits which workload?")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"kvlab.cli.{name.replace('-', '_')}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Run the command ``argv`` names (default: the process's arguments); ``parser``: one built already."""
    args = (parser or build_parser()).parse_args(argv)
    try:
        if hasattr(args, "policy_file"):
            refusals = load_plugins([*env_policy_files(), *args.policy_file])
            for file in args.policy_file:  # named on the command line: asked for, so a refusal ends the command
                if refusal := load_file(file):  # (read once: load_file is cached)
                    raise KvlabError(refusal)
            for refusal in refusals:  # KVLAB_POLICY_PATH's or a package's: the rest of kvlab works on
                print(f"kvlab: warning: {refusal}", file=sys.stderr)
        return args.func(args)
    except KvlabError as exc:
        print(f"kvlab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a command with nowhere to stop cleanly (chat, rag, arena, stream, bench have their own)
        print(f"\nkvlab: interrupted: {args.command} stopped before it finished and wrote no result", file=sys.stderr)
        return INTERRUPTED
