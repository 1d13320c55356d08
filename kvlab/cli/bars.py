"""The terminal's progress bar: one tqdm bar and the ``Progress`` callback that moves it."""

from __future__ import annotations

from tqdm import tqdm

from kvlab.engine.progress import Progress


def progress_bar(desc: str, total: int, unit: str) -> tuple[tqdm, Progress]:
    """A bar over ``total`` units and the callback that sets it to a share of them, with what runs now."""
    bar = tqdm(total=total, desc=desc, unit=unit)

    def progress(fraction: float, message: str) -> None:
        bar.n = round(fraction * total)
        bar.set_postfix_str(message)
        bar.refresh()

    return bar, progress


class FirstUse:
    """A ``Progress`` whose bar appears only when something reports: a pattern a policy learns from the model
    (DuoAttention's, a minute once per model) shows a bar, one found in the cache shows nothing."""

    def __init__(self, desc: str) -> None:
        self.desc, self.bar = desc, None

    def __call__(self, fraction: float, message: str) -> None:
        if self.bar is None:
            self.bar = tqdm(total=100, desc=self.desc, unit="%")
        self.bar.n = round(100 * fraction)
        self.bar.set_postfix_str(message)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
