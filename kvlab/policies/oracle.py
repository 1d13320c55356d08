"""The oracle: keep what the conversation's later queries will attend to. Not deployable: it reads the future.

No paper's policy; the upper bound of eviction at a budget (issue 20, "headroom"). Before the
conversation runs, Full runs alone over the whole script (``kvlab.engine.future``); at every
eviction the oracle keeps, per layer and KV head, the keys that every later query of the script
(the rest of this turn and all remaining turns, Full's attention averaged over the query group)
attends to most. Only a scripted conversation has that future: a live chat refuses it. A turn
that leaves the script (a single-shot question asked of turn 1's caches) has a future of its own,
its reply's queries: Full runs alone over the conversation so far and that turn first (going on from
where the script's own pass stood after turn 1, ``kvlab.workloads.chat.foresee``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.errors import KvlabError
from kvlab.policies.base import LayerView, Policy

NOT_DEPLOYABLE = "not deployable: it reads what later turns will attend to (scripted conversations only)"


@dataclass
class Oracle(Policy):
    name, label = "oracle", "Oracle (not deployable)"
    summary = f"keeps what later queries attend to most — {NOT_DEPLOYABLE}"
    needs_future = True

    def scores(self, view: LayerView) -> torch.Tensor:
        if view.future is None:
            raise KvlabError(f"oracle: {NOT_DEPLOYABLE}; this cache was given no script")
        return view.future
