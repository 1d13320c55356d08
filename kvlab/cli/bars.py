"""The terminal's progress bars: a tqdm bar and the ``Progress`` callback that moves it, a bar counting items until a
Ctrl-C, and a bar shown only once something reports."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tqdm import tqdm

from kvlab.cli.interrupt import stop_on_interrupt
from kvlab.engine.progress import Progress

# a bar of shares shows no rate: "12.40%/s" and "1.50s/%" say nothing a user counts in
SHARE_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]"


def progress_bar(desc: str, total: int, unit: str) -> tuple[tqdm, Progress]:
    """A bar over ``total`` units and the callback that sets it to a share of them, with what runs now."""
    bar = tqdm(total=total, desc=desc, unit=unit, bar_format=SHARE_FORMAT if unit == "%" else None)

    def progress(fraction: float, message: str) -> None:
        bar.n = round(fraction * total)
        bar.set_postfix_str(message)
        bar.refresh()

    return bar, progress


@contextmanager
def counted_until_interrupted(what: str, total: int, desc: str, unit: str) -> Iterator[Callable[[], bool]]:
    """A bar over ``total`` items and the call that counts one done and says whether a Ctrl-C asked to stop there
    (``what`` says where the run stops)."""
    with stop_on_interrupt(what) as cancel, tqdm(total=total, desc=desc, unit=unit) as bar:

        def one_done() -> bool:
            bar.update()  # before a stop: the bar counts the item that just ran, as the message after it does
            return cancel.is_set()

        yield one_done


class FirstUse:
    """A ``Progress`` whose bar appears only when something reports: a pattern a policy learns from the model
    (DuoAttention's, a minute once per model) shows a bar, one found in the cache shows nothing."""

    def __init__(self, desc: str) -> None:
        self.desc, self.bar, self.progress = desc, None, None

    def __call__(self, fraction: float, message: str) -> None:
        if self.bar is None:
            self.bar, self.progress = progress_bar(self.desc, 100, "%")
        self.progress(fraction, message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
