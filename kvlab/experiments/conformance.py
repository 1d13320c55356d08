"""The properties every kvlab policy must have, checked on tiny random models (``kvlab check-policy``).

Each property runs the policy through the chat engine (``ChatSession``, Full beside it) over a scripted
three-turn conversation and reads its records and caches:

- with a budget covering the conversation it equals Full (same logits, same replies; a policy that stores
  quantized keeps every token instead, its logits are not Full's by design);
- no layer ever holds more than the policy's layer budget, and the layer budgets total at most the budget
  times the layers (a policy that keeps every token, as Full, has no bound to check; one whose budget spans
  the model, KVzip, holds at most their total over every layer and KV head);
- kept positions are valid: in range, unique and sorted per KV head;
- two runs keep the same positions and give the same replies (deterministic);
- it runs with re-rotated positions and on a sliding-window architecture (Mistral-style, window 64, wider than
  the small budget: the policy chooses among the keys the window holds);
- every turn of the conversation runs (multi-turn);
- the bytes it records equal its cache's: the tensors' slots, and their bytes where stored unquantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import KVState
from kvlab.engine.tiny import byte_tokenizer, tiny_model
from kvlab.errors import KvlabError
from kvlab.policies import POLICIES, Policy, make_policy
from kvlab.policies.base import UNBOUNDED
from kvlab.workloads.chat.conversation import Conversation, Turn
from kvlab.workloads.chat.records import TurnResult
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

CONVERSATION = (  # one token per byte on the tiny models: each turn is longer than the small budget
    "The harbour town has a red lighthouse and a bakery.",
    "My sister Ines lives there with three goats.",
    "What colour is the lighthouse?",
)
SCRIPT = Conversation(name="check-policy", description="the conformance conversation", system=None,
                      turns=tuple(Turn(user=message) for message in CONVERSATION))  # the oracle reads its future
SMALL_BUDGET = 16  # tokens per layer and KV head (or the policy's minimum): every turn evicts
CHECK_WINDOW = 64  # the sliding-window model's: wider than the small budget, so a policy evicts inside the window
CHECK_CONTEXT = 8192  # the tiny models' context: room for a budget covering the conversation in every layer
EXACT_KL = 1e-6  # float32 noise between two caches of the same tokens
REPLY_TOKENS = 3


@dataclass(frozen=True)
class Check:
    """One property's outcome: passed (True/False) and why, in words."""

    prop: str
    passed: bool
    detail: str


@dataclass
class Run:
    """One session of the policies beside Full over the conversation, and why each that stopped stopped."""

    session: ChatSession | None
    turns: list[TurnResult]
    errors: dict[str, str]  # policy name → the error its run stopped with


def check_models() -> dict[str, LoadedModel]:
    """The tiny models the properties run on: a Llama and a sliding-window Mistral, with a byte tokenizer."""
    tokenizer = byte_tokenizer()
    # head_dim 32: KIVI's default group of 32 channels divides it
    return {arch: tiny_model(arch, context=CHECK_CONTEXT, tokenizer=tokenizer, hidden_size=128, **extra)[0]
            for arch, extra in (("llama", {}), ("mistral-window", {"sliding_window": CHECK_WINDOW}))}


def run_policies(lm: LoadedModel, params: dict[str, dict], budgets: dict[str, int],
                 position_mode: str = "original") -> Run:
    """The conversation through every policy of ``params`` side by side with Full, each at its budget.

    A policy that fails on a turn is dropped by the session (its error kept); an error of the whole session
    (refused settings, a turn the engine refuses) stops every policy's run.
    """
    names = list(params)
    try:
        settings = ChatSettings(policies=tuple(names), budget=max(budgets.values()), position_mode=position_mode,
                                max_new_tokens=REPLY_TOKENS, policy_budgets=budgets,
                                params={n: p for n, p in params.items() if p})
        session = ChatSession(lm, settings, script=SCRIPT)
    except KvlabError as exc:
        return Run(None, [], {n: str(exc) for n in names})
    turns: list[TurnResult] = []
    errors: dict[str, str] = {}
    for i, message in enumerate(CONVERSATION, 1):
        try:
            turn = session.run_turn(message)
        except KvlabError as exc:  # refused by the engine (KIVI's group size against the head dimension…)
            return Run(session, turns, {n: errors.get(n, f"turn {i}: {exc}") for n in names})
        turns.append(turn)
        for name in names:
            if (error := turn.policies[name].error) and name not in errors:
                errors[name] = f"turn {i}: {error}"
    return Run(session, turns, errors)


