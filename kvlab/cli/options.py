"""Options several commands share: the model to load, and the torch threads a timed command runs on."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from kvlab.engine.model import DTYPES
from kvlab.errors import KvlabError
from kvlab.lists import split_items

MAX_RUNS = 50  # timed runs a command may be asked for
MODEL_HELP = "gemma3-270m (embedded), a hub id or a local folder (default: embedded SmolLM2-135M)"
DEVICE_HELP = "auto (the default: cuda, else mps, else cpu), cpu, cuda, cuda:N or mps"
POSITION_HELP = ("original: new tokens continue the text's positions (gaps allowed); rerotated: kept keys are rotated "
                 "to their cache slot and queries sit at the cache length (StreamingLLM's scheme)")
BLOCK_HELP = "tokens per paged block, for the block counts and maps (free, fragmented, full)"


def add_model_options(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    """--model, --device and (where the command takes one) --dtype."""
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    if dtype:
        p.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="auto: float32 on the CPU, bfloat16 (or float16) on a GPU")


Inputs = Sequence[tuple[str | None, str]]  # the files a command reads: (path or None, what it is, in words)


def _not_an_input(out: Path, said: str, inputs: Inputs) -> None:
    """Refuse ``out`` (``said``: how the user named it) where it is one of ``inputs``: a replay or a run must not
    write over a file it reads."""
    for path, what in inputs:
        if path and out.resolve() == Path(path).expanduser().resolve():
            raise KvlabError(f"{said} is {what} itself; write elsewhere")


def out_file(path: str | None, option: str = "--out", inputs: Inputs = ()) -> Path | None:
    """The file an output option names (None: not given), refused before any work where it cannot be written:
    a folder, a file in a folder that does not exist, one this process may not write, or one of the command's
    ``inputs``."""
    if path is None:
        return None
    if not path.strip():  # Path("") is the current folder
        raise KvlabError(f"{option} needs the path of a file, not an empty name")
    out = Path(path).expanduser()
    _not_an_input(out, f"{option} {path}", inputs)
    if out.is_dir():
        raise KvlabError(f"{option} {path} is a folder; give the path of a file")
    if out.parent.exists() and not out.parent.is_dir():
        raise KvlabError(f"{option} {path} lies under {out.parent}, which is a file, not a folder")
    if not out.parent.is_dir():
        raise KvlabError(f"the folder of {option} {path} does not exist ({out.parent})")
    existed = out.exists()
    try:  # the one sure test: open it as the command will at the end (a new file is removed again)
        with out.open("a"):
            pass
    except OSError as exc:
        raise KvlabError(f"{option} {path} cannot be written: {exc.strerror or exc}") from None
    if not existed:
        out.unlink()
    return out


def out_folder(path: str, option: str = "--out", files: tuple[str, ...] = (),
               inputs: Inputs = ()) -> Path:
    """The folder an output option names, checked before the work and made only when its results are written
    (``made``), so a run refused on the way leaves no empty folder; refused where it is a file, where no folder may
    be made there, or where it would write one of ``files`` over one of the command's ``inputs``."""
    if not path.strip():
        raise KvlabError(f"{option} needs the path of a folder, not an empty name")
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise KvlabError(f"{option} must be a folder, but {path} is a file")
    for name in files:
        _not_an_input(out / name, f"{option} {path} would write {name}, which", inputs)
    nearest = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not nearest.is_dir():
        raise KvlabError(f"{option} {path} lies under {nearest}, which is a file, not a folder")
    # the one sure test: make the folder and a file in it as the command will at the end, then take away what this
    # made (os.access says yes to root anywhere, and /proc or /sys refused only after a whole run); on the resolved
    # path, folder by folder, so that "new/../mine" can never take away a folder that was there
    target = out.absolute().resolve()
    made_here: list[Path] = []
    try:
        for folder in [*reversed(target.parents), target]:
            if not folder.exists():
                folder.mkdir()
                made_here.append(folder)
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as exc:
        raise KvlabError(f"cannot create the folder {path} for {option}: {exc.strerror or exc}") from None
    finally:
        for folder in reversed(made_here):
            try:
                folder.rmdir()
            except OSError:  # another run wrote into it meanwhile: it is theirs now
                break
    # as typed where it reads the same (messages name the path the user gave); through "..", resolved, or writing
    # it would make the folders it passes through ("new" of "new/../mine")
    return target if ".." in out.parts else out


def made(out: Path, option: str = "--out") -> Path:
    """``out_folder``'s folder, made now that there are results to write."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvlabError(f"cannot create the folder {out} for {option}: {exc.strerror or exc}") from None
    return out


def comma_list(text: str, option: str) -> tuple[str, ...]:
    """A comma-separated option's items, stripped (a comma at either end is let pass); refused where an item
    between two commas is empty, where one is given twice, or none is given: ``--policies ""`` is a mistake, not a
    request for nothing."""
    parts = split_items(text, option)
    if not parts:
        raise KvlabError(f"{option} is empty; give at least one, comma-separated")
    names = [p.lower() for p in parts]  # names are read case-blind (the registries'), so SnapKV is snapkv
    if twice := sorted({p for p in names if names.count(p) > 1}):  # dropped without a word, one would go unseen
        raise KvlabError(f"{option} names {', '.join(map(repr, twice))} more than once; give each once")
    return parts


def add_threads_option(p: argparse.ArgumentParser) -> None:
    """--threads: the torch CPU threads a timed command runs on."""
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for the run (default: torch's own choice); restored afterwards")


def check_runs(runs: int) -> None:
    """Refuse a --runs outside 1 … ``MAX_RUNS``."""
    if not 1 <= runs <= MAX_RUNS:
        raise KvlabError(f"--runs must be between 1 and {MAX_RUNS}, not {runs}")


def check_threads(threads: int | None) -> None:
    """Refuse a --threads this machine cannot run (before any model loads)."""
    if threads is not None and not 1 <= threads <= (os.cpu_count() or 1):
        raise KvlabError(f"--threads must be between 1 and {os.cpu_count()}, not {threads}")


@contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Run the block on ``threads`` torch threads (None: as they are), then restore the process's setting; yields
    the number the block runs on."""
    default = torch.get_num_threads()
    torch.set_num_threads(threads or default)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(default)
