"""DuoAttention's head patterns: per layer and KV head, a gate α ∈ [0, 1] saying how much it needs every key.

Found on the loaded model, once per model, never downloaded, and kept on disk in kvlab's cache folder
(``cache_dir() / "head_patterns"``) under a key of the model's identity (name and a fingerprint of its
weights), ``PATTERN_VERSION``, the method and its settings. Two methods:

- ``trained`` — the authors' gate optimisation (mit-han-lab/duo-attention ``duo_attn/train.py``). Every
  layer's attention output becomes ``α · full + (1 − α) · streaming`` per KV head
  (``duo_attn/patch/llama.py``, ``llama_duo_attention_forward_two_way``: the full term is the full model's
  own attention output, computed without gradient from its own hidden states; the streaming term attends
  to the first ``sink`` and the last ``recent`` keys of each query, ``patch/streaming_attn.py``,
  ``generate_streaming_mask``). The loss is the mean squared difference of the decoder's last hidden states
  between the full and the mixed forward over the answer tokens, plus ``reg_weight`` times the mean |α|
  (``duo_attn/loss.py``); AdamW without weight decay, the authors' warm-up/cool-down schedule, gates
  clamped to [0, 1] before every step, initial value 1. The data are synthetic passkey-retrieval contexts
  as ``duo_attn/data.py`` (``MultiplePasskeyRetrievalDataset``) builds them: needles of NATO-alphabet words
  at spread depths of a haystack, then every question and its passkey, the answers being the labels.
- ``on_the_fly`` — kvpress's experimental estimate (NVIDIA/kvpress ``presses/duo_attention_press.py``,
  ``duo_attention_on_the_fly``): the mean pre-RoPE query and key of each head over sample texts, repeated
  over ``q_len`` positions and rotated there; the last query's attention over those keys, accumulated,
  averaged over the keys (the "area under the cumulated attention curve"), averaged over the query group.

What ``GateTraining`` scales down, and why: the authors train Llama-3-8B on 8 GPUs for 2000 steps at lr
0.02 on contexts of 1000–32000 tokens with 10 passkeys of 32 words, sink 128 and recent 256. A 2-core CPU
does a few dozen steps in minutes on SmolLM2-135M, so: ``steps`` 20; lr 0.1 (``duo_attn/utils.py``'s own
default: over so few steps the gates must still be able to travel from 1 to 0); contexts of 150–350
haystack tokens with 2 passkeys of 8 words (about 270–470 tokens in all); sink 16 and recent 64, so the
streaming window stays a small part of the context as it is in the authors' runs. The haystack is kvlab's
bundled RAG corpus (the authors use BookSum chapters), and so are kvpress's samples for the estimate (its
BookSum draws). On SmolLM2-135M (float32) the training took 62 s on an idle 2-core CPU (22 min with
the machine's load average near 10) and the estimate 8 s.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from kvlab.engine.attend import attend
from kvlab.engine.conversion import cache_dir
from kvlab.engine.facts import LoadedModel
from kvlab.engine.progress import Progress
from kvlab.engine.rope import capture_qk_layers, rotate
from kvlab.engine.timing import clock
from kvlab.errors import KvlabError
from kvlab.paths import RAG_CORPUS

PATTERN_VERSION = 1  # bump when the way patterns are found changes: older files on disk are then ignored
METHODS = ("trained", "on_the_fly")
METHOD_WORDS = {"trained": "the authors' gate optimisation", "on_the_fly": "kvpress's on-the-fly estimate"}
TRAIN_ATTENTION = "kvlab_duo_gates"  # the attention function the gate training runs the model with

# duo_attn/data.py, as the authors spell it ("Remeber")
PASSKEY_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett",
                 "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango",
                 "uniform", "victor", "whiskey", "xray", "yankee", "zulu")
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")
NEEDLE = "Remeber this sequence of words, it's the {ordinal} passkey to the vault: "
QUESTION = "Based on the content of the book, what is the {ordinal} passkey to the vault?\nPasskey: "
OPENING, CLOSING, SEPARATOR = "<|im_start|> This is a very long story book: <book> ", " </book>.\n\n", "\n\n"


@dataclass(frozen=True)
class GateTraining:
    """The authors' gate optimisation, scaled to a CPU (module docstring: what was scaled from what)."""

    steps: int = 20
    lr: float = 0.1
    reg_weight: float = 0.05
    initial_value: float = 1.0
    sink: int = 16
    recent: int = 64
    context_min: int = 150  # haystack tokens of the shortest and longest context
    context_max: int = 350
    context_intervals: int = 50
    num_passkeys: int = 2
    passkey_length: int = 8  # words per passkey
    depth_min: float = 0.05
    depth_max: float = 0.95
    depth_intervals: int = 1000
    seed: int = 42


