"""Plug-in policies in the app: the files of ``KVLAB_POLICY_PATH`` and installed entry points, read at start.

Code is never uploaded through the browser: a plug-in is a file on the machine the app runs on.
"""

from __future__ import annotations

import streamlit as st

from kvlab.policies import POLICIES
from kvlab.policies.plugins import env_policy_files, load_plugins

# the policy pickers' help: where one's own policy comes from (nowhere in the browser)
PLUGIN_HELP = ("Your own policy joins this list as a plug-in: a Python file on the machine the app runs on, named "
               "by `KVLAB_POLICY_PATH` when the app starts (`KVLAB_POLICY_PATH=examples/plugin_policy.py make run`; "
               "the README's *Writing a plug-in policy*). Code is never uploaded through the browser.")


def register_plugins() -> None:
    """Register the plug-in policies (each source is read once per process); every refusal is a warning."""
    for refusal in load_plugins(env_policy_files()):
        st.warning(refusal)


def policy_option(name: str, label: str | None = None) -> str:
    """A policy as the pickers show it: its name (or ``label``, where a page shows labels), marked where it is a
    plug-in; a name that is no policy (a page's baseline) is shown as it is."""
    shown = label or name
    return f"{shown} (plug-in)" if name in POLICIES and POLICIES[name].plugin else shown
