"""The multi-turn engine: several policies side by side over one conversation, turn by turn.

Semantics follow SCBench's multi-turn mode: every policy's cache carries over between turns and
is compressed after the user message's prefill and again after the reply. All policies see the
same token stream (the golden reply when the conversation has one, else Full's greedy reply),
so their next-token distributions can be compared position by position with Full's.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import asdict, dataclass, field
from typing import Callable

import pandas as pd
import torch

from kvlab.engine.attention import Probe
from kvlab.engine.batched import append_together, generate_batched
from kvlab.engine.chatformat import ChatFormat, chat_format
from kvlab.workloads.chat.conversation import Conversation, Turn
from kvlab.errors import KvlabError, Stopped
from kvlab.policies.evict import evict
from kvlab.engine.fidelity import fidelity
from kvlab.engine.kvstate import POSITION_MODES, KVState, to_query_heads
from kvlab.engine.model import LoadedModel
from kvlab.engine.paging import block_figures
from kvlab.engine.progress import Progress
from kvlab.policies import DEFAULT_COMPARISON, Policy, make_policy
from kvlab.engine.timing import clock

MAX_MESSAGE_CHARS = 20_000
ESTIMATE_FROM_TOKENS = 256  # messages this long get a time estimate before they run
LONG_TURN_S = 20.0  # a turn estimated to take longer asks before it runs
OnToken = Callable[[str, str], None]  # (policy name, reply text so far)
OnPhase = Callable[[str], None]  # what the turn does next, between its phases


@dataclass
class ChatSettings:
    """What the user chose for a comparison; everything a replay needs."""

    policies: tuple[str, ...] = DEFAULT_COMPARISON
    budget: int = 128
    block_size: int = 16
    position_mode: str = "original"
    params: dict[str, dict] = field(default_factory=dict)  # policy name -> overrides; after init, every parameter
    max_new_tokens: int = 48
    sink_tokens: int = 4  # the "first k tokens" of the sink statistic
    stat_queries: int = 64  # the "last queries" of the sink statistic and attention profile
    # policy name -> its own token budget where it differs from ``budget`` (a byte budget's conversion)
    policy_budgets: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("budget", "block_size", "max_new_tokens", "sink_tokens", "stat_queries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise KvlabError(f"{name.replace('_', ' ')} must be a whole number, not {value!r}")
        if isinstance(self.policies, str) or not all(isinstance(p, str) for p in self.policies):
            raise KvlabError("policies must be a list of policy names")
        self.policies = tuple(dict.fromkeys(p.strip().lower() for p in self.policies if p.strip()))
        if "full" not in self.policies:
            self.policies = ("full", *self.policies)
        if self.position_mode not in POSITION_MODES:
            raise KvlabError(f"position mode must be one of {', '.join(POSITION_MODES)}, not {self.position_mode!r}")
        if self.budget < 1:
            raise KvlabError(f"the budget must be at least 1 token per layer and KV head, not {self.budget}")
        if self.block_size < 1:
            raise KvlabError(f"block size must be at least 1, not {self.block_size}")
        if self.stat_queries < 1 or self.sink_tokens < 0:
            raise KvlabError("the sink statistic needs at least 1 last query and a non-negative number of first tokens")
        if not 1 <= self.max_new_tokens <= 1024:
            raise KvlabError(f"max new tokens must be between 1 and 1024, not {self.max_new_tokens}")
        if not isinstance(self.params, dict) or not all(isinstance(p, dict) for p in self.params.values()):
            raise KvlabError("params must map policy names to their parameters")
        if stray := sorted(set(self.params) - set(self.policies)):
            raise KvlabError(f"parameters given for {', '.join(stray)}, which is not among the policies run")
        if not isinstance(self.policy_budgets, dict):
            raise KvlabError("policy budgets must map policy names to token budgets")
        if stray := sorted(set(self.policy_budgets) - set(self.policies)):
            raise KvlabError(f"budgets given for {', '.join(stray)}, which is not among the policies run")
        for name, b in self.policy_budgets.items():
            if not isinstance(b, int) or isinstance(b, bool) or b < 1:
                raise KvlabError(f"{name}'s budget must be a whole number of at least 1 token, not {b!r}")
        resolved = {}
        for name in self.policies:  # fail on names, parameters and minimum budgets before any model work
            policy = make_policy(name, **self.params.get(name, {}))
            policy.validate(self.budget_of(name))
            resolved[name] = policy.params()
        self.params = resolved  # defaults included, so records say exactly what each policy ran with

    def budget_of(self, policy: str) -> int:
        """The token budget (per layer and KV head) ``policy`` runs with."""
        return self.policy_budgets.get(policy, self.budget)


@dataclass
class PolicyTurn:
    """One policy's record of one turn; a policy that failed has ``error`` set and no score (None)."""

    policy: str
    reply: str = ""
    correct: bool | None = None
    kl: float | None = None
    top1: float | None = None
    retained: list[list[list[int]]] = field(default_factory=list)  # [layer][kv_head] original positions
    blocks: dict = field(default_factory=dict)
    kv_bytes: int | None = None
    cache_tokens: list[float] = field(default_factory=list)  # keys per layer and KV head after the turn (head mean)
    sink_mass: list[list[float]] = field(default_factory=list)  # [layer][head] attention on the first k tokens
    time_s: float = 0.0
    evict_s: float = 0.0
    read_share: float | None = None  # share of held keys its decoding queries read (Quest); None: every key
    bytes_read: float | None = None  # K/V bytes a decoding query reads from this cache (see _record_cache)
    pages_read: list[list[list[int]]] = field(default_factory=list)  # Quest: [layer][kv_head] pages the last query read
    error: str | None = None