@dataclass(frozen=True)
class OnTheFly:
    """kvpress's estimate: ``num_samples`` texts (at most the bundled corpus's documents), ``q_len`` positions."""

    num_samples: int = 50
    q_len: int = 500


Settings = GateTraining | OnTheFly
DEFAULTS: dict[str, Settings] = {"trained": GateTraining(), "on_the_fly": OnTheFly()}  # what a policy runs with


@dataclass
class HeadPattern:
    """Gates [layers, kv_heads] in [0, 1] (higher: more of a retrieval head) and how they were found."""

    model: str
    method: str
    gates: torch.Tensor  # [layers, kv_heads]
    settings: dict
    seconds: float  # what finding it cost, on the machine that found it
    history: list[dict] = field(default_factory=list)  # per training step: distill and reg loss

    def retrieval(self, head_compression_ratio: float) -> torch.Tensor:
        """[layers, kv_heads] bool: all but the ``round(heads × ratio)`` lowest gates (kvpress's binarisation;
        ties go to the earlier head in layer order, a stable sort)."""
        n_streaming = round(self.gates.numel() * head_compression_ratio)
        order = self.gates.flatten().argsort(stable=True)
        keep = torch.ones(self.gates.numel(), dtype=torch.bool)
        keep[order[:n_streaming]] = False
        return keep.view_as(self.gates)

    def to_json(self) -> dict:
        return {"model": self.model, "method": self.method, "gates": self.gates.tolist(), "settings": self.settings,
                "seconds": self.seconds, "history": self.history}

    @classmethod
    def from_json(cls, data: dict) -> HeadPattern:
        return cls(data["model"], data["method"], torch.tensor(data["gates"]), data["settings"], data["seconds"],
                   data["history"])


_found: dict[str, HeadPattern] = {}  # this process's patterns by cache key


def head_pattern(lm: LoadedModel, method: str = "trained", settings: Settings | None = None,
                 progress: Progress | None = None) -> HeadPattern:
    """The model's head pattern by ``method``: from this process, else the disk, else found now and saved.
    Finding one takes a minute on a CPU (gate training): ``progress`` follows it step by step."""
    if method not in METHODS:
        raise KvlabError(f"the head pattern method must be one of {', '.join(METHODS)}, not {method!r}")
    settings = settings or DEFAULTS[method]
    key = pattern_key(lm, method, settings)
    if key in _found:
        return _found[key]
    path = cache_dir() / "head_patterns" / f"{key}.json"
    if path.exists():
        pattern = HeadPattern.from_json(json.loads(path.read_text(encoding="utf-8")))
    else:
        pattern = find_pattern(lm, method, settings, progress)
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(".tmp")
        scratch.write_text(json.dumps(pattern.to_json()), encoding="utf-8")
        scratch.replace(path)  # whole or not at all: another process may read it meanwhile
    _found[key] = pattern
    return pattern


def find_pattern(lm: LoadedModel, method: str, settings: Settings, progress: Progress | None = None) -> HeadPattern:
    """Find the pattern now (no cache), telling ``progress`` what runs."""
    say = progress or (lambda fraction, message: None)
    if method == "on_the_fly":
        say(0.0, "DuoAttention: estimating the head pattern from mean queries and keys (kvpress's on-the-fly)")
        return on_the_fly(lm, settings)
    steps = settings.steps
    say(0.0, f"DuoAttention: training the head gates on this model (step 0/{steps}; once per model, then cached)")
    return train_gates(lm, settings, lambda step, losses: say(
        (step + 1) / steps, f"DuoAttention: training the head gates, step {step + 1}/{steps} "
                            f"(distillation loss {losses['distill']:.4f})"))


