"""The registry of cache policies: one module per policy, one place that names them.

Adding a policy is one line: its class appended to ``POLICIES``. Plug-ins join at run time
(``kvlab.policies.plugins``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvlab.errors import KvlabError
from kvlab.policies.adakv import AdaKV
from kvlab.policies.base import LayerView, Policy, Wrapper
from kvlab.policies.duoattention import DuoAttention
from kvlab.policies.expected_attention import ExpectedAttention
from kvlab.policies.full import Full
from kvlab.policies.h2o import H2O
from kvlab.policies.keydiff import KeyDiff
from kvlab.policies.kivi import KiviPolicy
from kvlab.policies.knorm import Knorm
from kvlab.policies.kvzip import KVzip
from kvlab.policies.oracle import Oracle
from kvlab.policies.pyramidkv import PyramidKV
from kvlab.policies.quest import Quest
from kvlab.policies.snapkv import SnapKV
from kvlab.policies.streamingllm import StreamingLLM
from kvlab.policies.tova import TOVA
from kvlab.policies.window import Window
from kvlab.registry import Registry

POLICIES: Registry[type[Policy]] = Registry("policy", (
    Full, StreamingLLM, Window, H2O, SnapKV, PyramidKV, TOVA, Knorm, Quest, KiviPolicy, ExpectedAttention, KeyDiff,
    Oracle, AdaKV, DuoAttention, KVzip,
), normalise=lambda name: name.strip().lower())
Wrapper.registry = POLICIES
DEFAULT_COMPARISON = ("full", "streamingllm", "h2o", "snapkv", "pyramidkv")


def policy_params(name: str) -> dict:
    """The adjustable parameters of a policy with their paper defaults."""
    return {f.name: f.default for f in fields(POLICIES[name])}


def make_policy(name: str, **params) -> Policy:
    """Build a policy by registry name; unknown names or parameters are a user error."""
    key = POLICIES.key(name)
    allowed = policy_params(key)
    unknown = set(params) - set(allowed)
    if unknown:
        raise KvlabError(f"{key}: unknown parameter(s) {', '.join(sorted(unknown))}; "
                         f"it takes {', '.join(allowed) or 'none'}")
    return POLICIES[key](**params)


@dataclass(frozen=True)
class ParamSpec:
    """One policy parameter as a widget or the command line offers it."""

    policy: str
    name: str
    kind: str  # "int", "float", "bool" or "choice"
    default: int | float | bool | str
    help: str
    min: float | None = None
    max: float | None = None
    step: float | None = None
    choices: tuple[str, ...] = ()

    def described(self) -> str:
        """Its help with the range its policy accepts ("… — 0 to 1", "… — at least 1"), for a widget's tooltip: the
        widgets set no bounds, which Streamlit would enforce by keeping the last valid value without a word."""
        low, high = self.min, self.max
        said = (f"{low:g} to {high:g}" if low is not None and high is not None else f"at least {low:g}"
                if low is not None else f"at most {high:g}" if high is not None else "")
        return f"{self.help} — {said}" if said else self.help

    def parse(self, text: str) -> int | float | bool | str:
        """A command-line value as this parameter's type (its range is left to the policy's ``check``)."""
        value = text.strip()
        try:
            if self.kind == "bool":
                return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[value.lower()]
            if self.kind == "int":
                return int(value)
            if self.kind == "float":
                return float(value)
        except (KeyError, ValueError):
            expected = {"bool": "true or false", "int": "a whole number", "float": "a number"}[self.kind]
            raise KvlabError(f"{self.policy}.{self.name} must be {expected}, not {text!r}") from None
        return value


def param_specs(name: str) -> list[ParamSpec]:
    """The parameters of a policy with type, default and valid range, read from its dataclass fields."""
    key, specs = POLICIES.key(name), []
    cls = POLICIES[key]
    for f in fields(cls):
        meta, default = f.metadata, f.default
        kind = ("bool" if isinstance(default, bool) else "int" if isinstance(default, int)
                else "float" if isinstance(default, float) else "choice")
        specs.append(ParamSpec(policy=key, name=f.name, kind=kind, default=default, help=meta.get("help", ""),
                               min=meta.get("min"), max=meta.get("max"), step=meta.get("step"),
                               choices=cls.choices(f.name)))
    return specs


def parse_params(items: list[str]) -> dict[str, dict]:
    """``["snapkv.window=16", ...]`` → ``{"snapkv": {"window": 16}}``; bad names and values are user errors."""
    out: dict[str, dict] = {}
    for item in items:
        target, sep, text = item.partition("=")
        policy, dot, name = target.strip().partition(".")
        if not sep or not dot:
            raise KvlabError(f"--param takes policy.name=value, e.g. snapkv.window=16, not {item!r}")
        specs = {s.name: s for s in param_specs(policy)}
        spec = specs.get(name.strip())
        if spec is None:
            takes = ", ".join(specs) or "no parameters"
            raise KvlabError(f"{POLICIES.key(policy)} has no parameter {name.strip()!r}; it takes {takes}")
        if spec.name in out.get(spec.policy, {}):  # the last one would win without a word
            raise KvlabError(f"--param gives {spec.policy}.{spec.name} more than once; give it once")
        out.setdefault(spec.policy, {})[spec.name] = spec.parse(text)
    for policy, params in out.items():  # the range check, before any model work
        make_policy(policy, **params)
    return out


__all__ = ["POLICIES", "DEFAULT_COMPARISON", "LayerView", "ParamSpec", "Policy", "make_policy", "param_specs",
           "parse_params", "policy_params"]
