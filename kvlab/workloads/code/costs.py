"""Cost accounting for re-prefilling a suffix, from the loaded model's real shapes.

Per token and layer of a Llama-style decoder (SwiGLU MLP), FLOPs = 2 × multiply-adds:

- Q projection ``2·hidden·heads·head_dim``; K and V projections ``2·hidden·kv_heads·head_dim`` each;
  O projection ``2·heads·head_dim·hidden``;
- attention ``4·heads·head_dim·c`` for a query that attends ``c`` keys (scores ``q·k`` and the
  weighted sum of values, 2·heads·head_dim·c each);
- MLP ``3 · 2·hidden·intermediate`` (gate, up, down).

Norms, RoPE, softmax and the LM head are left out (they are the same for every scheme, and small).
A suffix of ``s`` new tokens after a reused prefix of ``p`` tokens: the i-th new token (1-based)
attends ``p + i`` keys, so attention over the suffix sums to ``s·p + s(s+1)/2`` key visits.
Under a sharing scheme, layers that do not produce K/V skip only their K and V projections (and K/V
memory); YOCO's upper half runs for the last token only (it attends ``p + s`` keys).
"""

from __future__ import annotations

import pandas as pd

from kvlab.engine.facts import ModelFacts
from kvlab.sharing.schemes import Scheme, make_scheme

COMPONENTS = ("q_proj", "k_proj", "v_proj", "o_proj", "attention", "mlp")


def token_layer_flops(facts: ModelFacts, context: int) -> dict[str, int]:
    """FLOPs of one token in one layer that attends ``context`` keys (itself included)."""
    q_width = facts.n_heads * facts.head_dim
    kv_width = facts.n_kv_heads * facts.head_dim
    return {
        "q_proj": 2 * facts.hidden_size * q_width,
        "k_proj": 2 * facts.hidden_size * kv_width,
        "v_proj": 2 * facts.hidden_size * kv_width,
        "o_proj": 2 * q_width * facts.hidden_size,
        "attention": 4 * q_width * context,
        "mlp": 3 * 2 * facts.hidden_size * facts.intermediate_size,
    }


def reprefill_flops(facts: ModelFacts, scheme: Scheme, prefix: int, suffix: int) -> dict[str, int]:
    """FLOPs per component for re-prefilling ``suffix`` tokens after ``prefix`` cached ones."""
    if suffix < 1 or prefix < 0:
        raise ValueError("need at least one new token and a non-negative prefix")
    unit = token_layer_flops(facts, 0)
    per_key = 4 * facts.n_heads * facts.head_dim
    all_keys = suffix * prefix + suffix * (suffix + 1) // 2  # key visits of the whole suffix
    total = dict.fromkeys(COMPONENTS, 0)
    for layer in range(scheme.n_layers):
        upper = scheme.upper_start is not None and layer >= scheme.upper_start
        queries, keys = (1, prefix + suffix) if upper else (suffix, all_keys)
        for name in ("q_proj", "o_proj", "mlp"):
            total[name] += queries * unit[name]
        total["attention"] += per_key * keys
        if scheme.produces(layer):  # a producer projects K/V for every new token, even in YOCO's upper half
            total["k_proj"] += suffix * unit["k_proj"]
            total["v_proj"] += suffix * unit["v_proj"]
    return total


def cost_row(facts: ModelFacts, scheme: Scheme, spans: list[tuple[int, int]]) -> dict:
    """One scheme's re-prefill FLOPs summed over ``spans`` of (prefix, suffix), and its K/V bytes.

    K/V bytes: ``kv_bytes_stored`` for the last span's whole text, ``kv_bytes_written`` summed over
    the suffixes.
    """
    flops = dict.fromkeys(COMPONENTS, 0)
    for prefix, suffix in spans:
        for name, value in reprefill_flops(facts, scheme, prefix, suffix).items():
            flops[name] += value
    return {
        "scheme": scheme.label,
        **{f"{name}_flops": value for name, value in flops.items()},
        "total_flops": sum(flops.values()),
        "kv_layers": scheme.kv_layers,
        "kv_bytes_stored": facts.kv_bytes(sum(spans[-1]), layers=scheme.kv_layers),
        "kv_bytes_written": facts.kv_bytes(sum(s for _, s in spans), layers=scheme.kv_layers),
        "claim_share": scheme.claim_share,
    }


def cost_table(facts: ModelFacts, schemes: list[Scheme], spans: list[tuple[int, int]]) -> pd.DataFrame:
    """Rows per scheme (Full first) with FLOPs per component, the compute share of Full, KV bytes.

    ``compute_share`` is the computed re-prefill FLOPs over Full's; ``claim_share`` is the notes'
    O(N_layers / ratio) (K/V-producing layers over all layers), shown next to it.
    """
    if not spans:
        raise ValueError("need at least one (prefix, suffix) span")
    full = cost_row(facts, make_scheme("full", facts.n_layers), spans)
    rows = [full] + [cost_row(facts, s, spans) for s in schemes if s.name != "full"]
    table = pd.DataFrame(rows)
    table["compute_share"] = table["total_flops"] / full["total_flops"]
    table["kv_bytes_share"] = table["kv_bytes_stored"] / full["kv_bytes_stored"]
    return table


def component_shares(table: pd.DataFrame) -> pd.DataFrame:
    """Long table (scheme, component, share of Full's total FLOPs) for a stacked bar chart."""
    full_total = float(table.loc[table["scheme"] == "Full", "total_flops"].iloc[0])
    rows = [
        {"scheme": row["scheme"], "component": name, "share": row[f"{name}_flops"] / full_total}
        for _, row in table.iterrows()
        for name in COMPONENTS
    ]
    return pd.DataFrame(rows)
