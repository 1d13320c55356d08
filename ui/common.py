"""The one loaded model per process, the sidebar that picks it, and small page helpers."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pandas as pd
import streamlit as st

from kvlab.engine.conversion import EMBEDDED_MODELS
from kvlab.engine.facts import LoadedModel, rope_summary, softcap_summary, window_summary
from kvlab.engine.model import cached_models, load_model
from kvlab.engine.progress import Progress, with_time_left
from kvlab.errors import KvlabError
from kvlab.files import MB
from kvlab.saved import MAX_RECORD_BYTES, ReplayCheck
from ui.figures import start_page

# One model per process, shared by every browser session (forward passes hold ``model.lock``).
# A plain dict rather than st.cache_resource: the load draws a progress bar, and elements drawn
# inside a cached function are replayed on every later hit, into containers that no longer exist.
_MODELS: dict[tuple, LoadedModel] = {}
_LOADING = threading.Lock()
_KEEP = 2
_LOADED = "model_loaded"  # session state: the key of the model this session last loaded
_MARKDOWN = re.compile(r"([\\`*_{}\[\]<>#|~$])")  # what markdown would read as emphasis, code, links or math
PICKER = ("model_source", "model_cached", "model_id", "model_device", "model_dtype", "model_trust")  # its widgets


def cached_model(name: str, device: str, dtype: str, trust_remote_code: bool, progress: Progress) -> LoadedModel:
    """The model the pages share, loaded once per (name, device, dtype, trust_remote_code) in this process."""
    key = (name, device, dtype, trust_remote_code)
    with _LOADING:
        if key not in _MODELS:
            _MODELS[key] = load_model(name, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                                      progress=progress)
            while len(_MODELS) > _KEEP:
                _MODELS.pop(next(iter(_MODELS)))
        return _MODELS[key]


def progress_in(container) -> Progress:
    """A progress callback that draws its bar only once it is first called (not on a cache hit); its text ends
    with the time left."""
    bar = None

    def progress(frac: float, text: str) -> None:
        nonlocal bar
        if bar is None:
            bar = container.progress(0.0, text=text)
        bar.progress(min(max(frac, 0.0), 1.0), text=text)

    return with_time_left(progress)


def page_bar(text: str = "starting", container=st) -> Progress:
    """A progress bar drawn in ``container`` now (a placeholder, to clear it after), as ``progress_in``'s."""
    progress = progress_in(container)
    progress(0.0, text)
    return progress


def as_written(text: str) -> str:
    """``text`` (a file's, a model's or a user's) with the characters markdown reads as emphasis, code, links, math
    or HTML escaped for ``st.markdown`` (Streamlit's ``:icon:`` shortcodes still render)."""
    return _MARKDOWN.sub(r"\\\1", text)


@contextmanager
def marked_while_running(key: str, value: object = True) -> Iterator[None]:
    """``key`` set to ``value`` in the session state while the work inside runs, so that the next run can tell the
    work was cut short: it goes when the work ends or fails, and stays when a click runs the page again, which stops
    the script inside it (Streamlit's control exceptions are not ``Exception``s)."""
    st.session_state[key] = value
    try:
        yield
    except Exception:
        st.session_state.pop(key, None)
        raise
    st.session_state.pop(key, None)


def said_refusal(check: Callable[[], None]) -> str | None:
    """What ``check`` refuses, said as an error under the widgets it checks (None: it passed), so that the button
    it guards can be disabled at once rather than refuse after a click."""
    try:
        check()
    except KvlabError as exc:
        st.error(str(exc))
        return str(exc)
    return None


def say_cut_short(what: str, asked: bool, lost: str, again: str) -> None:
    """Say once that ``what`` (marked by ``marked_while_running``) stopped before it finished, why, what of it is
    ``lost`` and what to do ``again``: as information when Stop asked for it, as a warning when a click did."""
    why = ", as asked" if asked else ": another click or a page change ran the page again while it ran"
    (st.info if asked else st.warning)(f"{what} stopped before it finished{why}, so {lost}. {again}")


def say_replay(check: ReplayCheck, then: str = "") -> None:
    """A replay's check against its file: identical (and ``then``, what the page does next), or where it differs."""
    if check.identical:
        st.success(f"**{check.headline()}**. {then}".strip())
    else:
        st.warning(f"**{check.headline()}**:\n\n" + "\n".join(f"- {line}" for line in check.found))


def stop_button(key: str, flag: str, help: str, where=st) -> None:
    """Stop for the long work this run starts, drawn in ``where``: its click runs the page again, which ends the work
    at its next write to the page (the work in progress finishes first), and sets ``flag`` in the session state so
    that the next run can say the stop was asked."""
    where.button("Stop", key=key, icon=":material/stop_circle:", help=help, on_click=st.session_state.__setitem__,
                 args=(flag, True))


def page_start(title: str, caption: str) -> LoadedModel:
    """A page's top: the sidebar model picker, its title and caption; the page stops without a model."""
    start_page()  # record this run's figures for the page's download-all button
    lm = model_sidebar()
    st.title(title)
    st.caption(caption)
    if lm is None:
        st.stop()
    return lm