@dataclass
class TurnResult:
    """Everything recorded for one turn, for every policy."""

    index: int
    user: str
    reply: str  # the reply all caches were fed (golden, or Full's own)
    reply_source: str  # "golden" or "full"
    prefill: str
    answer: str | None
    total_tokens: int  # tokens in the conversation after this turn
    segments: list[dict]  # token ranges: {"start", "end", "turn", "role"}
    profile: list[list[float]]  # Full: [layer][key position] mean attention of the last queries
    policies: dict[str, PolicyTurn]

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "TurnResult":
        return TurnResult(**{**d, "policies": {k: PolicyTurn(**v) for k, v in d["policies"].items()}})


def sink_mass(probe: Probe, n: int, positions: list[torch.Tensor], n_heads: int, k: int) -> list[list[float]]:
    """[layer][head] share of the last n queries' attention that lands on original tokens < k."""
    out = []
    for layer, pos in enumerate(positions):
        attn = probe.window_means[n][layer]  # [heads, slots]
        is_sink = to_query_heads((pos < k).float(), n_heads)
        out.append((attn * is_sink).sum(-1).tolist())
    return out


def settings_summary(settings: ChatSettings, system: str | None) -> str:
    """The settings a conversation runs with, in one line of Markdown."""
    def params(values: dict) -> str:
        return f" ({', '.join(f'{k}={v}' for k, v in values.items())})" if values else ""

    policies = ", ".join(f"{name}{params(settings.params.get(name, {}))}" for name in settings.policies)
    said = f"“{system}”" if system else "none"
    own = "".join(f", {name} {b}" for name, b in settings.policy_budgets.items())
    return (f"**Policies** {policies} · **budget** {settings.budget}{own} tokens per layer per KV head · **blocks** of "
            f"{settings.block_size} · **positions** {settings.position_mode} · **replies** up to "
            f"{settings.max_new_tokens} tokens · **system message** {said}")


