"""``python -m kvlab check-policy NAME``: the properties every kvlab policy must have, as a pass/fail table.

They run on tiny random models built in code (``kvlab.experiments.conformance``); ``--model embedded`` (or any
model ``--model`` names elsewhere) adds the covering-budget and budget properties on that model. Exit 1 when
a property fails.
"""

from __future__ import annotations

import argparse

from kvlab.cli.options import DEVICE_HELP
from kvlab.engine.model import load_model
from kvlab.errors import KvlabError
from kvlab.experiments.conformance import check_models, check_policy, checks_table
from kvlab.policies import POLICIES, parse_params


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check-policy", help="check that a policy (built-in or plug-in) has every property a "
                                            "kvlab policy must have")
    p.add_argument("name", help="the policy's registry name, e.g. snapkv or a plug-in's name")
    p.add_argument("--policy-file", action="append", default=[], metavar="FILE",
                   help="a Python file of plug-in policies, repeatable")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="a parameter of the policy, repeatable, e.g. --param window=16 (or, as the other commands "
                        "take it, --param POLICY.window=16)")
    p.add_argument("--model", default=None,
                   help="also check on this model: embedded (SmolLM2-135M), gemma3-270m, a hub id or a folder")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print one row per property; exit 1 if any failed."""
    name = args.name.strip().lower()
    for item in args.param:
        key = item.split("=", 1)[0]
        owner = key.split(".", 1)[0].strip().lower()
        if "." in key and owner != name and owner in POLICIES:
            raise KvlabError(f"--param {item} is {owner}'s; check-policy {name} takes {name}'s own parameters")
    own = [item.split(".", 1)[1] if item.lower().startswith(f"{name}.") else item for item in args.param]
    params = parse_params([f"{name}.{item}" for item in own]).get(name, {})
    models = check_models()
    if args.model is not None:
        models["embedded"] = load_model(None if args.model == "embedded" else args.model, device=args.device)
    table = checks_table(check_policy(args.name, params, models))
    print(table.to_string(index=False))
    failed = (table["result"] == "FAIL").sum()
    print(f"{args.name}: {'all properties hold' if not failed else f'{failed} of {len(table)} properties fail'}")
    return 1 if failed else 0
