"""Widgets for every parameter of the chosen policies, drawn from ``kvlab.policies.param_specs``."""

from __future__ import annotations

import streamlit as st

from kvlab.policies import ParamSpec, param_specs

# Each field keeps this width and a row wraps to the next line when it is full: the longest label
# (head_compression_ratio) stays whole beside its help icon, two fields fit a row at 900 px with the sidebar
# open and four at 1400 px. Columns would split the row whatever its width, breaking labels mid-word at 900 px.
FIELD_WIDTH = 180


def _widget(spec: ParamSpec, key: str) -> int | float | bool | str:
    label = spec.name
    if spec.kind == "bool":
        return st.checkbox(label, value=spec.default,
                           persist_state="session", key=key, help=spec.help, width=FIELD_WIDTH)
    if spec.kind == "choice":
        return st.selectbox(label, spec.choices, index=spec.choices.index(spec.default),
                            persist_state="session", key=key, help=spec.help,
                            width=FIELD_WIDTH)
    # no min/max: Streamlit would quietly keep the last valid value; the policy refuses a bad one in words
    if spec.kind == "int":
        return int(st.number_input(label, value=spec.default, step=1,
                                   persist_state="session", key=key, help=spec.described(), width=FIELD_WIDTH))
    return float(st.number_input(label, value=spec.default, step=spec.step or 1.0,
                                 persist_state="session", key=key, help=spec.described(),
                                 width=FIELD_WIDTH))


def param_widgets(policies: list[str], prefix: str) -> dict[str, dict]:
    """Per chosen policy that has parameters, its name and then its widgets; returns policy → parameters."""
    out: dict[str, dict] = {}
    for name in policies:
        specs = param_specs(name)
        if not specs:
            continue
        st.markdown(f"**{name}**")
        with st.container(horizontal=True, vertical_alignment="bottom"):  # a checkbox level with the input boxes
            out[name] = {spec.name: _widget(spec, f"{prefix}_{name}_{spec.name}") for spec in specs}
    return out
