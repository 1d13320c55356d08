"""Cross-layer K/V sharing: layouts, the layer loop's exactness, prefix reuse under sharing, similarity."""

from __future__ import annotations

import weakref

import pytest
import torch
from tiny_models import ARCHITECTURES, build, close, eager_forward, own_forward
from transformers import DynamicCache

from kvlab.errors import KvlabError
from kvlab.sharing import forward
from kvlab.sharing.forward import adjacent_similarity, check_supported, crop_kv, shared_forward, sharing_refusal
from kvlab.sharing.schemes import make_scheme, parse_schemes
from kvlab.workloads.code.session import deep_similarity, measure_sharing, reuse_spans, similarity_frame

CODE = "def add(a, b):\n    return a + b\n\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n" * 3


def test_layouts():
    assert make_scheme("cla1", 5).producers == (0, 1, 2, 3, 4)
    assert make_scheme("cla2", 5).producers == (0, 0, 2, 2, 4)
    assert make_scheme("CLA-3", 7).producers == (0, 0, 0, 3, 3, 3, 6)
    yoco = make_scheme("yoco", 6)
    assert yoco.producers == (0, 1, 2, 3, 3, 3) and yoco.upper_start == 3
    assert (yoco.kv_layers, yoco.claim_share, yoco.label) == (4, 4 / 6, "YOCO")
    assert [s.name for s in parse_schemes("cla2, yoco,cla2,full", 30)] == ["cla2", "yoco", "full"]
    for bad in ("cla0", "mla", "cla31", "", "cla2,,yoco"):
        with pytest.raises(KvlabError):
            parse_schemes(bad, 30)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny", pytest.param("model", marks=pytest.mark.model)])
def test_cla1_equals_the_unshared_model(fixture, request):
    lm = request.getfixturevalue(fixture)
    check_supported(lm)
    ids = lm.encode(CODE)
    ref, keys, _ = eager_forward(lm, ids)  # transformers' own eager attention
    for name in ("cla1", "full"):
        ours, kv = shared_forward(lm, ids, make_scheme(name, lm.facts.n_layers), last_n=len(ids))
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= 1e-4
        assert sorted(kv) == list(range(lm.facts.n_layers))
    # the loop's K/V are the model's own cache entries
    assert torch.allclose(kv[lm.facts.n_layers - 1][0][0], keys[-1], atol=1e-4)


@pytest.mark.slow
def test_cla2_shares_the_producers_kv(tiny):
    ids = tiny.encode(CODE)
    logits, kv = shared_forward(tiny, ids, make_scheme("cla2", 4), last_n=len(ids))
    assert sorted(kv) == [0, 2]  # only producers keep K/V: half the memory
    own, keys, _ = eager_forward(tiny, ids)
    assert torch.allclose(kv[0][0][0], keys[0], atol=1e-5)  # layer 0 sees the same input either way
    assert not torch.allclose(logits, own, atol=1e-3)  # sharing changes the output


def test_yoco_prefill_skips_the_upper_half_exactly(tiny):
    ids = tiny.encode(CODE)
    yoco = make_scheme("yoco", 4)
    every, kv = shared_forward(tiny, ids, yoco, last_n=len(ids))  # upper half for every position
    last, _ = shared_forward(tiny, ids, yoco, last_n=1)  # upper half for the last token only
    assert sorted(kv) == [0, 1, 2]
    assert torch.allclose(last[-1], every[-1], atol=1e-5)


@pytest.mark.parametrize("name", ["full", "cla2", "cla3", "yoco"])
def test_prefix_reuse_under_sharing_is_exact(tiny, name):
    scheme = make_scheme(name, 4)
    ids = tiny.encode(CODE)
    whole, _ = shared_forward(tiny, ids, scheme, last_n=4)
    _, kv = shared_forward(tiny, ids[:30] + [7, 8, 9], scheme)  # a different tail, then cut back to 30
    reused, kv2 = shared_forward(tiny, ids, scheme, crop_kv(kv, 30), start=30, last_n=4)
    assert torch.allclose(reused, whole, atol=1e-4)
    assert all(k.shape[-2] == len(ids) for k, _ in kv2.values())


