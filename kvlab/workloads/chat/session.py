"""The multi-turn engine: several policies side by side over one conversation, turn by turn.

Semantics follow SCBench's multi-turn mode: every policy's cache carries over between turns and
is compressed after the user message's prefill and again after the reply. All policies see the
same token stream (the golden reply when the conversation has one, else Full's greedy reply),
so their next-token distributions can be compared position by position with Full's.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

import torch

from kvlab.engine.attention import Probe
from kvlab.engine.batched import append_together
from kvlab.engine.batched_decode import generate_batched, generate_keeping
from kvlab.engine.chatformat import ChatFormat, chat_format
from kvlab.engine.facts import LoadedModel
from kvlab.engine.future import FutureAttention
from kvlab.engine.kvstate import KVState, host_lists
from kvlab.engine.reconstruction import reconstruct
from kvlab.engine.timing import clock
from kvlab.errors import KvlabError
from kvlab.policies import Policy
from kvlab.policies.evict import evict
from kvlab.workloads.chat.budgets import budget_now
from kvlab.workloads.chat.conversation import Conversation, Turn
from kvlab.workloads.chat.foresee import foresee
from kvlab.workloads.chat.metrics import check_metric, score_reply
from kvlab.workloads.chat.positions import check_fits, first_positions, mark_past, reach_next, reach_replies
from kvlab.workloads.chat.records import COSTS, PolicyTurn, TurnResult
from kvlab.workloads.chat.reply_feed import golden_reply, reply_holders, reply_to_feed
from kvlab.workloads.chat.scoring import ReplyScores, record_cache, sink_mass
from kvlab.workloads.chat.settings import ChatSettings, model_policies
from kvlab.workloads.chat.stop import check_stop, stopping, watch_layers

MAX_MESSAGE_CHARS = 400_000  # a workload's shared context (SCBench, RULER) fills the model's context; tokens decide
OnToken = Callable[[str, str], None]  # (policy name, reply text so far)
OnPhase = Callable[[str], None]  # what the turn does next, between its phases


class ChatSession:
    """A conversation in progress: one KV state per policy, advanced one turn at a time."""

    def __init__(self, lm: LoadedModel, settings: ChatSettings, system: str | None = None,
                 script: Conversation | None = None, script_future: FutureAttention | None = None) -> None:
        """``script``: the turns this session will be asked, in order, where they are known in advance;
        a policy that reads the future (the oracle) needs it and is refused without one. ``script_future``: Full's
        pass over that very script, run by another session with the same model and settings but its budget (the
        arena's cells of one workload), so this one does not run it again; its seers still count its cost."""
        self.lm, self.settings, self.system, self.script = lm, settings, system, script
        self.format: ChatFormat = chat_format(lm.tokenizer, system)
        self.policies: dict[str, Policy] = model_policies(lm, settings)
        if script is None and (seers := [n for n, p in self.policies.items() if p.needs_future]):
            raise KvlabError(f"{', '.join(seers)} keeps what later turns will attend to, so it needs a scripted "
                             "conversation; a live chat has no future to read")
        self.states = {
            name: KVState(lm, settings.position_mode, track_accumulated=p.needs_accumulated,
                          reads=p.reads(settings.budget_of(name, p)), quant=p.quantizer())
            for name, p in self.policies.items()
        }
        # each policy's budget at its latest compression (a % of Full's bytes grows with the conversation)
        self.budget = {name: budget_now(settings, name, p, self.states["full"]) for name, p in self.policies.items()}
        self.failed: dict[str, str] = {}
        self.script_future = script_future  # Full alone over the whole script (``foresee``)
        self._cut_short: str | None = None  # the message of a turn its caller's exit undid (``take_cut_short``)
        self.turns: list[TurnResult] = []
        self.segments: list[dict] = []
        self.stop_ids = set(self.format.stop_ids)
        # held for a whole turn, rollback included: a page rerun must not start a turn on caches that a
        # stopped turn is still restoring
        self._busy = threading.Lock()
        self._stop = threading.Event()
        watch_layers(lm)

    def request_stop(self) -> None:
        """Ask the running turn (if any) to stop before its next decoder layer; it then rolls every cache back."""
        self._stop.set()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no turn runs (a stopped one has rolled back); False if one still runs after ``timeout``."""
        if not self._busy.acquire(timeout=timeout):
            return False
        self._busy.release()
        return True

    def take_cut_short(self, timeout: float) -> str | None:
        """The message of the last turn cut short by its caller's exit, and forget it: not an error, not a stop (a page
        script ending mid-turn as it runs again: Streamlit's ``BaseException``); rolled back. None if there is none,
        or if a turn still runs after ``timeout`` s (it is told once it has rolled back)."""
        if not self._busy.acquire(timeout=timeout):
            return None
        try:
            cut, self._cut_short = self._cut_short, None
        finally:
            self._busy.release()
        return cut

    @property
    def total_tokens(self) -> int:
        return self.states["full"].seen

    def user_ids(self, user: str, prefill: str, first: bool | None = None) -> list[int]:
        """The tokens a user message (and the reply's ``prefill``) adds to this conversation, in its chat format;
        ``first``: whether it opens the conversation (by default, whether no turn is kept yet)."""
        text = self.format.user_block(user) + prefill
        first = not self.turns if first is None else first
        return [*self.format.start_ids, *self.lm.encode(self.format.opening + text)] if first else self.lm.encode(text)

    def reply_ids(self, reply: str) -> list[int]:
        """The tokens an assistant reply (after its prefill) adds to this conversation, its end marker included."""
        return self.lm.encode(reply + self.format.assistant_end)

    def run_turn(
        self,
        user: str,
        golden: str | None = None,
        prefill: str = "",
        answer: str | None = None,
        on_token: OnToken | None = None,
        on_phase: OnPhase | None = None,
        keep: bool = True,
        stop: threading.Event | None = None,
        metric: str = "contains",
    ) -> TurnResult:
        """Run one user message through every policy; returns (and keeps) the turn's record.

        ``on_token`` is called after every decode step and ``on_phase`` before each phase (prefill,
        eviction, replies, feeding the reply): a callback that raises stops the turn there, and every
        cache is as before it. ``request_stop`` (from another thread) stops it before the next decoder
        layer, with ``Stopped``, and so does setting ``stop`` (an event the caller owns and this turn never
        clears: the arena's Cancel). Without ``keep`` the turn is single-shot: every cache goes back to
        before it and the record is returned but not kept (its index is the number of kept turns).
        ``metric`` says how ``answer`` is checked (``kvlab.workloads.chat.metrics``).
        """
        if not isinstance(user, str):
            raise KvlabError(f"the message must be text, not {type(user).__name__}")
        if not user.strip():
            raise KvlabError("the message is empty")
        if len(user) > MAX_MESSAGE_CHARS:
            raise KvlabError(f"the message is {len(user)} characters; the limit is {MAX_MESSAGE_CHARS}")
        check_metric(metric)
        user_ids = self.user_ids(user, prefill)
        golden_ids = self.lm.encode(golden) if golden else []
        check_fits(self.lm, self.settings.position_mode, self.total_tokens, len(user_ids) + len(golden_ids),
                   self.settings.max_new_tokens)
        with self._busy:
            self._stop.clear()  # a stop asked for after the last turn ended is not meant for this one
            saved = {name: state.snapshot() for name, state in self.states.items()}
            failed = dict(self.failed)

            def phase(what: str) -> None:
                check_stop()  # between phases too: evictions run no decoder layer
                if on_phase is not None:
                    on_phase(what)

            segments = list(self.segments)

            def roll_back() -> None:
                for name, snap in saved.items():
                    self.states[name].restore(snap)
                self.failed, self.segments = failed, segments

            try:
                with stopping(*([self._stop] if stop is None else [self._stop, stop])):
                    t0 = clock()
                    result = self._turn(user, user_ids, golden, prefill, answer, on_token, phase, metric, keep)
                    result.turn_s = clock() - t0
            except BaseException as exc:  # an error, a stop or an interrupted stream: the session is as before the turn
                self._decoding(False)
                roll_back()
                if not isinstance(exc, Exception) and not self._stop.is_set():  # its caller ended mid-turn
                    self._cut_short = user
                raise
            if not keep:
                roll_back()
                self.turns.pop()
            return result

    def _turn(
        self, user: str, user_ids: list[int], golden: str | None, prefill: str, answer: str | None,
        on_token: OnToken | None, phase: OnPhase, metric: str = "contains", keep: bool = True,
    ) -> TurnResult:
        """One turn in its phases: prefill the message, evict, decode the replies, feed the reply, evict."""
        start = self.total_tokens
        live = [n for n in self.policies if n not in self.failed]
        # a policy dropped on an earlier turn still gets a row: its error, no score, no cost
        records = {n: PolicyTurn(policy=n, error=self.failed.get(n), dropped=n in self.failed) for n in self.policies}
        foresee(self, live, records, phase, user_ids, Turn(user, golden, prefill), keep)
        live = [n for n in live if n not in self.failed]

        phase(f"prefilling your message ({len(user_ids):,} tokens)")
        first_logits, probes, profile = self._prefill_message(live, user_ids, records, prefill, on_token)
        phase("evicting after your message")
        self._evict(live, probes, records, phase, reads=True)

        live = ["full", *(n for n in live if n != "full" and n not in self.failed)]  # the reference comes first
        self._decoding(True)  # the reply's queries, decoded or fed, are decoding queries (Quest reads sparsely)
        holders = reply_holders(self.lm, self.states, self.policies, live) if golden is None else []
        phase("decoding the replies")
        starts = first_positions({n: self.states[n] for n in live})
        own, decoded_logits = self._replies(live, first_logits, records, prefill, answer, on_token, holders, metric)
        reach_replies(records, starts, own)
        if golden:
            reply_text, source = golden_reply(golden, prefill), "golden"
        else:
            reply_text, source = self.lm.decode(own["full"]), "full"
        feed = self.reply_ids(reply_text)
        held, before = reply_to_feed(self.states, live, feed, own, first_logits, decoded_logits, holders)

        phase(f"feeding the reply ({len(feed)} tokens) to every cache that does not hold it yet")
        probes = {n: self.policies[n].probe() for n in live}  # what each policy evicts by after the reply
        # every cache's predictions of the reply scored against Full's as it is fed
        self._append(live, feed, probes, records, reduce=ReplyScores(before, records), held=held)
        self._decoding(False)
        phase("evicting after the reply")
        self._evict(live, probes, records, phase)
        phase("recording what each cache holds")
        for name in live:
            if name not in self.failed:
                record_cache(records[name], self.states[name], self.settings.block_size)
        mark_past(records, self.lm.facts.context_length)
        return self._close_turn(start, len(user_ids), user, prefill + reply_text, source, prefill, answer, profile,
                                records, metric)

    def _prefill_message(
        self, live: list[str], user_ids: list[int], records: dict[str, PolicyTurn], prefill: str,
        on_token: OnToken | None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Probe], list[list[float]]]:
        """Feed the user's message to every live cache: each one's logits for the reply's first token
        [vocab], the attention statistics its policy evicts by, and Full's attention profile [layer][key]."""
        s = self.settings
        probes = {n: self.policies[n].probe(s.stat_queries) for n in live}
        # Full (and caches still identical to it) first: its first words stream while the others prefill
        lead = [n for n in live if n == "full" or self.states[n].same_cache(self.states["full"])]
        logits = self._append(lead, user_ids, probes, records, logits_to_keep=1)
        rest = [n for n in live if n not in lead]
        if rest:
            first = int(logits["full"][-1].argmax())
            if on_token and first not in self.stop_ids:
                on_token("full", prefill + self.lm.decode([first]))
            logits |= self._append(rest, user_ids, probes, records, logits_to_keep=1)
        first_logits: dict[str, torch.Tensor] = {}
        for name in live:
            records[name].sink_mass = sink_mass(probes[name], s.stat_queries, self.states[name].positions,
                                                self.lm.facts.n_heads, s.sink_tokens)
            first_logits[name] = logits[name][-1]
        window = probes["full"].window_means[s.stat_queries]
        profile = host_lists([window[layer].mean(0) for layer in range(self.lm.facts.n_layers)])
        return first_logits, probes, profile

    def _close_turn(
        self, start: int, n_user: int, user: str, reply: str, source: str, prefill: str, answer: str | None,
        profile: list[list[float]], records: dict[str, PolicyTurn], metric: str = "contains",
    ) -> TurnResult:
        """Mark the turn's user and assistant spans of the conversation and keep its result."""
        index = len(self.turns)
        self.segments += [
            {"start": start, "end": start + n_user, "turn": index, "role": "user"},
            {"start": start + n_user, "end": self.total_tokens, "turn": index, "role": "assistant"},
        ]
        result = TurnResult(
            index=index, user=user, reply=reply, reply_source=source, prefill=prefill,
            answer=answer, total_tokens=self.total_tokens, segments=list(self.segments), profile=profile,
            policies=records, metric=metric,
        )
        self.turns.append(result)
        return result

    def _decoding(self, on: bool) -> None:
        """Mark every state as decoding (its sparse reads apply) or prefilling (every key is read)."""
        for state in self.states.values():
            state.set_decoding(on)

    def _append(
        self, names: list[str], ids: list[int], probes: dict[str, Probe], records: dict[str, PolicyTurn],
        logits_to_keep: int = 0, reduce: Callable[[str, torch.Tensor], None] | None = None,
        held: dict[str, int] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Feed ``ids`` to every named state (but the first ``held`` ones its cache holds) in as few forwards as their
        caches allow; time is split evenly."""
        held = held or dict.fromkeys(names, 0)
        for name in names:
            reach_next(records, {name: self.states[name]}, len(ids) - held[name])
        t0 = clock()
        by_index = (lambda i, logits: reduce(names[i], logits)) if reduce else None
        logits = append_together([self.states[n] for n in names], ids, [probes[n] for n in names], logits_to_keep,
                                 by_index, [held[n] for n in names])
        share = (clock() - t0) / len(names)
        for name in names:
            records[name].shared_s += share
        return dict(zip(names, logits))

    def _evict(self, names: list[str], probes: dict[str, Probe], records: dict[str, PolicyTurn], phase: OnPhase,
               reads: bool = False) -> None:
        """Apply each policy to its own state at its budget now unless the conversation fits it; one that fails is
        dropped from the session. KVzip's extra prefill first, every turn, recorded on its own. With ``reads`` (before
        the replies) a sparse reader under a % budget reads as many tokens' keys as the budget gives it now."""
        for name in names:
            policy, state = self.policies[name], self.states[name]
            budget = self.budget[name] = budget_now(self.settings, name, policy, self.states["full"])
            records[name].budget_tokens, records[name].budget_bytes = budget.shown, budget.allowed
            if reads and state.reads is not None and self.settings.budget_percent is not None:
                state.reads = policy.reads(budget.tokens)
            t0 = clock()
            try:
                if policy.evicts and policy.needs_reconstruction:
                    phase(f"{policy.label}: repeating {state.seen - state.reconstructed} new tokens (an extra prefill)")
                    records[name].repeated(reconstruct(state, policy.repeat_spec()))
                    t0 = clock()
                if not budget.fits(policy, state.seen, self.lm.facts):  # nothing evicted while the conversation fits
                    evict(state, policy, budget.layers, probes[name])
            except Exception as exc:
                if name == "full":
                    raise
                self.fail(name, records, exc)
            records[name].evict_s += clock() - t0

    def _replies(
        self, names: list[str], first_logits: dict[str, torch.Tensor], records: dict[str, PolicyTurn],
        prefill: str, answer: str | None, on_token: OnToken | None, holders: list[str], metric: str = "contains",
    ) -> tuple[dict[str, list[int]], torch.Tensor | None]:
        """Every policy's own greedy reply, decoded together; time is split evenly.

        Full's reply stays in the ``holders``' caches (``reply_holders``: every one, or Full's alone) and the logits
        that chose its tokens are returned too.
        """
        t0 = clock()
        text = functools.lru_cache(maxsize=16)(lambda ids: prefill + self.lm.decode(list(ids)))  # once per reply
        decoded_logits = None
        stream_rows = (lambda row, ids: on_token(names[row], text(tuple(ids)))) if on_token else None
        if holders == names:
            full = self.states["full"]
            rope = {n: self.states[n].next_positions(self.settings.max_new_tokens) for n in names}

            def to_all(ids: list[int]) -> None:
                for name in names:
                    on_token(name, text(tuple(ids)))

            reply, decoded_logits = full.generate_kept(first_logits["full"], self.settings.max_new_tokens,
                                                       self.stop_ids, to_all if on_token else None)
            fed = reply[: len(decoded_logits) - 1]
            for name in names[1:]:
                self.states[name].copy_cache(full)
                self.states[name].record_append(fed, rope[name][: len(fed)], None)
            replies = [reply] * len(names)
        elif holders:  # Full's, the first
            replies, decoded_logits = generate_keeping([self.states[n] for n in names],
                                                       [first_logits[n] for n in names], self.settings.max_new_tokens,
                                                       self.stop_ids, stream_rows)
        else:
            replies = generate_batched([self.states[n] for n in names], [first_logits[n] for n in names],
                                       self.settings.max_new_tokens, self.stop_ids, stream_rows)
        share = (clock() - t0) / len(names)
        for name, ids in zip(names, replies):
            rec = records[name]
            rec.reply = text(tuple(ids))
            rec.shared_s += share
            if answer is not None:
                rec.correct = score_reply(answer, rec.reply[len(prefill):], metric)
        return dict(zip(names, map(list, replies))), decoded_logits

    def fail(self, name: str, records: dict[str, PolicyTurn], exc: Exception) -> None:
        """Drop a policy from the session: its record keeps the error and the time spent, and loses every score."""
        rec = records[name]
        error = f"{type(exc).__name__}: {exc}"
        records[name] = PolicyTurn(policy=name, error=error, **{cost: getattr(rec, cost) for cost in COSTS})
        self.failed[name] = error
