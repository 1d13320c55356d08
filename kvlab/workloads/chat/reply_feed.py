"""Where Full's reply stays as it is decoded, and what each cache is still fed of it.

Every policy's cache is fed the turn's reply (Full's greedy reply when the conversation has no golden one), so
that all see the same conversation. A cache that decoded that very reply on itself already holds its tokens:
feeding them again would compute exactly the keys the decoding computed.
"""

from __future__ import annotations

import torch

from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import KVState
from kvlab.policies import Policy


def golden_reply(golden: str, prefill: str) -> str:
    """What a golden reply adds after the reply's ``prefill`` (already fed with the message), if it begins with it."""
    return golden[len(prefill):] if golden.startswith(prefill) else golden


def reply_holders(lm: LoadedModel, states: dict[str, KVState], policies: dict[str, Policy],
                  names: list[str]) -> list[str]:
    """The caches (of ``names``, Full's first) that keep Full's greedy reply as it is decoded.

    Every one while all are still identical to Full's and no policy needs statistics of the reply's queries
    (observation windows, H2O's sums, query means); Full's alone, which decodes on its own cache beside the
    others, once no other is identical to it (one that is shares Full's feed, and its scores stay exactly
    Full's). None on a model with sliding windows: should the reply re-tokenize differently, ``drop_last``
    cannot bring back keys a window dropped.
    """
    if any(lm.facts.layer_windows):
        return []
    rows = [states[n] for n in names]
    plain = [not s.track_accumulated and not policies[n].probe().asks for n, s in zip(names, rows)]
    twins = [rows[0].same_cache(s) for s in rows[1:]]
    if all(plain) and all(twins):
        return list(names)
    return names[:1] if plain[0] and not any(twins) else []


def reply_to_feed(
    states: dict[str, KVState], live: list[str], reply_ids: list[int], own: dict[str, list[int]],
    first_logits: dict[str, torch.Tensor], decoded_logits: torch.Tensor | None, holders: list[str],
) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """Per cache, how many of the reply's tokens it already holds, and the logits that predicted the first
    token it is still fed and those before it (Full's reply: [held + 1, vocab]).

    A reply kept in the ``holders``' caches while it was decoded (``own["full"]``, chosen by ``decoded_logits``)
    needs only its rest fed there; if it re-tokenizes differently, the kept tokens are dropped and the whole
    reply is fed.
    """
    held, before = dict.fromkeys(live, 0), {n: first_logits[n][None] for n in live}  # [1, vocab] each
    if decoded_logits is not None:
        fed = own["full"][: len(decoded_logits) - 1]
        if reply_ids[: len(fed)] == fed and len(reply_ids) > len(fed):  # only the rest needs feeding
            held |= dict.fromkeys(holders, len(fed))
            before |= dict.fromkeys(holders, decoded_logits)
        else:  # the reply re-tokenizes differently: undo and feed it whole
            for name in holders:
                states[name].drop_last(len(fed))
    return held, before
