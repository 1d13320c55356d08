"""The registry of cache policies: one module per policy, one place that names them."""

from __future__ import annotations

from dataclasses import fields

from kvlab.errors import KvlabError
from kvlab.policies.base import LayerView, Policy
from kvlab.policies.full import Full
from kvlab.policies.h2o import H2O
from kvlab.policies.knorm import Knorm
from kvlab.policies.pyramidkv import PyramidKV
from kvlab.policies.snapkv import SnapKV
from kvlab.policies.streamingllm import StreamingLLM
from kvlab.policies.tova import TOVA
from kvlab.policies.window import Window

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Full, StreamingLLM, Window, H2O, SnapKV, PyramidKV, TOVA, Knorm)
}
DEFAULT_COMPARISON = ("full", "streamingllm", "h2o", "snapkv", "pyramidkv")


def policy_params(name: str) -> dict:
    """The adjustable parameters of a policy with their paper defaults."""
    return {f.name: f.default for f in fields(POLICIES[name])}


def make_policy(name: str, **params) -> Policy:
    """Build a policy by registry name; unknown names or parameters are a user error."""
    key = name.strip().lower()
    if key not in POLICIES:
        raise KvlabError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    allowed = policy_params(key)
    unknown = set(params) - set(allowed)
    if unknown:
        raise KvlabError(f"{key}: unknown parameter(s) {', '.join(sorted(unknown))}; it takes {', '.join(allowed) or 'none'}")
    return POLICIES[key](**params)


__all__ = ["POLICIES", "DEFAULT_COMPARISON", "LayerView", "Policy", "make_policy", "policy_params"]
