"""Quest: selection by the page bound, exact attention over the pages read, Full when every page is read."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import ARCHITECTURES, VOCAB, build, close

from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import KVState
from kvlab.engine.paging import FULL, block_state_grid, read_block_grid
from kvlab.policies import make_policy
from kvlab.policies.quest import PageReads, Quest, page_bounds, page_extremes, pages_read
from kvlab.viz.blocks import NOT_READ, block_bytes_figure, block_bytes_rows, block_map_figure
from kvlab.workloads.chat.records import turn_table
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings

TOL = 1e-4


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_bound_is_the_largest_score_a_page_allows() -> None:
    torch.manual_seed(0)
    key = torch.randn(1, 2, 12, 8)  # 2 KV heads, 3 pages of 4
    query = torch.randn(1, 4, 5, 8)  # 4 query heads: 0-1 read KV head 0, 2-3 KV head 1
    page = torch.arange(12) // 4
    bounds = page_bounds(query, key, page, 3)
    scores = query.view(1, 2, 2, 5, 8) @ key[:, :, None].transpose(-1, -2)  # [1, kv, group, q, 12]
    best = scores.view(1, 2, 2, 5, 3, 4).amax(-1).reshape(1, 4, 5, 3)
    assert (bounds >= best - 1e-5).all()
    # a page of one key: the bound is that key's score exactly
    single = page_bounds(query, key[:, :, :1], torch.zeros(1, dtype=torch.long), 1)
    assert torch.allclose(single[..., 0], scores[..., 0].reshape(1, 4, 5), atol=1e-5)


def test_pages_read_are_the_highest_bounds_before_the_own_page() -> None:
    bounds = torch.tensor([[[[5.0, 1.0, 9.0, 3.0, 7.0, 0.0]]]])  # one head, one query, 6 pages
    own = torch.tensor([5])
    assert pages_read(bounds, own, 3)[0, 0, 0].tolist() == [False, False, True, False, True, True]
    # the own page is read whatever its bound; pages after it never are
    assert pages_read(bounds, torch.tensor([3]), 3)[0, 0, 0].tolist() == [True, False, True, True, False, False]
    # ties: the earlier page
    tied = torch.tensor([[[[2.0, 2.0, 2.0, 0.0]]]])
    assert pages_read(tied, torch.tensor([3]), 3)[0, 0, 0].tolist() == [True, True, False, True]
    # a sign flip in the bound changes the choice
    assert pages_read(-bounds, own, 3)[0, 0, 0].tolist() == [False, True, False, True, False, True]


def test_sink_pages_are_read_within_the_budget_only_when_asked() -> None:
    bounds = torch.tensor([[[[0.0, 1.0, 9.0, 3.0, 7.0, 0.0]]]])  # page 0 has the lowest bound
    own = torch.tensor([5])
    assert pages_read(bounds, own, 3)[0, 0, 0].tolist() == [False, False, True, False, True, True]  # the authors'
    # one sink page takes one of the two pages the budget leaves besides the own page
    assert pages_read(bounds, own, 3, sink_pages=1)[0, 0, 0].tolist() == [True, False, True, False, False, True]
    assert Quest(sink_pages=1).min_budget() == 3 * 16


def reading_every_page() -> tuple[list[int], KVState, KVState]:
    """70 tokens, Full and a decoding Quest that reads all 5 pages, both after the first 60."""
    lm, _ = build("llama")
    ids = _ids(70)
    full, quest = KVState(lm), KVState(lm, reads=Quest(page_size=16).reads(80))
    full.append(ids[:60])
    quest.append(ids[:60])
    quest.set_decoding(True)
    return ids, full, quest


@torch.no_grad()
def test_reading_every_page_is_full_exactly() -> None:
    ids, full, quest = reading_every_page()
    assert torch.equal(full.append(ids[60:]), quest.append(ids[60:]))
    assert quest.reads.read_share == 1.0


@torch.no_grad()
def test_sparse_reads_equal_the_models_own_attention_with_the_unread_keys_masked() -> None:
    lm, reference = build("llama", layers=1)
    ids = _ids(70, seed=2)
    reads = Quest(page_size=8, dense_layers=0).reads(24)  # 3 pages of 8 out of up to 9
    seen: list[torch.Tensor] = []
    choose = reads.read_mask
    reads.read_mask = lambda *a: seen.append(choose(*a)) or seen[-1]  # type: ignore[method-assign]
    state = KVState(lm, reads=reads)
    state.append(ids[:64])
    state.set_decoding(True)
    ours = state.append(ids[64:])
    mask = seen[-1]  # [1, heads, 6, 70]: which keys each head's queries read
    assert mask.any(-1).all() and not mask[..., :64].all()
    causal = torch.ones(70, 70, dtype=torch.bool).tril()
    allowed = causal[None, None].expand(1, 4, 70, 70).clone()
    allowed[:, :, 64:] &= mask
    additive = torch.zeros(1, 4, 70, 70).masked_fill(~allowed, torch.finfo(torch.float32).min)
    own = reference(input_ids=torch.tensor([ids]), attention_mask=additive).logits[0, 64:]
    assert (ours - own).abs().max() < TOL
    assert 0 < reads.read_share < 1


@pytest.mark.slow
def test_quest_in_a_chat_keeps_every_key_and_counts_its_metadata(tiny: LoadedModel) -> None:
    session = ChatSession(tiny, ChatSettings(policies=("full", "quest"), budget=32, max_new_tokens=6,
                                             params={"quest": {"page_size": 8, "dense_layers": 1}}))
    session.run_turn("The locker code is 4127. The cat is called Miso and sleeps on the red chair all day.")
    turn = session.run_turn("What is the cat called?", golden="The cat is called Miso.")
    full, quest = turn.policies["full"], turn.policies["quest"]
    assert quest.error is None and quest.kl is not None and quest.kl > 0
    assert quest.cache_tokens == full.cache_tokens  # nothing evicted
    f = tiny.facts
    pages = sum(-(-n // 8) for n in quest.cache_tokens)
    assert quest.kv_bytes == full.kv_bytes + pages * 2 * f.n_kv_heads * f.head_dim * f.bytes_per_element
    assert 0 < quest.read_share < 1 and full.read_share is None
    assert make_policy("quest").reads(64) == PageReads(make_policy("quest"), 4)


def test_the_pages_the_last_query_read_are_the_ones_its_mask_let_through() -> None:
    reads = PageReads(Quest(page_size=4, dense_layers=1), page_budget=2)
    g = torch.Generator().manual_seed(3)
    query, key = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 24, 8, generator=g)  # 4 query heads, 2 KV
    assert reads.read_mask(query, key, 0, None) is None  # a dense layer reads every page
    mask = reads.read_mask(query, key, 1, None)  # [1, 4, 3, 24]
    last = mask[0, :, -1].view(2, 2, 6, 4).any(-1).any(1)  # [kv_heads, pages]: any head of the group, any slot
    pages = reads.pages_read_last()
    assert pages[0] == [list(range(6))] * 2
    assert pages[1] == [torch.nonzero(row).flatten().tolist() for row in last]
    assert all(5 in p and len(p) <= 2 * 2 for p in pages[1]) and pages[1] != pages[0]  # own page, ≤ budget per head
    assert reads.pages_read_last() == []  # forgotten once recorded: the next turn records its own


def test_a_chat_turn_records_the_pages_quest_read_and_the_bars_count_its_metadata(tiny: LoadedModel) -> None:
    session = ChatSession(tiny, ChatSettings(policies=("full", "quest"), budget=16, max_new_tokens=4, block_size=8,
                                             params={"quest": {"page_size": 8, "dense_layers": 1}}))
    turn = session.run_turn("The locker code is 4127. The cat is called Miso and sleeps on the red chair all day. "
                            "The dog is called Rex and sleeps by the door.", golden="Noted: Miso and Rex.")
    full, quest = turn.policies["full"], turn.policies["quest"]
    pages = -(-turn.total_tokens // 8)
    assert full.pages_read == [] and len(quest.pages_read) == tiny.facts.n_layers
    assert quest.pages_read[0] == [list(range(pages))] * tiny.facts.n_kv_heads  # the dense layer
    for heads in quest.pages_read[1:]:
        assert all(p[-1] == pages - 1 and len(p) <= 2 * 2 for p in heads)  # own page; 2 pages × 2 query heads
    read = read_block_grid(quest.pages_read, 8, turn.total_tokens, 8)
    assert read[0].all() and not read[1:].all()
    fig = block_map_figure(block_state_grid([torch.tensor(p) for p in quest.retained], turn.total_tokens, 8), "q",
                           read=read)
    z = np.asarray(fig.data[0].z)
    assert (z[: tiny.facts.n_kv_heads] == FULL).all() and (z == NOT_READ).sum() == (~read).sum()
    bars = block_bytes_figure(block_bytes_rows([full, quest]))
    table = turn_table([turn]).set_index("policy")
    assert list(bars.data[0].y) == pytest.approx(table.loc[["full", "quest"], "kv_kib"].tolist())
    assert bars.data[0].y[1] * 1024 > quest.blocks["bytes_retained"] == full.blocks["bytes_retained"]


def _masked_attention(query, key, value, allowed, scale, softcap=None):
    """Reference attention in float64 over the ``allowed`` [b, heads, 1, k] keys (GQA by repetition)."""
    group = query.shape[1] // key.shape[1]
    k, v = key.double().repeat_interleave(group, 1), value.double().repeat_interleave(group, 1)
    scores = query.double() @ k.transpose(-1, -2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.softmax(scores.masked_fill(~allowed, -torch.inf), -1) @ v


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("softcap, window", [(None, None), (30.0, None), (None, 30)])
def test_gathered_reads_equal_the_masked_reads(softcap, window, in_place, monkeypatch) -> None:
    """Both ways of reading the chosen slots, in place (the CPU kernel) and gathered (``attend``)."""
    from types import SimpleNamespace

    import kvlab.policies.quest as quest_module

    kernel, calls = quest_module.page_attention, []
    monkeypatch.setattr(quest_module, "page_attention", lambda *a: calls.append(a) or kernel(*a))
    if not in_place:
        monkeypatch.setattr(quest_module, "reads_in_place", lambda *_: False)

    from kvlab.engine.attention import forward_context, kvlab_attention
    g = torch.Generator().manual_seed(7)
    k_len, heads, kv_heads, d = 53, 4, 2, 8
    query, key, value = (torch.randn(2, n, s, d, generator=g) for n, s in ((heads, 1), (kv_heads, k_len),
                                                                           (kv_heads, k_len)))
    valid = torch.ones(2, k_len, dtype=torch.bool)
    valid[1, 40:45] = False  # row 1 is a shorter cache padded in a batch: its newest keys after the gap
    quest = Quest(page_size=4, dense_layers=0, sink_pages=1)
    reads, reference = quest.reads(20), quest.reads(20)  # 5 pages of the row's 12
    with forward_context(reads=[None, reads], valid=[valid]):
        ours = kvlab_attention(SimpleNamespace(layer_idx=0), query, key, value, None, scaling=0.3,
                               sliding_window=window, softcap=softcap)[0].transpose(1, 2)  # [2, heads, 1, d]
    allowed = valid[:, None, None, :].expand(2, heads, 1, k_len).clone()
    if window is not None:
        allowed &= (k_len - 1 - torch.arange(k_len) < window)
    read = reference.read_mask(query[1:], key[1:], 0, valid[1])  # the same choice, as a mask
    assert read is not None and not read[0, :, 0, valid[1]].all()
    allowed[1] &= read[0]
    assert (ours.double() - _masked_attention(query, key, value, allowed, 0.3, softcap)).abs().max() < 1e-5
    assert reads.keys_read == reference.keys_read and reads.pages_read_last() == reference.pages_read_last()
    assert len(calls) == in_place  # the sparse row's one read went the way asked


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@torch.no_grad()
def test_decoding_steps_equal_the_models_own_attention_with_the_unread_keys_masked(arch) -> None:
    lm, reference = build(arch, layers=1)
    ids = _ids(70, seed=5)
    reads = Quest(page_size=8, dense_layers=0).reads(24)  # 3 pages of 8 out of up to 9
    chosen: list[torch.Tensor | None] = []  # the slots each decoding step read, per query head (None: every slot)

    def read(*a):
        out = attend(*a)
        earlier, n_pages, _ = reads.last_read[a[3]]
        if earlier is None:
            chosen.append(None)
            return out
        own = torch.arange((n_pages - 1) * 8, a[1].shape[-2]).expand(earlier.shape[0], -1)
        chosen.append(torch.cat([(earlier[..., None] * 8 + torch.arange(8)).flatten(1), own], dim=1))
        return out

    attend = reads.decode
    reads.decode = read  # type: ignore[method-assign]
    state = KVState(lm, reads=reads)
    state.append(ids[:64])
    state.set_decoding(True)
    ours = torch.cat([state.append([token]) for token in ids[64:]])  # one query a step: the gathered reads
    heads, window = lm.facts.n_heads, lm.facts.window(0)
    q, k = torch.arange(70)[:, None], torch.arange(70)[None, :]
    allowed = ((k <= q) & ((q - k < window) if window is not None else True)).expand(heads, 70, 70).clone()
    if window is None:  # every key kept: a slot is its token's position
        assert len(chosen) == 6 and all(c is not None for c in chosen)
        for step, slots in enumerate(chosen):
            allowed[:, 64 + step] &= torch.zeros(heads, 70, dtype=torch.bool).scatter(1, slots, True)
        assert 0 < reads.read_share < 1
    dtype = lm.model.dtype
    additive = torch.zeros(1, heads, 70, 70, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min).to(lm.device)
    if getattr(lm.model.config, "layer_types", None) and lm.model.config.model_type != "mistral":
        additive = {"full_attention": additive, "sliding_attention": additive}
    own = reference(input_ids=torch.tensor([ids], device=lm.device), attention_mask=additive).logits[0, 64:]
    assert close(ours, own)


@torch.no_grad()
def test_decoding_steps_reading_every_page_are_full_exactly() -> None:
    ids, full, quest = reading_every_page()
    for token in ids[60:]:
        assert torch.equal(full.append([token]), quest.append([token]))
    assert quest.reads.read_share == 1.0


def _extremes_from_scratch(lay) -> tuple[torch.Tensor, torch.Tensor]:
    size = lay.pages.page_size
    complete = lay.keys.shape[-2] // size
    keys = lay.keys[:, :, : complete * size]
    return page_extremes(keys, torch.arange(complete * size) // size, complete)


@torch.no_grad()
def test_kept_page_extremes_equal_a_recomputation_after_appends_cuts_and_restores() -> None:
    lm, _ = build("llama")
    ids = _ids(90, seed=6)
    state = KVState(lm, reads=Quest(page_size=4, dense_layers=0).reads(12))

    def check() -> None:
        for lay in state.layers:
            assert lay.pages is not None and lay.pages.describes(lay.keys)
            low, high = _extremes_from_scratch(lay)
            assert torch.equal(lay.pages.low, low) and torch.equal(lay.pages.high, high)

    state.append(ids[:30])
    state.set_decoding(True)
    for token in ids[30:37]:  # pages complete one by one
        state.append([token])
    check()
    before = state.layers[0].pages
    snap = state.snapshot()
    state.append(ids[37:45])  # a fed reply: several queries, the masked path
    check()
    assert state.layers[0].pages.low.shape[1] > before.low.shape[1]
    state.generate(torch.zeros(VOCAB), 6, set())  # a generation's keys are dropped: the pages it had stay kept
    check()
    state.restore(snap)
    assert state.layers[0].pages is before  # the snapshot's own extremes, for the snapshot's keys
    state.drop_last(state.seen - 21)  # a cut inside the kept pages: the 5 whole pages before it stay
    assert state.layers[0].pages.slots == 20
    check()
    for lay in state.layers:  # keys replaced otherwise (a rotation, a copy): the extremes are taken again
        lay.keys = lay.keys.clone()
    state.append([ids[50]])
    check()


@torch.no_grad()
def test_batched_decoding_with_a_padded_quest_row_equals_each_cache_alone() -> None:
    from kvlab.engine.batched_decode import generate_batched
    lm, _ = build("llama")
    ids = _ids(90, seed=8)
    full, quest = KVState(lm), KVState(lm, reads=Quest(page_size=4, dense_layers=1).reads(16))
    full.append(ids[:80])  # longer: the Quest row is padded in the slab
    first = quest.append(ids[:61])[-1]
    quest.set_decoding(True)
    alone = quest.generate(first, 12, set())
    kept = quest.layers[1].pages
    together = generate_batched([full, quest], [full.append([ids[80]])[-1], first], 12, set())
    assert together[1] == alone and quest.layers[1].pages is kept  # its kept pages serve the slab's row


@pytest.mark.parametrize("sinks", [0, 2])
def test_the_compiled_page_choice_is_top_pages(sinks) -> None:
    """The CPU kernel's pages equal ``bounds_of`` + ``top_pages``'s, ties (pages with the same extremes) going to
    the earlier page, the sink pages first; its attention is over those pages' keys and the own page's."""
    from kvlab.engine.slot_reads import page_attention
    from kvlab.policies.quest import bounds_of, top_pages

    g = torch.Generator().manual_seed(11)
    heads, kv_heads, d, own, size, n = 6, 2, 8, 14, 4, 14 * 4 + 3
    low = torch.randn(kv_heads, own + 1, d, generator=g)  # a page more than the query's earlier ones: not read
    high = low + torch.rand(kv_heads, own + 1, d, generator=g)
    low[:, 9], high[:, 9] = low[:, 3], high[:, 3]  # two pages every head ranks alike
    query = torch.randn(1, heads, 1, d, generator=g)
    key, value = torch.randn(2, 1, kv_heads, n, d, generator=g)
    out, pages = page_attention(query, key, value, low, high, own, 5, sinks, size, n, None, None, 0.3, None)
    expected = top_pages(bounds_of(query, low[:, :own], high[:, :own])[0, :, 0], 5, sinks)
    assert torch.equal(pages, expected)
    if sinks:
        assert (pages[:, :sinks] == torch.arange(sinks)).all()
    read = torch.zeros(heads, n, dtype=torch.bool).scatter(1, (pages[..., None] * size + torch.arange(size)).flatten(1),
                                                           True)
    read[:, own * size :] = True
    allowed = read[None, :, None]  # [1, heads, 1, n]
    assert (out.double() - _masked_attention(query, key, value, allowed, 0.3)).abs().max() < 1e-5


def test_the_kernels_exp_is_maths_exp_to_float32_rounding() -> None:
    """The kernel's vectorized exp of w − max(w): within 2 ulp of float64's, 0 for −inf and below e^−87."""
    from kvlab.engine.slot_reads import _exp_shifted

    w = np.concatenate([np.linspace(-90, 3, 20001), [-np.inf, 3.0]]).astype(np.float32)
    got = w.copy()
    _exp_shifted(got, np.float32(3.0), np.empty(w.size, np.int32))
    shifted = w - np.float32(3.0)  # the kernel's own float32 difference
    exact = np.exp(shifted.astype(np.float64))
    normal = shifted > -87
    assert (np.abs(got[normal] - exact[normal]) <= 2 * np.spacing(exact[normal].astype(np.float32))).all()
    assert (got[~normal] == 0).all() and got[-2] == 0 and got[-1] == 1


@pytest.mark.parametrize("layout", ["contiguous", "cache rows with free slots", "a slab's row", "transposed"])
def test_head_rows_reads_each_query_heads_slots_from_its_kv_head(layout: str) -> None:
    from kvlab.engine.sparse import head_rows

    kv_heads, k, d, group = 3, 40, 8, 3
    whole = torch.randn(2, kv_heads, k + 9, d)
    t = {"contiguous": whole[0, :, :k].contiguous(), "cache rows with free slots": whole[0, :, :k],
         "a slab's row": whole[1, :, :k], "transposed": whole[0, :, :k].transpose(0, 1).contiguous().transpose(0, 1)}[
        layout]
    slots = torch.stack([torch.randperm(k)[:12] for _ in range(kv_heads * group)])  # [H, n]
    want = torch.stack([t[h // group, slots[h]] for h in range(kv_heads * group)])[None]
    assert torch.equal(head_rows(t, slots), want)
