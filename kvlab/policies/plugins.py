"""Plug-in policies: ``Policy`` classes from installed packages (entry-point group ``kvlab.policies``) and from files.

A plug-in joins ``POLICIES`` beside the built-in policies, marked by ``plugin`` (where it came from). One that
fails to import, takes a registered name or breaks the contract (``contract_breach``) is refused in one
sentence naming its file; nothing of it is registered and the rest of kvlab works on. Each source is read
once per process: asking again (a page rerun, a second command in a test) returns what the first read found.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import sys
from pathlib import Path

from kvlab.errors import KvlabError
from kvlab.policies import POLICIES
from kvlab.policies.base import Policy

GROUP = "kvlab.policies"  # the entry-point group installed packages declare their policies in
PATH_VARIABLE = "KVLAB_POLICY_PATH"  # plug-in files for the app (and the CLI), os.pathsep-separated
_NAME = re.compile(r"[a-z][a-z0-9_]*")  # usable in --policies lists and --param policy.name=value
_PARAM_TYPES = (bool, int, float, str)

_read: dict[str, str | None] = {}  # source → its refusal, or None when its policies were registered


def env_policy_files() -> list[str]:
    """The plug-in files ``KVLAB_POLICY_PATH`` names (empty entries skipped)."""
    return [part for part in os.environ.get(PATH_VARIABLE, "").split(os.pathsep) if part.strip()]


def contract_breach(cls: object) -> str | None:
    """Why ``cls`` is not a kvlab policy (None: it is one).

    A policy subclasses ``Policy`` as a dataclass, has a lower-case ``name`` and a ``summary``, overrides
    ``scores`` when it evicts, declares every parameter with ``param()`` (a help text and a default of type
    bool, int, float or str) and can be built with its defaults.
    """
    what = getattr(cls, "__name__", repr(cls))
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        return f"{what} is not a subclass of kvlab.policies.base.Policy"
    if "__dataclass_fields__" not in cls.__dict__:
        return f"{what} is not a dataclass (decorate it with @dataclass)"
    if not isinstance(cls.name, str) or not _NAME.fullmatch(cls.name):
        return f"{what} has no name of lower-case letters, digits and _ (it has {cls.name!r})"
    if not isinstance(cls.summary, str) or not cls.summary.strip():
        return f"{what} has no summary"
    if cls.evicts and cls.scores is Policy.scores:
        return f"{what} evicts but does not override scores()"
    for f in dataclasses.fields(cls):
        if not f.metadata.get("help"):
            return f"{what}.{f.name} is not declared with param(default, help)"
        if not isinstance(f.default, _PARAM_TYPES):
            return f"{what}.{f.name} has no default of type bool, int, float or str"
    try:
        cls()
    except Exception as exc:  # a plug-in's own code: any failure is a refusal, never a crash
        return f"{what}() with its defaults fails ({type(exc).__name__}: {exc})"
    return None


def _register(classes: list[type[Policy]], origin: str) -> None:
    """Check every class, then register all of them or none (a ``KvlabError`` says why not)."""
    for cls in classes:
        if breach := contract_breach(cls):
            raise KvlabError(breach)
        if cls.name in POLICIES:
            taken = POLICIES[cls.name]
            by = f"the plug-in from {taken.plugin}" if taken.plugin else f"kvlab's {taken.label}"
            raise KvlabError(f"its policy name {cls.name!r} is taken by {by}")
    names = [cls.name for cls in classes]
    if len(set(names)) < len(names):
        raise KvlabError(f"it names two policies alike ({', '.join(names)})")
    for cls in classes:
        cls.plugin = origin
        POLICIES.add(cls)


def _file_classes(path: Path) -> list[type[Policy]]:
    """The policy classes a plug-in file defines (imported under a name of its own)."""
    module_name = "kvlab_plugin_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise KvlabError("it is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look the module up while the file runs
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # a plug-in's own code: any failure (even an exit) is a refusal
        del sys.modules[module_name]
        raise KvlabError(f"it fails to import ({type(exc).__name__}: {exc})") from None
    own = [obj for obj in vars(module).values() if isinstance(obj, type) and obj.__module__ == module_name]
    if strays := [c for c in own if not issubclass(c, Policy) and hasattr(c, "scores")]:
        raise KvlabError(contract_breach(strays[0]))
    classes = [c for c in own if issubclass(c, Policy)]
    if not classes:
        raise KvlabError("it defines no subclass of kvlab.policies.base.Policy")
    return classes


def load_file(file: str | Path) -> str | None:
    """Register the policies of one plug-in file; returns the refusal sentence, or None."""
    path = Path(file).expanduser().resolve()
    key = str(path)
    if key not in _read:
        try:
            if not path.is_file():
                raise KvlabError("there is no such file")
            _register(_file_classes(path), key)
            _read[key] = None
        except KvlabError as exc:
            _read[key] = f"kvlab refused the plug-in policy file {path}: {exc}."
    return _read[key]


def _entry_point_file(ep: importlib.metadata.EntryPoint) -> str:
    """The file an entry point's module lives in, or the entry point itself where it cannot be found."""
    try:
        spec = importlib.util.find_spec(ep.module)
    except (ImportError, ValueError):
        spec = None
    return spec.origin if spec is not None and spec.origin else f"{ep.module} (not found)"


def load_entry_point(ep: importlib.metadata.EntryPoint) -> str | None:
    """Register the policy an installed package's entry point names; returns the refusal sentence, or None."""
    dist = ep.dist.name if ep.dist is not None else "an installed package"
    key = f"{dist}: {ep.name} = {ep.value}"
    if key not in _read:
        where = f"the plug-in policy {ep.name} = {ep.value} of {dist} ({_entry_point_file(ep)})"
        try:
            try:
                cls = ep.load()
            except (Exception, SystemExit) as exc:  # a plug-in's own code: any failure is a refusal
                raise KvlabError(f"it fails to import ({type(exc).__name__}: {exc})") from None
            if breach := contract_breach(cls):
                raise KvlabError(breach)
            _register([cls], f"{dist} ({inspect.getsourcefile(cls) or ep.value})")
            _read[key] = None
        except KvlabError as exc:
            _read[key] = f"kvlab refused {where}: {exc}."
    return _read[key]


def refuse_on_workers(names: tuple[str, ...] | list[str]) -> None:
    """Refuse plug-in policies for a run on Ray workers: they import kvlab afresh, without the plug-ins."""
    if plugins := [name for name in names if POLICIES[name].plugin]:
        raise KvlabError(f"plug-in policies ({', '.join(plugins)}) run in this process only; "
                         "run the grid here, not on Ray workers")


def unregister_plugins() -> None:
    """Remove every plug-in policy and forget the sources read, so the next ``load_plugins`` reads them afresh."""
    for name in [name for name, policy in POLICIES.items() if policy.plugin]:
        POLICIES.remove(name)
    _read.clear()


def load_plugins(files: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Register every installed package's plug-in policies and those of ``files``; returns the refusals."""
    refusals = [load_entry_point(ep) for ep in importlib.metadata.entry_points(group=GROUP)]
    refusals += [load_file(file) for file in files]
    return [r for r in refusals if r is not None]