def pattern_key(lm: LoadedModel, method: str, settings: Settings) -> str:
    """The cache key of a pattern: model name and weights' fingerprint, code version, method and settings."""
    ident = {"model": lm.facts.name, "weights": fingerprint(lm), "version": PATTERN_VERSION, "method": method,
             "settings": asdict(settings)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def fingerprint(lm: LoadedModel) -> str:
    """A hash of every parameter's name, shape and 256 of its values spread over it: tells two models
    (two random tiny ones of one shape, too) apart without reading every weight."""
    digest = hashlib.sha256()
    for name, param in lm.model.named_parameters():
        flat = param.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 256)][:256].float().cpu()
        digest.update(f"{name}{tuple(param.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def haystack_texts() -> list[str]:
    """The bundled RAG corpus's documents: the haystack of the passkey contexts and kvpress's samples."""
    return [doc["text"] for doc in json.loads(RAG_CORPUS.read_text(encoding="utf-8"))["documents"]]


def passkey_sample(lm: LoadedModel, haystack: list[int], context: int, settings: GateTraining,
                   generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """One multi-passkey context as ``duo_attn/data.py`` builds it → (ids [n], answer mask [n] bool).

    ``context`` haystack tokens with the needles at sorted random depths, then every question with its
    passkey; the labels are the question-and-answer tokens after the context.
    """
    tok = lm.tokenizer
    encode = lm.encode
    depths = torch.linspace(settings.depth_min, settings.depth_max, settings.depth_intervals)
    chosen = torch.randperm(settings.depth_intervals, generator=generator)[: settings.num_passkeys]
    depths = depths[chosen].sort().values
    words = torch.randint(len(PASSKEY_WORDS), (settings.num_passkeys, settings.passkey_length), generator=generator)
    passkeys = [encode(" ".join(PASSKEY_WORDS[i] for i in row)) for row in words.tolist()]
    hay, sep = haystack[:context], encode(SEPARATOR)
    body, last = [], 0
    for ordinal, depth, key in zip(ORDINALS, depths.tolist(), passkeys):
        at = int(len(hay) * depth)
        body += hay[last:at] + sep + encode(NEEDLE.format(ordinal=ordinal)) + key + sep
        last = at
    body += hay[last:]
    answers = []
    for ordinal, key in zip(ORDINALS, passkeys):
        answers += encode(QUESTION.format(ordinal=ordinal)) + key + sep
    prompt = tok(OPENING)["input_ids"] + body + encode(CLOSING)  # the opening with the tokenizer's specials
    mask = torch.tensor([False] * len(prompt) + [True] * len(answers))
    return prompt + answers, mask


@dataclass
class _GateRun:
    """What the gate attention function reads during one forward of the training."""

    gates: torch.Tensor  # [layers, kv_heads], requires grad
    sink: int
    recent: int
    teacher: dict[int, torch.Tensor]  # layer -> [1, heads, n, d] the full model's attention output
    record: bool  # True: the full forward (fill ``teacher``); False: the mixed one


_run: contextvars.ContextVar[_GateRun | None] = contextvars.ContextVar("kvlab_duo_gates", default=None)


def streaming_mask(n: int, sink: int, recent: int, window: int | None = None) -> torch.Tensor:
    """[n, n] bool: query i sees key j ≤ i when j < ``sink`` or i − j < ``recent`` (and i − j < ``window``)."""
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    seen = (k <= q) & ((k < sink) | (q - k < recent))
    return seen & (q - k < window) if window is not None else seen


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """Attention of query [1, H, n, d] over key/value [1, KV, n, d] where ``allowed`` [n, n] → [1, H, n, d]."""
    return attend(query, key, value, allowed[None, None].to(query.device), False, scale, softcap)


def _gate_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    sliding_window: int | None = None, softcap: float | None = None, **kwargs
                    ) -> tuple[torch.Tensor, None]:
    """The two forwards of the training (query [1, H, n, d], key/value [1, KV, n, d] → [1, n, H, d]).

    Recording: the model's own causal attention, kept as the teacher's. Mixed: per KV head,
    ``α · teacher + (1 − α) · streaming attention of this forward's own queries and keys``.
    """
    run = _run.get()
    assert run is not None, "the gate attention runs only inside train_gates"
    n, layer = query.shape[-2], module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if run.record:
        full = streaming_mask(n, n, n, sliding_window)  # a sink of every key: plain causal attention
        out = _attend(query, key, value, full, scale, softcap)
        run.teacher[layer] = out
    else:
        stream = _attend(query, key, value, streaming_mask(n, run.sink, run.recent, sliding_window), scale, softcap)
        alpha = run.gates[layer].clamp(0, 1).repeat_interleave(query.shape[1] // key.shape[1])[None, :, None, None]
        out = alpha * run.teacher[layer] + (1 - alpha) * stream
    return out.transpose(1, 2).contiguous(), None


def _with_attention(lm: LoadedModel, name: str) -> list[tuple[object, str]]:
    """Point every config of the model at attention function ``name``; returns what to restore."""
    configs = {id(m.config): m.config for m in lm.model.modules() if hasattr(m, "config")}
    saved = [(cfg, cfg._attn_implementation) for cfg in configs.values()]
    for cfg, _ in saved:
        cfg._attn_implementation = name
    return saved


def lr_factor(step: int, steps: int) -> float:
    """The authors' schedule: linear warm-up over the first fifth, cool-down over the last, floor 0.1."""
    fifth = max(1, steps // 5)
    return min(1.0, max((step + 1) / fifth, 0.1), max((steps - step) / fifth, 0.1))


def train_gates(lm: LoadedModel, settings: GateTraining = GateTraining(),
                on_step: Callable[[int, dict], None] | None = None) -> HeadPattern:
    """The authors' gate optimisation on ``lm`` (module docstring); ``on_step(step, losses)`` after each step."""
    from transformers import AttentionInterface

    f = lm.facts
    context_max = min(settings.context_max, f.context_length // 2)  # room for needles and answers
    if context_max < settings.context_min or settings.steps < 1:
        raise KvlabError(f"gate training needs steps ≥ 1 and contexts of {settings.context_min}…{context_max} "
                         f"tokens to fit the model's context of {f.context_length}")
    AttentionInterface.register(TRAIN_ATTENTION, _gate_attention)
    generator = torch.Generator().manual_seed(settings.seed)
    haystack = lm.encode(" ".join(haystack_texts()) * math.ceil(context_max / 2000 + 1))[:context_max]
    lengths = torch.linspace(settings.context_min, context_max, settings.context_intervals).int().tolist()
    gates = torch.full((f.n_layers, f.n_kv_heads), settings.initial_value, device=lm.device, requires_grad=True)
    optimizer = torch.optim.AdamW([gates], lr=settings.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, settings.steps))
    decoder = lm.model.get_decoder()
    history: list[dict] = []
    t0 = clock()
    with lm.lock:
        saved = _with_attention(lm, TRAIN_ATTENTION)
        try:
            order: list[int] = []
            for step in range(settings.steps):
                if not order:  # the authors' shuffled pass over the context lengths, again when spent
                    order = torch.randperm(len(lengths), generator=generator).tolist()
                ids, answer = passkey_sample(lm, haystack, lengths[order.pop()], settings, generator)
                with torch.no_grad():
                    gates.clamp_(0, 1)
                run = _GateRun(gates, settings.sink, settings.recent, {}, record=True)
                token = _run.set(run)
                try:
                    ids_t = torch.tensor([ids], device=lm.device)
                    positions = torch.arange(len(ids), device=lm.device)[None]
                    with torch.no_grad():
                        full = decoder(input_ids=ids_t, position_ids=positions, use_cache=False).last_hidden_state
                    run.record = False
                    mixed = decoder(input_ids=ids_t, position_ids=positions, use_cache=False).last_hidden_state
                finally:
                    _run.reset(token)
                mask = answer.to(lm.device)
                distill = (full[0, mask].float() - mixed[0, mask].float()).pow(2).mean(-1).mean()
                reg = gates.abs().mean()  # duo_attn/loss.py: the mean L1 norm
                loss = distill + settings.reg_weight * reg
                (gates.grad,) = torch.autograd.grad(loss, [gates])  # the gates only: no weight gradients
                optimizer.step()
                scheduler.step()
                losses = {"distill": distill.item(), "reg": reg.item(), "tokens": len(ids)}
                history.append(losses)
                if on_step is not None:
                    on_step(step, losses)
        finally:
            for cfg, name in saved:
                cfg._attn_implementation = name
    return HeadPattern(f.name, "trained", gates.detach().clamp(0, 1).cpu(), asdict(settings),
                       clock() - t0, history)


@torch.no_grad()
def on_the_fly(lm: LoadedModel, settings: OnTheFly = OnTheFly()) -> HeadPattern:
    """kvpress's estimate on ``lm`` (module docstring): per layer and KV head, in [0, 1]."""
    f = lm.facts
    t0 = clock()
    texts = haystack_texts()[: settings.num_samples]
    group = f.n_heads // f.n_kv_heads
    positions = torch.arange(settings.q_len)
    scores = torch.zeros(f.n_layers, f.n_kv_heads)
    for text in texts:
        ids = lm.encode(text)[: f.context_length]
        for layer, (q, k) in enumerate(capture_qk_layers(lm, ids, list(range(f.n_layers)))):
            # q [heads, n, d], k [kv_heads, n, d] before RoPE: their means repeated over q_len positions
            q_mean = q.mean(dim=1, keepdim=True).expand(-1, settings.q_len, -1)
            k_mean = k.mean(dim=1, keepdim=True).expand(-1, settings.q_len, -1)
            if f.has_rope:
                q_mean, k_mean = rotate(lm, q_mean, positions, layer), rotate(lm, k_mean, positions, layer)
            keys = k_mean.repeat_interleave(group, dim=0)  # [heads, q_len, d]
            weights = torch.softmax((q_mean[:, -1:] @ keys.transpose(1, 2)).squeeze(1) / f.head_dim ** 0.5, dim=-1)
            area = weights.cumsum(dim=-1).mean(dim=-1)  # [heads]
            scores[layer] += area.view(f.n_kv_heads, group).mean(dim=1) / len(texts)
    return HeadPattern(f.name, "on_the_fly", scores.clamp(0, 1), asdict(settings), clock() - t0)
