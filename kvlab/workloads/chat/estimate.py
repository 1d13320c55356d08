"""How long a chat turn will take, estimated before it runs, so a page can ask first."""

from __future__ import annotations

from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import KVState
from kvlab.engine.timing import clock
from kvlab.errors import KvlabError
from kvlab.policies import make_policy
from kvlab.workloads.chat.positions import check_fits
from kvlab.workloads.chat.settings import ChatSettings

ESTIMATE_FROM_TOKENS = 256  # messages this long get a time estimate before they run
LONG_TURN_S = 20.0  # a turn estimated to take longer asks before it runs
# a reconstruction pass (KVzip) repeats the message in chunks that each attend over all of it, with every softmax
# row kept for the scores: a 3,254-token message's took 17 s on the 2-core CPU, 3.5 times a prefill's
RECONSTRUCTION_PREFILLS = 3


def estimate_turn_s(lm: LoadedModel, settings: ChatSettings, n_tokens: int, fresh: bool) -> float:
    """Rough seconds a turn prefilling ``n_tokens`` takes on this machine now (a 64-token forward and a step, timed).

    ``fresh``: no turn yet, so every cache is still Full's and one prefill serves every policy; a policy that
    reconstructs the context (KVzip) adds ``RECONSTRUCTION_PREFILLS`` of its own.
    Attention grows with length, so long messages take somewhat longer than this.
    """
    probe = KVState(lm, "original")
    ids = [lm.tokenizer.eos_token_id or 0] * 64
    t0 = clock()
    probe.append(ids, logits_to_keep=1)
    t1 = clock()
    probe.append(ids[:1], logits_to_keep=1)
    step = clock() - t1
    prefill_rows = 1 if fresh else len(settings.policies)
    prefill_rows += RECONSTRUCTION_PREFILLS * sum(
        make_policy(name, **settings.params.get(name, {})).needs_reconstruction for name in settings.policies)
    per_token = (t1 - t0) / len(ids)
    # every policy decodes and is fed its reply (evicting policies' caches soon differ from Full's)
    reply = len(settings.policies) * settings.max_new_tokens * (per_token + step)
    return prefill_rows * n_tokens * per_token + reply


def ask_first_s(lm: LoadedModel, settings: ChatSettings, held_tokens: int, message_tokens: int, fresh: bool) -> float:
    """The seconds to ask about before a message of ``message_tokens`` runs after ``held_tokens``: its
    ``estimate_turn_s``, or 0 where there is nothing to ask (a short message, or one the turn refuses at once by
    ``check_fits``, which says why)."""
    if message_tokens < ESTIMATE_FROM_TOKENS:
        return 0.0
    try:
        check_fits(lm, settings.position_mode, held_tokens, message_tokens, settings.max_new_tokens)
    except KvlabError:
        return 0.0
    return estimate_turn_s(lm, settings, message_tokens, fresh)
