"""Stopping a running turn before its next decoder layer: a pre-hook on every layer reads this thread's flags.

The model is shared between sessions and threads, so the flags are thread-local: a turn names the events
that may stop it (``stopping``) and only its own thread's forwards read them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from kvlab.engine.facts import LoadedModel
from kvlab.errors import Stopped

_running = threading.local()  # the stop flags of the turn running on this thread (the model is shared)
_watched: weakref.WeakSet = weakref.WeakSet()  # models whose decoder layers check it


def check_stop(*_: object) -> None:
    """Raise ``Stopped`` if a stop flag of the turn running on this thread is set (a layer's pre-hook too)."""
    if any(flag.is_set() for flag in getattr(_running, "stops", ())):
        raise Stopped("the turn was stopped")


def watch_layers(lm: LoadedModel) -> None:
    """Check the running turn's stop flags before every decoder layer: one forward of a long message or a
    decode step on a busy machine can take seconds, a layer a fraction of that."""
    if lm.model not in _watched:
        for layer in lm.model.get_decoder().layers:
            layer.register_forward_pre_hook(check_stop)
        _watched.add(lm.model)


@contextmanager
def stopping(*flags: threading.Event) -> Iterator[None]:
    """While the block runs, this thread's forwards (and ``check_stop``) stop once any of ``flags`` is set, or
    any flag of a block it runs inside."""
    outer = getattr(_running, "stops", ())
    _running.stops = (*outer, *flags)
    try:
        yield
    finally:
        _running.stops = outer
