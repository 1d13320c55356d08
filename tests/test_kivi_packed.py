"""KIVI holds what it counts (issue 23 item 3): packed codes decode to exactly the old quantize–dequantize,
and the bytes reported are the bytes of the tensors the cache holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvlab.engine.cache import SlotLayer
from kvlab.engine.kvstate import KVState
from kvlab.engine.packed import pack_codes, unpack_codes
from kvlab.engine.quantization import Kivi, quantize_keys, quantize_values
from kvlab.engine.tiny import tiny_model
from kvlab.policies.evict import keep_per_head


class DenseKivi(Kivi):
    """The quantization as it was before the packed store: quantize, then keep the dequantized values in the
    layer's float tensors (the reference the packed store must reproduce bit for bit)."""

    def quantize(self, layer) -> bool:
        keys, values = layer.keys[0], layer.values[0]  # [kv_heads, slots, head_dim]
        unit = self.residual or self.group
        new_keys, new_values = keys.clone(), values.clone()
        key_done, value_done = layer.key_quantized.clone(), layer.value_quantized.clone()
        for head in range(keys.shape[0]):
            k_first, k_open = int(key_done[head].sum()), int((~key_done[head]).sum())
            chunk = (k_open // unit) * unit
            if chunk:
                span = slice(k_first, k_first + chunk)
                new_keys[head, span] = quantize_keys(keys[head, span], self.bits, self.group).to(keys.dtype)
                key_done[head, span] = True
            v_first, v_open = int(value_done[head].sum()), int((~value_done[head]).sum())
            if v_open > self.residual:
                span = slice(v_first, v_first + v_open - self.residual)
                new_values[head, span] = quantize_values(values[head, span], self.bits, self.group).to(values.dtype)
                value_done[head, span] = True
        changed = not (torch.equal(key_done, layer.key_quantized) and torch.equal(value_done, layer.value_quantized))
        if changed:
            layer.keys, layer.values = new_keys[None], new_values[None]
            layer.key_quantized, layer.value_quantized = key_done, value_done
        return changed

    def layer_bytes(self, layer, head_dim: int, bytes_per_element: int) -> int:
        """The formula on the flags alone, as before: whole key groups."""
        flags = SimpleNamespace(key_quantized=layer.key_quantized, value_quantized=layer.value_quantized)
        return super().layer_bytes(flags, head_dim, bytes_per_element)


def held_nbytes(layer: SlotLayer) -> int:
    """Bytes of every tensor a layer holds for its committed keys and values, summed from ``nbytes``."""
    if layer.packed is None:
        return layer.keys[:, :, : layer.held].nbytes + layer.values[:, :, : layer.held].nbytes
    p = layer.packed
    after = layer.held - p.slots
    return sum(t.nbytes for t in (p.key_full, p.key_codes, p.key_low, p.key_high, p.value_full, p.value_codes,
                                  p.value_low, p.value_high)) + after * 2 * layer.keys[:, :, :1].nbytes


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_codes_pack_into_bytes_lowest_bits_first(bits: int) -> None:
    q = torch.randint(0, 1 << bits, (5, 64), generator=torch.Generator().manual_seed(bits)).float()
    packed = pack_codes(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 64 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits, 64), q)
    assert int(packed[0, 0]) == sum(int(q[0, i]) << (bits * i) for i in range(8 // bits))  # new_pack.py's order


def same_cache(a: KVState, b: KVState) -> bool:
    return all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers))