def _kept(sb) -> LoadedModel | None:
    """The model this session had before the picker changed (None if none), said in the sidebar."""
    model = _MODELS.get(st.session_state.get(_LOADED))
    if model is not None:
        sb.warning(f"Still on **{model.facts.name}**, the model this session had: the page keeps its work.")
    return model


@st.cache_data(ttl=60, show_spinner=False)
def _cached_models() -> list[str]:
    """The models in the local Hugging Face cache, scanned at most once a minute (the scan reads every file)."""
    return cached_models()


def _use_cached() -> None:
    """The cached model picked goes into the id field, which stays free to edit."""
    st.session_state["model_id"] = st.session_state["model_cached"]


def model_sidebar() -> LoadedModel | None:
    """Sidebar model picker; returns the shared model, or None with an error shown if it failed.

    A model that fails to load leaves the session on the model it had (said under the error), so the page
    stays as it was instead of going blank until the picker is switched back.
    """
    sb = st.sidebar
    # Every page draws its own picker, a widget of its own to Streamlit (its id holds the page), which drops a
    # widget's value when its page is left, persist_state or not (that keeps a value for the same page's widget
    # only); a value written through the session state is the user's and stays, so the choice follows them.
    for key in PICKER:
        if key in st.session_state:
            st.session_state[key] = st.session_state[key]
    sb.subheader("Model")
    embedded = {m.label: m.name for m in EMBEDDED_MODELS.values()}
    source = sb.radio("Source", [*embedded, "Hub id or local folder"], key="model_source")
    name = embedded.get(source)
    if name is None:
        cached = _cached_models()
        if cached:
            sb.selectbox(f"In your Hugging Face cache ({len(cached)})", cached, index=None, key="model_cached",
                         on_change=_use_cached, placeholder="pick a model already downloaded",
                         help="Hub models found in the local Hugging Face cache: one picked goes into the field "
                              "below, where any other id or folder may be typed.")
        else:
            sb.caption("No models in the local Hugging Face cache yet: type a hub id (downloaded when the hub "
                       "can be reached) or a local folder.")
        name = sb.text_input("Model id or folder", key="model_id", placeholder="Qwen/Qwen2.5-0.5B-Instruct").strip()
    device = sb.selectbox("Device", ["auto", "cpu", "cuda", "mps"], key="model_device")
    dtype = sb.selectbox("dtype", ["auto", "float32", "bfloat16", "float16"], key="model_dtype")
    trust = sb.checkbox("trust_remote_code", value=False, key="model_trust")
    if not name:
        sb.info("Enter a model id or folder, or pick the embedded model.")
        return _kept(sb)
    slot = sb.empty()
    key = (name, device, dtype, trust)
    try:
        model = cached_model(*key, progress_in(slot))
    except KvlabError as exc:
        slot.error(str(exc))
        model = _kept(sb)
        if model is None:
            return None
    else:
        slot.empty()
        st.session_state[_LOADED] = key
    facts = model.facts
    sb.table(  # a static table wraps its long values (the RoPE layout) in the narrow sidebar
        pd.DataFrame(
            {
                "fact": ["layers", "heads", "KV heads", "head_dim", "rope θ", "RoPE layout", "sliding layers",
                         "soft-cap", "context", "dtype", "device", "KV bytes/token"],
                "value": [facts.n_layers, facts.n_heads, facts.n_kv_heads, facts.head_dim,
                          facts.rope_theta if facts.has_rope else "no RoPE", rope_summary(facts),
                          window_summary(facts), softcap_summary(facts), facts.context_length, facts.dtype,
                          facts.device, facts.kv_bytes_per_token],
            }
        ).astype({"value": str}),
        hide_index=True,
        hide_header=True,
        border="horizontal",
    )
    return model


def new_upload(label: str, key: str) -> bytes | None:
    """A JSON file picker that hands each uploaded file over once: its bytes on the run it arrives, else None
    (a rerun, a widget elsewhere on the page, must not open it again)."""
    files = new_files(label, key, ["json"], multiple=False, max_mb=MAX_RECORD_BYTES // MB)
    return files[0][1] if files else None


def new_files(label: str, key: str, types: list[str], multiple: bool = True,
              help: str | None = None, max_mb: int | None = None) -> list[tuple[str, bytes]] | None:
    """A file picker (one file, or several at once) that hands each upload over once, as (name, bytes) pairs;
    None on a rerun with the same files, or with none (the session keeps what the last upload gave it).
    ``max_mb``: the largest file it takes, where that is below the server's ``maxUploadSize``."""
    picked = st.file_uploader(label, type=types, key=key, accept_multiple_files=multiple, help=help,
                              max_upload_size=max_mb)
    uploads = picked if isinstance(picked, list) else [] if picked is None else [picked]
    ids = tuple(upload.file_id for upload in uploads)
    if not uploads or ids == st.session_state.get(f"{key}_file"):
        return None
    st.session_state[f"{key}_file"] = ids
    return [(upload.name, upload.getvalue()) for upload in uploads]