def test_adjacent_similarity_by_hand():
    x = torch.randn(1, 2, 5, 4)
    orth = torch.zeros(1, 2, 5, 4)
    orth[..., 0] = 1.0
    other = torch.zeros(1, 2, 5, 4)
    other[..., 1] = 1.0
    cache = DynamicCache()
    for layer, (k, v) in enumerate([(x, orth), (2 * x, other), (-x, orth)]):
        cache.update(k, v, layer)
    sim = adjacent_similarity(cache)
    assert torch.allclose(sim["k"], torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), atol=1e-6)
    assert torch.allclose(sim["v"], torch.zeros(2, 2), atol=1e-6)
    frame = similarity_frame(sim)
    assert len(frame) == 2 * 2 * 3  # K/V × layer pairs × (2 heads + mean)
    assert frame.query("tensor == 'K' and layer == 1 and head == 'mean'")["cosine"].item() == pytest.approx(-1.0)
    assert deep_similarity(frame) == pytest.approx({"K": -1.0, "V": 0.0}, abs=1e-6)  # the deeper pair of two


def test_measure_sharing_over_edits(tiny):
    texts = [CODE, CODE.replace("return a + b", "return a - b"), CODE + "# end\n"]
    schemes = [make_scheme("cla1", 4), make_scheme("cla2", 4), make_scheme("yoco", 4)]
    summary, times = measure_sharing(tiny, texts, schemes, positions=8)
    rows = summary.set_index("scheme")
    assert list(rows.index) == ["Full", "CLA-1", "CLA-2", "YOCO"]
    assert rows.loc["CLA-1", "kl_mean"] <= 1e-6 and rows.loc["CLA-1", "top1"] == 1.0
    assert rows.loc["CLA-1", "compute_share"] == 1.0 and rows.loc["CLA-2", "kv_bytes_share"] == 0.5
    assert rows.loc["YOCO", "compute_share"] < rows.loc["CLA-2", "compute_share"] < 1.0
    assert len(times) == 2 * 4 and (times["reprefill_ms"] > 0).all()
    assert len(reuse_spans(tiny, texts)) == 2
    # timed in rounds beside Full: its own ratio is exactly 1, the others the median of each round's ratio
    summary, times = measure_sharing(tiny, texts[:2], schemes[1:2], positions=8, repeats=3)
    assert list(summary["runs"]) == [3, 3] and summary["prefill_time_ratio"].iloc[0] == 1.0
    assert list(times["runs"]) == [3, 3] and (summary["prefill_time_ratio"] > 0).all()


def test_measure_sharing_holds_one_cache_per_scheme_not_the_first_prefills_too(tiny, monkeypatch):
    from kvlab.workloads.code import session as code_session

    first: list[weakref.ref] = []  # the storage of the first prefill's keys, one per scheme: a view keeps it too
    real = code_session.shared_forward

    def watched(lm, ids, scheme, kv=None, start=0, last_n=1):
        logits, out = real(lm, ids, scheme, kv, start, last_n)
        if kv is None:
            first.append(weakref.ref(out[0][0].untyped_storage()))
        return logits, out

    alive = []

    def progress(fraction: float, text: str) -> None:
        if text.startswith("re-prefill after edit 2"):  # the first edit's re-prefills replaced every first cache
            alive.append(sum(r() is not None for r in first))

    monkeypatch.setattr(code_session, "shared_forward", watched)
    texts = [CODE, CODE.replace("return a + b", "return a - b"), CODE + "# end\n"]
    measure_sharing(tiny, texts, [make_scheme("cla2", 4)], positions=8, progress=progress)
    assert len(first) == 2 and alive == [0]


SHARING_RUNS = {"llama", "qwen3"}  # the Llama layout without windows; the others' layers differ from it


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_sharing_either_runs_an_architecture_exactly_or_refuses_it_in_words(arch):
    lm, reference = build(arch)
    from kvlab.lessons import LESSONS

    if arch not in SHARING_RUNS:
        with pytest.raises(KvlabError, match="not available|Llama-style") as refused:  # never a raw error
            check_supported(lm)
        # the code page and the sharing lesson say it before any click
        assert sharing_refusal(lm) == str(refused.value) == LESSONS["sharing"].unavailable(lm)
        return
    assert sharing_refusal(lm) is None and LESSONS["sharing"].unavailable(lm) is None
    check_supported(lm)
    ids = list(range(5, 29))
    ours, _ = shared_forward(lm, ids, make_scheme("cla1", lm.facts.n_layers), last_n=len(ids))
    assert close(ours, own_forward(reference, ids)[0])


def test_the_sharing_probe_runs_once_per_loaded_model(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages ask on every draw and every measurement asks again: two forwards each time would add up."""
    calls = []
    monkeypatch.setattr(forward, "_REFUSALS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(forward, "check_supported", lambda lm: calls.append(lm))
    assert [sharing_refusal(tiny) for _ in range(3)] == [None] * 3 and len(calls) == 1