def estimate_turn_s(lm: LoadedModel, settings: ChatSettings, n_tokens: int, fresh: bool) -> float:
    """Rough seconds a turn prefilling ``n_tokens`` takes on this machine now (a 64-token forward and a step, timed).

    ``fresh``: no turn yet, so every cache is still Full's and one prefill serves every policy.
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
    per_token = (t1 - t0) / len(ids)
    # every policy decodes and is fed its reply (evicting policies' caches soon differ from Full's)
    reply = len(settings.policies) * settings.max_new_tokens * (per_token + step)
    return prefill_rows * n_tokens * per_token + reply


def model_policies(lm: LoadedModel, settings: ChatSettings) -> dict[str, Policy]:
    """The settings' policies, refused (KvlabError) where this model cannot run them."""
    policies = {}
    for name in settings.policies:
        policy = make_policy(name, **settings.params.get(name, {}))
        policy.validate(settings.budget_of(name), lm.facts.context_length)
        policies[name] = policy
    if settings.position_mode == "rerotated" and not lm.facts.has_rope:
        raise KvlabError("re-rotated positions need a model with rotary embeddings")
    return policies


_running = threading.local()  # the stop flags of the turn running on this thread (the model is shared)
_watched: weakref.WeakSet = weakref.WeakSet()  # models whose decoder layers check it


def _check_stop(*_: object) -> None:
    if any(flag.is_set() for flag in getattr(_running, "stops", ())):
        raise Stopped("the turn was stopped")


def _watch_layers(lm: LoadedModel) -> None:
    """Check the running turn's stop flag before every decoder layer: one forward of a long message or a
    decode step on a busy machine can take seconds, a layer a fraction of that."""
    if lm.model not in _watched:
        for layer in lm.model.get_decoder().layers:
            layer.register_forward_pre_hook(_check_stop)
        _watched.add(lm.model)


class _ReplyScores:
    """The ``reduce`` of a reply's feed: each policy's fidelity to Full on the reply's tokens.

    Full's predictions are the reference, so a policy's predictions that arrive before Full's (the
    batches decide the order) wait for them; in the usual order nothing waits and no more than one
    forward's logits are held.
    """

    def __init__(self, before: dict[str, torch.Tensor], records: dict[str, PolicyTurn]) -> None:
        self.before, self.records = before, records  # before: the logits that predicted the first fed token
        self.reference: torch.Tensor | None = None  # Full's predictions [reply, vocab]
        self.waiting: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, logits: torch.Tensor) -> None:
        predicted = torch.cat([self.before[name], logits[:-1]])  # [reply, vocab]
        if name == "full":
            self.reference = predicted
            for other, held in [("full", predicted), *self.waiting.items()]:
                self._score(other, held)
            self.waiting.clear()
        elif self.reference is None:
            self.waiting[name] = predicted
        else:
            self._score(name, predicted)

    def _score(self, name: str, predicted: torch.Tensor) -> None:
        scores = fidelity(self.reference, predicted)
        self.records[name].kl, self.records[name].top1 = scores.kl, scores.top1


