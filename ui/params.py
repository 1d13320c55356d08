"""Widgets for every parameter of the chosen policies, drawn from ``kvlab.policies.param_specs``."""

from __future__ import annotations

import streamlit as st

from kvlab.policies import ParamSpec, param_specs


def _widget(spec: ParamSpec, key: str) -> int | float | bool | str:
    label = spec.name
    if spec.kind == "bool":
        return st.checkbox(label, value=spec.default, key=key, help=spec.help)
    if spec.kind == "choice":
        return st.selectbox(label, spec.choices, index=spec.choices.index(spec.default), key=key, help=spec.help)
    # no min/max: Streamlit would quietly keep the last valid value; the policy refuses a bad one in words
    if spec.kind == "int":
        return int(st.number_input(label, value=spec.default, step=1, key=key, help=spec.help))
    return float(st.number_input(label, value=spec.default, step=spec.step or 1.0, key=key, help=spec.help))


def param_widgets(policies: list[str], prefix: str) -> dict[str, dict]:
    """One row of widgets per chosen policy that has parameters; returns policy → parameters."""
    out: dict[str, dict] = {}
    for name in policies:
        specs = param_specs(name)
        if not specs:
            continue
        label, *cols = st.columns([1, *([1] * len(specs))])
        label.markdown(f"**{name}**")
        values = {}
        for spec, col in zip(specs, cols):
            with col:
                values[spec.name] = _widget(spec, f"{prefix}_{name}_{spec.name}")
        out[name] = values
    return out