@pytest.mark.parametrize("bits,mode", [(2, "original"), (4, "original"), (2, "rerotated")])
def test_the_packed_store_decodes_to_the_old_dequantized_values(bits: int, mode: str) -> None:
    """Appends, an eviction out of quantized groups, a rotation, a reply, ``drop_last`` and a restored snapshot:
    the packed cache reads as the dense one, its logits are the same, and its bytes are its tensors'."""
    lm, _ = tiny_model("llama", hidden_size=128)  # head_dim 32, 2 KV heads
    packed, dense = KVState(lm, mode, quant=Kivi(bits, 8, 16)), KVState(lm, mode, quant=DenseKivi(bits, 8, 16))
    ids = torch.randint(0, 100, (200,), generator=torch.Generator().manual_seed(1)).tolist()

    def both(step) -> None:
        out = [step(s) for s in (packed, dense)]
        if isinstance(out[0], torch.Tensor):
            assert torch.equal(out[0], out[1])
        else:
            assert out[0] == out[1]
        assert same_cache(packed, dense)
        for lay in packed.layers:
            assert held_nbytes(lay) == packed.quant.layer_bytes(lay, lm.facts.head_dim, lm.facts.bytes_per_element)
        assert packed.kv_bytes() == sum(held_nbytes(lay) for lay in packed.layers)

    both(lambda s: s.append(ids[:70]))
    assert all(lay.packed is not None and lay.packed.key_codes.dtype == torch.uint8 for lay in packed.layers)
    assert packed.kv_bytes() == dense.kv_bytes()  # whole groups: the old formula, now measured
    snap = packed.snapshot(), dense.snapshot()
    both(lambda s: s.append(ids[70:100]))

    def evict(s: KVState) -> None:
        for layer, lay in enumerate(s.layers):
            scores = torch.rand(lay.real.shape, generator=torch.Generator().manual_seed(layer))
            s.keep(layer, keep_per_head(scores, 50))
        s.realign()

    both(evict)
    assert packed.kv_bytes() <= sum(held_nbytes(lay) for lay in dense.layers)
    both(lambda s: s.append(ids[100:140]))
    both(lambda s: s.generate(s.append(ids[140:141])[-1], 4, set()))
    both(lambda s: s.drop_last(1))
    both(lambda s: s.append(ids[141:160]))
    both(lambda s: s.restore(snap[0] if s is packed else snap[1]))
    assert packed.kv_bytes() == dense.kv_bytes()
    both(lambda s: s.append(ids[160:190]))


def test_an_evicted_group_keeps_its_min_and_max_and_a_rotated_key_leaves_the_store() -> None:
    layer = SlotLayer(kv_heads=2, device=torch.device("cpu"))
    keys, values = torch.randn(2, 1, 2, 64, 32, generator=torch.Generator().manual_seed(0))
    layer.update(keys, values)
    layer.record(torch.arange(64), torch.arange(64))
    kivi = Kivi(bits=2, group=8, residual=16)
    assert kivi.quantize(layer)
    assert len(layer.packed.key_low) == 2 * 64 // 8 and len(layer.packed.value_codes) == 2 * 48
    keep = torch.zeros(2, 64, dtype=torch.bool)
    keep[:, ::8] = True  # one key of every group stays
    before = layer.keys[:, :, ::8]
    layer.keep(keep)
    assert torch.equal(layer.keys, before) and len(layer.packed.key_low) == 2 * 64 // 8
    turned = layer.keys.clone()
    turned[:, 0, 0] += 1  # head 0's oldest key moves off its grid
    layer.keys = turned
    assert torch.equal(layer.keys, turned) and int((layer.key_group >= 0).sum()) == 2 * 8 - 1
    assert held_nbytes(layer) == kivi.layer_bytes(layer, 32, 4)


def test_uneven_heads_quantize_after_their_padding() -> None:
    layer = SlotLayer(kv_heads=2, device=torch.device("cpu"))
    keys, values = torch.randn(2, 1, 2, 40, 32, generator=torch.Generator().manual_seed(0))
    layer.update(keys, values)
    layer.record(torch.arange(40), torch.arange(40))
    keep = torch.ones(2, 40, dtype=torch.bool)
    keep[1, :8] = False  # head 1 keeps 32 keys: 8 slots of padding on its left
    layer.keep(keep)
    assert Kivi(bits=4, group=8, residual=16).quantize(layer)
    assert layer.key_quantized.sum(-1).tolist() == [32, 32] and layer.value_quantized.sum(-1).tolist() == [24, 16]
    assert not (layer.key_quantized & ~layer.real).any()  # no padding slot is packed
    assert torch.equal(layer.keys[0, 1, 8:40], quantize_keys(keys[0, 1, 8:40], 4, 8))
    assert torch.equal(layer.values[0, 1, 8:24], quantize_values(values[0, 1, 8:24], 4, 8))
    assert torch.equal(layer.values[0, 1, 24:], values[0, 1, 24:])


def test_kivi_2_holds_the_formulas_share_of_full_at_2k_tokens_measured_from_its_tensors() -> None:
    """A layer shaped like SmolLM2-135M's (3 KV heads, head_dim 64, float32), 2048 tokens, the bench's KIVI-2."""
    layer = SlotLayer(kv_heads=3, device=torch.device("cpu"))
    keys, values = torch.randn(2, 1, 3, 2048, 64, generator=torch.Generator().manual_seed(0))
    layer.update(keys, values)
    layer.record(torch.arange(2048), torch.arange(2048))
    full = held_nbytes(layer)
    kivi = Kivi(bits=2, group=32, residual=128)
    kivi.quantize(layer)
    share = held_nbytes(layer) / full
    assert held_nbytes(layer) == layer.packed_bytes() == kivi.layer_bytes(layer, 64, 4)
    assert share == pytest.approx(159744 / 1048576) and round(share, 2) == 0.15
