"""Tiny random models of every architecture kvlab accepts, each with an eager twin (built by ``kvlab.engine.tiny``).

The twin has the same weights and runs transformers' own eager attention, so a test holds
kvlab's attention against the model's definition rather than against kvlab itself.

They run on the CPU in float32 unless ``KVLAB_TEST_DEVICE`` (e.g. ``cuda``) and ``KVLAB_TEST_DTYPE``
(``bfloat16``, ``float16``) say otherwise (``make gpu-check``). "Equal" then means within ``TOL`` times the
reference's largest magnitude: float32 agrees to rounding, and half precision to a few units of its last
place (bfloat16 keeps 8 significant bits: 2^-8 ≈ 3.9e-3 per rounding, and a forward rounds many times).
Measured on the CPU: largest gap / largest value 2.5e-7 (float32), 1.8e-3 (float16), 2.4e-2 (bfloat16)
over the seven architectures. One key hidden from a query moves the tiny models' logits by 3–69 % of their
largest (``test_one_hidden_key_moves_the_models_own_logits_past_the_tolerance``): float32 and float16 tell
it from rounding on every architecture, bfloat16 not on the tiny Llama (3.0 %, under its 4 % tolerance).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch

from kvlab.engine.facts import LoadedModel
from kvlab.engine.tiny import ARCHITECTURES, VOCAB, WINDOW, tiny_model

__all__ = ["ARCHITECTURES", "DEVICE", "DTYPE", "TOL", "VOCAB", "WINDOW", "build", "close", "eager", "eager_forward",
           "greedy_agrees", "own_forward", "reference_mask"]

DEVICE = os.environ.get("KVLAB_TEST_DEVICE", "cpu")
DTYPE = os.environ.get("KVLAB_TEST_DTYPE", "float32")
TOLERANCES = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}  # relative to the largest magnitude
TOL = TOLERANCES[DTYPE]


def build(arch: str, **kwargs) -> tuple[LoadedModel, torch.nn.Module]:
    """``kvlab.engine.tiny.tiny_model`` on the test device in the test dtype."""
    return tiny_model(arch, device=DEVICE, dtype=getattr(torch, DTYPE), **kwargs)


@contextmanager
def eager(lm: LoadedModel) -> Iterator[None]:
    """The model's own attention (transformers' eager) for the block: the reference for a model with no eager twin
    (the embedded models, the ``tiny`` fixture). Nothing of kvlab's may run inside it."""
    before = lm.model.config._attn_implementation
    lm.model.set_attn_implementation("eager")
    try:
        yield
    finally:
        lm.model.set_attn_implementation(before)


@torch.no_grad()
def own_forward(module: torch.nn.Module, ids: list[int], offset: int = 0) -> tuple[torch.Tensor, list, list]:
    """``ids`` through ``module`` (an eager twin, or a model inside ``eager``) at positions ``offset``… → its logits
    [tokens, vocab] (float32) and each layer's keys and values [kv_heads, held, head_dim] from its own cache (a
    sliding layer's cache holds only its window's newest keys)."""
    device = next(module.parameters()).device
    out = module(input_ids=torch.tensor([ids], device=device), use_cache=True,
                 position_ids=torch.arange(offset, offset + len(ids), device=device)[None])
    layers = out.past_key_values.layers
    return out.logits[0].float(), [layer.keys[0] for layer in layers], [layer.values[0] for layer in layers]


def eager_forward(lm: LoadedModel, ids: list[int], offset: int = 0) -> tuple[torch.Tensor, list, list]:
    """``own_forward`` of a model with no eager twin, under ``eager``."""
    with eager(lm):
        return own_forward(lm.model, ids, offset)


def close(ours: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether ``ours`` equals ``reference`` within this dtype's tolerance (see the module's docstring)."""
    ours, reference = ours.float(), reference.float()
    return bool((ours - reference).abs().max() <= TOL * float(reference.abs().max()))


def greedy_agrees(tokens: list[int], logits: torch.Tensor) -> bool:
    """Whether each of ``tokens`` is the greedy choice of its row of the reference's ``logits`` [n, vocab]:
    exactly in float32; in half precision a near tie (the token's logit within the tolerance of the row's
    largest) may round either way, and agrees too."""
    if DTYPE == "float32":
        return tokens == logits.argmax(-1).tolist()
    logits = logits.float()
    chosen = logits.gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    return bool((logits.max(-1).values - chosen <= TOL * float(logits.abs().max())).all())


def reference_mask(lm: LoadedModel, n: int, hidden: set[int] | list[set[int]], after: int
                   ) -> dict[str, torch.Tensor] | torch.Tensor:
    """The model's own additive mask for ``n`` tokens where queries from ``after`` on cannot see keys ``hidden``.

    Causal, with each layer type's window; a dict per layer type where the model has layer types.
    ``hidden`` may be one set per KV head: then the mask is [1, heads, n, n], each query head hiding
    its KV head's keys.
    """
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    causal = k <= q
    per_head = [hidden] if isinstance(hidden, set) else hidden
    gone = torch.zeros(len(per_head), n, n, dtype=torch.bool)  # [1 or kv_heads, n, n]
    for head, keys in enumerate(per_head):
        if keys:
            gone[head, after:, sorted(keys)] = True
    gone = gone.repeat_interleave(lm.facts.n_heads // len(per_head), dim=0) if len(per_head) > 1 else gone

    dtype = lm.model.dtype

    def additive(allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None].to(lm.device)

    window = lm.facts.window
    full = additive(causal & ~gone)
    sliding = next((w for w in lm.facts.layer_windows if w is not None), None)
    windowed = additive(causal & ~gone & (q - k < sliding)) if sliding is not None else full
    types = getattr(lm.model.config, "layer_types", None)
    if types and getattr(lm.model.config, "model_type", "") != "mistral":
        return {"full_attention": full, "sliding_attention": windowed}
    return windowed if window(0) is not None else full
