"""``python -m kvlab``: the command line (``kvlab.cli``)."""

import os
import signal
import sys


def _stop_while_starting(signum: int, frame: object) -> None:
    # torch and transformers take seconds to import, and a KeyboardInterrupt raised inside them can surface as an
    # unrelated import error; nothing has run yet, so there is nothing to clean up
    print("\nkvlab: interrupted while starting", file=sys.stderr, flush=True)
    os._exit(130)


# only over Python's own handler: a Ctrl-C that the caller ignores (a background job) stays ignored
starting = signal.getsignal(signal.SIGINT) is signal.default_int_handler
if starting:
    signal.signal(signal.SIGINT, _stop_while_starting)
from kvlab.cli import build_parser, main  # noqa: E402 — after the handler, which covers its imports

parser = build_parser()  # imports every command
if starting:
    signal.signal(signal.SIGINT, signal.default_int_handler)
raise SystemExit(main(parser=parser))
