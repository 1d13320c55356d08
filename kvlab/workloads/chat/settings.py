"""A chat comparison's settings, checked before any model work, and the policies they build on a model."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import POSITION_MODES
from kvlab.engine.progress import Progress
from kvlab.errors import KvlabError
from kvlab.policies import DEFAULT_COMPARISON, Policy, make_policy
from kvlab.workloads.chat.records import TurnResult

MAX_BLOCK = 4096  # tokens per paged block: vLLM's blocks are 16; a block past this pages nothing


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
    budget_mib: float | None = None  # the byte budget ``policy_budgets`` were converted from, where one was
    # a budget of this % of the K/V bytes Full holds at each compression instead of ``budget`` tokens: it grows
    # with the conversation (kvlab.workloads.chat.budgets converts it, turn by turn)
    budget_percent: float | None = None

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
        # every number out of range at once: a form with three wrong fields should not take three rounds to fix
        out_of_range = [said for bad, said in (
            (self.budget < 1, f"the budget must be at least 1 token per layer and KV head, not {self.budget}"),
            (not 1 <= self.block_size <= MAX_BLOCK,
             f"block size must be between 1 and {MAX_BLOCK:,} tokens, not {self.block_size:,}"),
            (self.stat_queries < 1 or self.sink_tokens < 0,
             "the sink statistic needs at least 1 last query and a non-negative number of first tokens"),
            (not 1 <= self.max_new_tokens <= 1024,
             f"reply tokens (max new tokens) must be between 1 and 1024, not {self.max_new_tokens}"),
        ) if bad]
        if out_of_range:
            raise KvlabError("; ".join(out_of_range))
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
        if self.budget_percent is not None:
            p = self.budget_percent
            if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 100:
                raise KvlabError(f"a budget in % of Full's K/V bytes must be more than 0 and at most 100, not {p!r}")
            if self.budget_mib is not None:
                raise KvlabError("a budget is either MiB or a % of Full's K/V bytes, not both")
        # names, parameters and minimum budgets fail before any model work; the parameters are kept with their
        # defaults, so records say exactly what each policy ran with
        self.params = {name: policy.params() for name, policy in checked_policies(self).items()}

    def unquantized(self, turn: TurnResult) -> dict[str, tuple[int, float]]:
        """The quantizing policies that hold no more tokens after ``turn`` than they keep at full precision, so that
        they read like Full: name → (their residual, the tokens they hold)."""
        out = {}
        for name, rec in turn.policies.items():
            quant = None if rec.error else make_policy(name, **self.params.get(name, {})).quantizer()
            if quant is not None and quant.active and rec.cache_tokens and max(rec.cache_tokens) <= quant.residual:
                out[name] = (quant.residual, max(rec.cache_tokens))
        return out

    def budget_of(self, name: str, policy: Policy | None = None) -> int:
        """The token budget (per layer and KV head) policy ``name`` runs with. Under a % budget it changes turn by
        turn (``kvlab.workloads.chat.budgets``) and is never below the policy's minimum, so ``policy`` given, that
        minimum is what a check before the conversation sees."""
        if self.budget_percent is not None and policy is not None:
            return policy.min_budget()
        return self.policy_budgets.get(name, self.budget)


def checked_policies(settings: ChatSettings, context_length: int | None = None) -> dict[str, Policy]:
    """The settings' policies made and checked against their budgets (and a model's context, given one); one error
    says every refusal at once ("; "-separated, one reason once with every policy it refuses), so that a user mends
    them all in one go."""
    policies, refused = {}, {}  # refused: reason -> the policies it names ("" where it names none)
    for name in settings.policies:
        try:
            policy = make_policy(name, **settings.params.get(name, {}))
            policy.validate(settings.budget_of(name, policy), context_length)
        except KvlabError as exc:
            said = str(exc)
            reason = said.removeprefix(f"{name}: ")
            refused.setdefault(reason, []).append(name if reason != said else "")
            continue
        policies[name] = policy
    if refused:
        raise KvlabError("; ".join(f"{', '.join(dict.fromkeys(names))}: {reason}" if all(names) else reason
                                   for reason, names in refused.items()))
    return policies


def model_policies(lm: LoadedModel, settings: ChatSettings, progress: Progress | None = None) -> dict[str, Policy]:
    """The settings' policies, refused (KvlabError) where this model cannot run them; ``progress`` follows what
    a policy learns from the model first (DuoAttention's head pattern: a minute, once per model)."""
    if settings.position_mode == "rerotated" and not lm.facts.has_rope:
        raise KvlabError("re-rotated positions need a model with rotary embeddings")
    policies = checked_policies(settings, lm.facts.context_length)
    for policy in policies.values():  # what takes long, once every policy is known to fit
        policy.prepare(lm, progress)
    return policies