class ChatSession:
    """A conversation in progress: one KV state per policy, advanced one turn at a time."""

    def __init__(self, lm: LoadedModel, settings: ChatSettings, system: str | None = None) -> None:
        self.lm, self.settings, self.system = lm, settings, system
        self.format: ChatFormat = chat_format(lm.tokenizer, system)
        self.policies: dict[str, Policy] = model_policies(lm, settings)
        self.states = {
            name: KVState(lm, settings.position_mode, track_accumulated=p.needs_accumulated,
                          reads=p.reads(settings.budget_of(name)), quant=p.quantizer())
            for name, p in self.policies.items()
        }
        self.budgets = {
            name: p.layer_budgets(settings.budget_of(name), lm.facts.n_layers) for name, p in self.policies.items()
        }
        self.failed: dict[str, str] = {}
        self.turns: list[TurnResult] = []
        self.segments: list[dict] = []
        self.stop_ids = set(self.format.stop_ids)
        # held for a whole turn, rollback included: a page rerun must not start a turn on caches that a
        # stopped turn is still restoring
        self._busy = threading.Lock()
        self._stop = threading.Event()
        _watch_layers(lm)

    def request_stop(self) -> None:
        """Ask the running turn (if any) to stop before its next decoder layer; it then rolls every cache back."""
        self._stop.set()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no turn runs (a stopped one has rolled back); False if one still runs after ``timeout``."""
        if not self._busy.acquire(timeout=timeout):
            return False
        self._busy.release()
        return True

    @property
    def total_tokens(self) -> int:
        return self.states["full"].seen

    def _user_ids(self, user: str, prefill: str) -> list[int]:
        text = self.format.user_block(user) + prefill
        if self.turns:
            return self.lm.encode(text)
        return [*self.format.start_ids, *self.lm.encode(self.format.opening + text)]

    def _check_fits(self, n_new: int) -> None:
        limit = self.lm.facts.context_length
        needed = self.total_tokens + n_new + self.settings.max_new_tokens
        if needed > limit and self.settings.position_mode == "original":
            raise KvlabError(
                f"this turn needs {needed} positions but the model's context is {limit}; "
                "start a new conversation or use the re-rotated position mode"
            )

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
    ) -> TurnResult:
        """Run one user message through every policy; returns (and keeps) the turn's record.

        ``on_token`` is called after every decode step and ``on_phase`` before each phase (prefill,
        eviction, replies, feeding the reply): a callback that raises stops the turn there, and every
        cache is as before it. ``request_stop`` (from another thread) stops it before the next decoder
        layer, with ``Stopped``, and so does setting ``stop`` (an event the caller owns and this turn never
        clears: the arena's Cancel). Without ``keep`` the turn is single-shot: every cache goes back to
        before it and the record is returned but not kept (its index is the number of kept turns).
        """
        if not isinstance(user, str):
            raise KvlabError(f"the message must be text, not {type(user).__name__}")
        if not user.strip():
            raise KvlabError("the message is empty")
        if len(user) > MAX_MESSAGE_CHARS:
            raise KvlabError(f"the message is {len(user)} characters; the limit is {MAX_MESSAGE_CHARS}")
        user_ids = self._user_ids(user, prefill)
        golden_ids = self.lm.encode(golden) if golden else []
        self._check_fits(len(user_ids) + len(golden_ids))
        with self._busy:
            self._stop.clear()  # a stop asked for after the last turn ended is not meant for this one
            saved = {name: state.snapshot() for name, state in self.states.items()}
            failed = dict(self.failed)
            _running.stops = (self._stop,) if stop is None else (self._stop, stop)

            def phase(what: str) -> None:
                _check_stop()  # between phases too: evictions run no decoder layer
                if on_phase is not None:
                    on_phase(what)

            segments = list(self.segments)

            def roll_back() -> None:
                for name, snap in saved.items():
                    self.states[name].restore(snap)
                self.failed, self.segments = failed, segments

            try:
                result = self._turn(user, user_ids, golden, prefill, answer, on_token, phase)
            except BaseException:  # an error, a stop or an interrupted stream: the session is as before the turn
                self._decoding(False)
                roll_back()
                raise
            finally:
                _running.stops = ()
            if not keep:
                roll_back()
                self.turns.pop()
            return result

    def _turn(
        self, user: str, user_ids: list[int], golden: str | None, prefill: str, answer: str | None,
        on_token: OnToken | None, phase: OnPhase,
    ) -> TurnResult:
        """One turn in its phases: prefill the message, evict, decode the replies, feed the reply, evict."""
        start = self.total_tokens
        live = [n for n in self.policies if n not in self.failed]
        # a policy dropped on an earlier turn still gets a row: its error, no score
        records = {n: PolicyTurn(policy=n, error=self.failed.get(n)) for n in self.policies}

        phase(f"prefilling your message ({len(user_ids)} tokens)")
        first_logits, probes, profile = self._prefill_message(live, user_ids, records, prefill, on_token)
        phase("evicting after your message")
        self._evict(live, probes, records)

        live = ["full", *(n for n in live if n != "full" and n not in self.failed)]  # the reference comes first
        self._decoding(True)  # the reply's queries, decoded or fed, are decoding queries (Quest reads sparsely)
        kept = golden is None and self._reply_can_stay(live)
        phase("decoding the replies")
        own, decoded_logits = self._replies(live, first_logits, records, prefill, answer, on_token, kept)
        if golden:
            reply_text = golden[len(prefill):] if golden.startswith(prefill) else golden
            source = "golden"
        else:
            reply_text, source = self.lm.decode(own["full"]), "full"
        feed, before = self._reply_to_feed(live, self.lm.encode(reply_text + self.format.assistant_end), own,
                                           first_logits, decoded_logits)

        phase(f"feeding the reply ({len(feed)} tokens) to every cache")
        probes = self._feed_reply(live, feed, before, records)
        self._decoding(False)
        phase("evicting after the reply")
        self._evict(live, probes, records)
        for name in live:
            if name not in self.failed:
                self._record_cache(records[name], self.states[name])
        return self._close_turn(start, len(user_ids), user, prefill + reply_text, source, prefill, answer, profile,
                                records)

    def _prefill_message(
        self, live: list[str], user_ids: list[int], records: dict[str, PolicyTurn], prefill: str,
        on_token: OnToken | None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Probe], list[list[float]]]:
        """Feed the user's message to every live cache: each one's logits for the reply's first token
        [vocab], the attention statistics its policy evicts by, and Full's attention profile [layer][key]."""
        s = self.settings
        probes = {n: Probe(windows=tuple({s.stat_queries, *self.policies[n].probe_windows()})) for n in live}
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
        profile = [window[layer].mean(0).tolist() for layer in range(self.lm.facts.n_layers)]
        return first_logits, probes, profile

    def _reply_to_feed(
        self, live: list[str], reply_ids: list[int], own: dict[str, list[int]], first_logits: dict[str, torch.Tensor],
        decoded_logits: torch.Tensor | None,
    ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The reply tokens the caches still need, and per cache the logits that predicted the first of them.

        A reply kept in the caches while it was decoded needs only its rest fed; if it re-tokenizes
        differently, the kept tokens are dropped and the whole reply is fed.
        """
        feed, before = reply_ids, {n: first_logits[n][None] for n in live}  # [1, vocab] each
        if decoded_logits is not None:
            fed = own["full"][: len(decoded_logits) - 1]
            if reply_ids[: len(fed)] == fed and len(reply_ids) > len(fed):  # only the rest needs feeding
                feed, before = reply_ids[len(fed):], {n: decoded_logits for n in live}
            else:  # the reply re-tokenizes differently: undo and feed it whole
                for name in live:
                    self.states[name].drop_last(len(fed))
        return feed, before

    def _feed_reply(
        self, live: list[str], feed: list[int], before: dict[str, torch.Tensor], records: dict[str, PolicyTurn],
    ) -> dict[str, Probe]:
        """Feed the reply to every cache and score each one's predictions of it against Full's.

        Returns the attention statistics each policy evicts by after the reply.
        """
        probes = {n: Probe(windows=self.policies[n].probe_windows()) for n in live}
        self._append(live, feed, probes, records, reduce=_ReplyScores(before, records))
        return probes

    def _close_turn(
        self, start: int, n_user: int, user: str, reply: str, source: str, prefill: str, answer: str | None,
        profile: list[list[float]], records: dict[str, PolicyTurn],
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
            policies=records,
        )
        self.turns.append(result)
        return result

    def _decoding(self, on: bool) -> None:
        """Mark every state as decoding (its sparse reads apply) or prefilling (every key is read)."""
        for state in self.states.values():
            state.reading = on

    def _append(
        self, names: list[str], ids: list[int], probes: dict[str, Probe], records: dict[str, PolicyTurn],
        logits_to_keep: int = 0, reduce: Callable[[str, torch.Tensor], None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Feed ``ids`` to every named state in as few forwards as their caches allow; time is split evenly."""
        t0 = clock()
        by_index = (lambda i, logits: reduce(names[i], logits)) if reduce else None
        logits = append_together([self.states[n] for n in names], ids, [probes[n] for n in names], logits_to_keep,
                                 by_index)
        share = (clock() - t0) / len(names)
        for name in names:
            records[name].time_s += share
        return dict(zip(names, logits))

    def _evict(self, names: list[str], probes: dict[str, Probe], records: dict[str, PolicyTurn]) -> None:
        """Apply each policy to its own state; a policy that fails is dropped from the session, not the others."""
        for name in names:
            t0 = clock()
            try:
                evict(self.states[name], self.policies[name], self.budgets[name], probes[name])
            except Exception as exc:
                if name == "full":
                    raise
                self._fail(name, records, exc)
            spent = clock() - t0
            records[name].evict_s += spent
            records[name].time_s += spent

    def _reply_can_stay(self, names: list[str]) -> bool:
        """Whether Full's greedy reply can stay in the caches as it is decoded, instead of being fed again.

        True when every cache is still identical to Full's and no policy needs attention statistics
        of the reply's queries (observation windows, H2O's sums): feeding the reply again would
        compute exactly the keys the decoding already computed.
        """
        states = [self.states[n] for n in names]
        return (not any(self.lm.facts.layer_windows)  # drop_last cannot bring back keys a window dropped
                and all(states[0].same_cache(s) for s in states[1:]) and not any(s.track_accumulated for s in states)
                and not any(self.policies[n].probe_windows() for n in names))

    def _replies(
        self, names: list[str], first_logits: dict[str, torch.Tensor], records: dict[str, PolicyTurn],
        prefill: str, answer: str | None, on_token: OnToken | None, kept: bool,
    ) -> tuple[dict[str, list[int]], torch.Tensor | None]:
        """Every policy's own greedy reply, decoded together; time is split evenly.

        With ``kept`` (all caches identical, see ``_reply_can_stay``) Full's reply stays in every cache
        and the logits that chose its tokens are returned too.
        """
        t0 = clock()
        text = functools.lru_cache(maxsize=16)(lambda ids: prefill + self.lm.decode(list(ids)))  # once per reply
        decoded_logits = None
        if kept:
            full = self.states["full"]
            before = {n: (self.states[n].lengths(), self.states[n].next_positions(self.settings.max_new_tokens))
                      for n in names}

            def to_all(ids: list[int]) -> None:
                for name in names:
                    on_token(name, text(tuple(ids)))

            reply, decoded_logits = full.generate_kept(first_logits["full"], self.settings.max_new_tokens,
                                                       self.stop_ids, to_all if on_token else None)
            fed = reply[: len(decoded_logits) - 1]
            for name in names[1:]:
                lengths, rope = before[name]
                self.states[name].copy_cache(full)
                self.states[name].record_append(fed, rope[: len(fed)], None, lengths)
            replies = [reply] * len(names)
        else:
            stream_rows = (lambda row, ids: on_token(names[row], text(tuple(ids)))) if on_token else None
            replies = generate_batched([self.states[n] for n in names], [first_logits[n] for n in names],
                                       self.settings.max_new_tokens, self.stop_ids, stream_rows)
        share = (clock() - t0) / len(names)
        for name, ids in zip(names, replies):
            rec = records[name]
            rec.reply = text(tuple(ids))
            rec.time_s += share
            if answer is not None:
                rec.correct = answer.strip().lower() in rec.reply[len(prefill):].lower()
        return dict(zip(names, map(list, replies))), decoded_logits

    def _fail(self, name: str, records: dict[str, PolicyTurn], exc: Exception) -> None:
        """Drop a policy from the session: its record keeps the error and the time spent, and loses every score."""
        rec = records[name]
        error = f"{type(exc).__name__}: {exc}"
        records[name] = PolicyTurn(policy=name, time_s=rec.time_s, evict_s=rec.evict_s, error=error)
        self.failed[name] = error

    def _record_cache(self, rec: PolicyTurn, state: KVState) -> None:
        f = self.lm.facts
        kept = state.kept_positions()  # per layer and KV head: heads may hold different numbers (AdaKV)
        rec.retained = [[p.tolist() for p in heads] for heads in kept]
        per_layer = [(sum(h), len(h)) for h in state.head_lengths()]  # keys held, KV heads
        rec.cache_tokens = [k // n if k % n == 0 else k / n for k, n in per_layer]  # mean per head (AdaKV's differ)
        rec.kv_bytes = rec.bytes_read = state.kv_bytes()
        if state.reads is not None:  # this turn's reads only
            rec.read_share = state.reads.read_share
            state.reads.keys_read = state.reads.keys_held = 0
            rec.pages_read = state.reads.pages_read_last()
            # every page's min and max are read to rank the pages, then the read share of the keys and values
            meta = sum(state.reads.metadata_bytes(n, f) for n in state.lengths())
            if rec.read_share is not None:
                rec.bytes_read = meta + rec.read_share * (rec.kv_bytes - meta)
        rec.blocks = block_figures(kept, state.seen, self.settings.block_size,
                                   f.kv_bytes(1, layers=1, heads=1)).as_dict()


def session_to_json(session: ChatSession) -> dict:
    """A session as plain JSON: settings, conversation and every turn's record."""
    return {
        "kvlab_session": 1,
        "model": session.lm.facts.name,
        "settings": asdict(session.settings),
        "system": session.system,
        "turns": [t.to_dict() for t in session.turns],
    }


def session_conversation(session: ChatSession) -> Conversation | None:
    """A chat in progress as a workload: its replies become the golden history (None before turn 1)."""
    if not session.turns:
        return None
    turns = tuple(Turn(user=t.user, golden=t.reply, prefill=t.prefill, answer=t.answer) for t in session.turns)
    return Conversation(name="current-chat", description="the conversation on the chat page",
                        system=session.system, turns=turns)


def replay_session(
    lm: LoadedModel, data: object, progress: Progress | None = None
) -> ChatSession:
    """Rebuild a saved session by re-running its turns (greedy decoding makes it identical)."""
    if not isinstance(data, dict) or data.get("kvlab_session") != 1:
        raise KvlabError("this is not a kvlab session file (no 'kvlab_session': 1)")
    try:
        settings = ChatSettings(**{**data["settings"], "policies": tuple(data["settings"]["policies"])})
        turns = [(t["user"], t["reply"] if t["reply_source"] == "golden" else None, t["prefill"], t["answer"])
                 for t in data["turns"]]
    except (KeyError, TypeError) as exc:
        raise KvlabError(f"the session file is incomplete or malformed ({exc})") from exc
    session = ChatSession(lm, settings, data.get("system"))
    for i, (user, golden, prefill, answer) in enumerate(turns):
        session.run_turn(user, golden=golden, prefill=prefill, answer=answer)
        if progress:
            progress((i + 1) / len(turns), f"Replayed turn {i + 1}/{len(turns)}")
    return session


def turn_table(turns: list[TurnResult]) -> pd.DataFrame:
    """One row per turn and policy: fidelity, accuracy, memory and time."""
    rows = []
    for t in turns:
        for name, p in t.policies.items():
            rows.append({
                "turn": t.index + 1, "policy": name, "kl": p.kl, "top1": p.top1, "correct": p.correct,
                "tokens": t.total_tokens,
                "kept_per_layer": round(sum(p.cache_tokens) / len(p.cache_tokens), 1) if p.cache_tokens else None,
                "kv_kib": None if p.kv_bytes is None else p.kv_bytes / 1024, "free_blocks": p.blocks.get("free"),
                "fragmented_blocks": p.blocks.get("fragmented"), "full_blocks": p.blocks.get("full"),
                "time_s": p.time_s, "evict_ms": p.evict_s * 1000, "read_share": p.read_share, "error": p.error,
            })
    return pd.DataFrame(rows)


def failures(turns: list[TurnResult]) -> dict[str, tuple[int, str]]:
    """policy -> (turn number, error) for every policy that failed, at the turn it failed."""
    out: dict[str, tuple[int, str]] = {}
    for t in turns:
        for name, p in t.policies.items():
            if p.error is not None:
                out.setdefault(name, (t.index + 1, p.error))
    return out