def _failed(prop: str, run: Run, name: str) -> Check | None:
    return Check(prop, False, f"it failed ({run.errors[name]})") if name in run.errors else None


def equals_full(run: Run, name: str) -> Check:
    """With a budget as large as the model's context (``run``), the policy's records equal Full's."""
    prop = "a budget covering the conversation equals Full"
    if failed := _failed(prop, run, name):
        return failed
    policy, total = run.session.policies[name], run.turns[-1].total_tokens
    least = min(run.session.budget[name].layers)
    if least < total:
        return Check(prop, False, f"its smallest layer budget at the model's context ({least}) is below the "
                                  f"conversation's {total} tokens")
    quantizer = policy.quantizer()
    for turn in run.turns:
        rec, full = turn.policies[name], turn.policies["full"]
        if rec.retained != full.retained:
            return Check(prop, False, f"turn {turn.index + 1}: it dropped tokens Full keeps")
        if quantizer is not None and quantizer.active:
            continue
        if rec.kl > EXACT_KL or rec.top1 < 1.0 or rec.reply != full.reply:
            return Check(prop, False, f"turn {turn.index + 1}: KL {rec.kl:.2e} to Full, top-1 agreement "
                                      f"{rec.top1:.2f}, reply {'equal' if rec.reply == full.reply else 'differs'}")
    if quantizer is not None and quantizer.active:
        return Check(prop, True, f"{len(run.turns)} turns, {total} tokens: every token kept (it stores quantized: "
                                 "its logits are not Full's by design)")
    return Check(prop, True, f"{len(run.turns)} turns, {total} tokens: KL ≤ {EXACT_KL:g}, same replies")


def within_budget(run: Run, name: str, budget: int, prop: str = "the budget is never exceeded") -> Check:
    """Every turn's layers hold at most their layer budgets, which total at most ``budget`` × layers."""
    if failed := _failed(prop, run, name):
        return failed
    layer_budgets, policy = run.session.budget[name].layers, run.session.policies[name]
    if min(layer_budgets) >= UNBOUNDED:
        return heads_within(run, name, policy, prop)
    bound = budget * len(layer_budgets)
    if sum(layer_budgets) > bound:
        return Check(prop, False, f"its layer budgets total {sum(layer_budgets)} slots, above {budget} × "
                                  f"{len(layer_budgets)} layers = {bound}")
    if policy.model_budget:  # one budget over every layer and head (KVzip): the model's total is the bound
        bound_keys = sum(layer_budgets) * len(run.turns[0].policies[name].retained[0]) if run.turns else 0
        for turn in run.turns:
            held = sum(len(head) for heads in turn.policies[name].retained for head in heads)
            if held > bound_keys:
                return Check(prop, False, f"turn {turn.index + 1}: its layers hold {held} keys over all heads, its "
                                          f"budget is {bound_keys}")
        return Check(prop, True, f"{len(run.turns)} turns at budget {budget}: at most {bound_keys} keys over every "
                                 "layer and KV head (one budget for the model)")
    shared = policy.shared_budget  # budget × kv_heads over a layer's heads, else per head
    for turn in run.turns:
        held = [sum(map(len, heads)) / len(heads) if shared else max(map(len, heads))
                for heads in turn.policies[name].retained]  # keys per KV head, or the fullest head's
        # no eviction while the conversation fits the budget: then every layer may hold all of it (PyramidKV's top)
        whole = turn.total_tokens if turn.total_tokens <= budget else 0
        over = [(layer, n, b) for layer, (n, b) in enumerate(zip(held, layer_budgets)) if n > max(b, whole)]
        if over:
            layer, n, b = over[0]
            return Check(prop, False, f"turn {turn.index + 1}: layer {layer} holds {n} tokens, its budget is {b}")
    return Check(prop, True, f"{len(run.turns)} turns at budget {budget}: at most {max(layer_budgets)} per layer")


def heads_within(run: Run, name: str, policy: Policy, prop: str) -> Check:
    """No layer budget bounds the policy: every KV head holds at most its own ``head_budgets`` (DuoAttention's
    streaming heads), if it has any below ``UNBOUNDED``."""
    layer_budgets = run.session.budget[name].layers
    caps = [policy.head_budgets(layer, b, run.session.lm.facts.n_kv_heads) for layer, b in enumerate(layer_budgets)]
    bounded = [c for heads in caps for c in heads if c < UNBOUNDED]
    if not bounded:
        return Check(prop, True, "it keeps every token (no budget to exceed, as Full)")
    for turn in run.turns:
        for layer, heads in enumerate(turn.policies[name].retained):
            over = [(h, len(kept), cap) for h, (kept, cap) in enumerate(zip(heads, caps[layer])) if len(kept) > cap]
            if over:
                head, n, cap = over[0]
                return Check(prop, False, f"turn {turn.index + 1}: layer {layer}, KV head {head} holds {n} tokens, "
                                          f"its budget is {cap}")
    return Check(prop, True, f"{len(run.turns)} turns: no layer budget bounds it; {len(bounded)} heads within their "
                             f"own {min(bounded)}…{max(bounded)}")


def valid_positions(run: Run, name: str) -> Check:
    """Every kept position is in range, and each KV head's are unique and sorted."""
    prop = "kept positions are valid (in range, unique, sorted)"
    if failed := _failed(prop, run, name):
        return failed
    for turn in run.turns:
        for layer, heads in enumerate(turn.policies[name].retained):
            for head, kept in enumerate(heads):
                if any(p < 0 or p >= turn.total_tokens for p in kept):
                    return Check(prop, False, f"turn {turn.index + 1}, layer {layer}, head {head}: a position "
                                              f"outside 0…{turn.total_tokens - 1}")
                if any(a >= b for a, b in zip(kept, kept[1:])):
                    return Check(prop, False, f"turn {turn.index + 1}, layer {layer}, head {head}: positions "
                                              "repeated or out of order")
    return Check(prop, True, f"{len(run.turns)} turns, every layer and KV head")


def deterministic(first: Run, second: Run, name: str) -> Check:
    """Two fresh runs keep the same positions and give the same replies."""
    prop = "deterministic (two runs equal)"
    if failed := _failed(prop, first, name) or _failed(prop, second, name):
        return failed
    for a, b in zip(first.turns, second.turns):
        ra, rb = a.policies[name], b.policies[name]
        if ra.retained != rb.retained:
            return Check(prop, False, f"turn {a.index + 1}: the second run kept other positions")
        if ra.reply != rb.reply:
            return Check(prop, False, f"turn {a.index + 1}: the second run replied otherwise")
    return Check(prop, True, f"{len(first.turns)} turns: same positions kept, same replies")


def runs(run: Run, name: str, prop: str, what: str) -> Check:
    """The run finished every turn."""
    return _failed(prop, run, name) or Check(prop, True, f"{len(run.turns)} turns {what}")


def _tensor_bytes(state: KVState) -> int:
    """Bytes of the K/V tensors' real keys: a head's left padding (uneven heads, AdaKV) is layout, not held."""
    total = 0
    for layer in state.layers:
        real, slots = int(layer.real.sum()), layer.real.numel()  # [kv_heads, slots]
        total += sum(t.nelement() // slots * real * t.element_size() for t in (layer.keys, layer.values))
    return total


def bytes_match(run: Run, name: str) -> Check:
    """The bytes recorded are the cache's: its tensors' slots per layer, and their bytes where unquantized."""
    prop = "bytes held match the cache tensors"
    if failed := _failed(prop, run, name):
        return failed
    state, rec = run.session.states[name], run.turns[-1].policies[name]
    f = run.session.lm.facts
    slots = [layer.keys.shape[-2] for layer in state.layers]
    held = [sum(heads) / len(heads) for heads in state.head_lengths()]  # keys per KV head (heads may differ)
    if slots != [layer.values.shape[-2] for layer in state.layers] or held != rec.cache_tokens:
        return Check(prop, False, f"the record says {rec.cache_tokens} keys per layer and KV head, the tensors "
                                  f"hold {held}")
    if rec.kv_bytes != state.kv_bytes():
        return Check(prop, False, f"the record says {rec.kv_bytes} bytes, the cache {state.kv_bytes()}")
    metadata = sum(state.reads.metadata_bytes(n, f) for n in slots) if state.reads is not None else 0
    stored = _tensor_bytes(state)
    if state.quant is not None and state.quant.active:
        if rec.kv_bytes - metadata > stored:
            return Check(prop, False, f"quantized, it claims {rec.kv_bytes - metadata} bytes, more than the "
                                      f"{stored} its tensors take at full precision")
        return Check(prop, True, f"{sum(held):g} slots; {rec.kv_bytes} bytes packed ≤ {stored} at full precision")
    if rec.kv_bytes - metadata != stored:
        return Check(prop, False, f"it records {rec.kv_bytes - metadata} bytes of K/V, its tensors take {stored}")
    return Check(prop, True, f"{sum(held):g} slots, {stored} bytes" + (f" + {metadata} of page metadata"
                                                                       if metadata else ""))


def check_policies(params: dict[str, dict], models: dict[str, LoadedModel] | None = None
                   ) -> dict[str, list[Check]]:
    """Every property of each policy of ``params`` (name → parameters; built-in or plug-in), run side by side.

    ``models`` default to ``check_models()``; an ``"embedded"`` entry (any loaded model) adds the covering-budget
    and budget properties on it. A bad name or parameter is a ``KvlabError`` before anything runs.
    """
    params = {POLICIES.key(name): p for name, p in params.items()}
    # each at the small budget or its minimum (Quest's page budget): every turn evicts
    small = {name: max(SMALL_BUDGET, make_policy(name, **p).min_budget()) for name, p in params.items()}
    models = models or check_models()
    llama, window = models["llama"], models["mistral-window"]
    covering = run_policies(llama, params, {name: llama.facts.context_length for name in params})
    first = run_policies(llama, params, small)
    second = run_policies(llama, params, small)
    rerotated = run_policies(llama, params, small, "rerotated")
    on_window = run_policies(window, params, small)
    embedded = models.get("embedded")
    if embedded is not None:
        embedded_covering = run_policies(embedded, params, {name: embedded.facts.context_length for name in params})
        embedded_small = run_policies(embedded, params, small)
    out = {}
    for name in params:
        out[name] = [
            equals_full(covering, name),
            within_budget(first, name, small[name]),
            valid_positions(first, name),
            deterministic(first, second, name),
            runs(rerotated, name, "re-rotated positions run", "with keys re-rotated to their slots"),
            within_budget(on_window, name, small[name], "a sliding-window architecture runs, within its budget"),
            runs(first, name, "multi-turn runs", "of a conversation, cache carried over"),
            bytes_match(first, name),
        ]
        if embedded is not None:
            out[name] += [_on(equals_full(embedded_covering, name), embedded),
                          _on(within_budget(embedded_small, name, small[name]), embedded)]
    return out


def check_policy(name: str, params: dict | None = None, models: dict[str, LoadedModel] | None = None
                 ) -> list[Check]:
    """Every property of one policy at ``params`` (see ``check_policies``)."""
    return check_policies({name: params or {}}, models)[POLICIES.key(name)]


def _on(check: Check, lm: LoadedModel) -> Check:
    return Check(f"{check.prop} ({lm.facts.name})", check.passed, check.detail)


def checks_table(checks: list[Check]) -> pd.DataFrame:
    """One row per property: its name, PASS or FAIL, and why."""
    return pd.DataFrame({"property": [c.prop for c in checks], "result": ["PASS" if c.passed else "FAIL"
                                                                          for c in checks],
                         "detail": [c.detail for c in checks]})
