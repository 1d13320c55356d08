"""Quest: selection by the page bound, exact attention over the pages read, Full when every page is read."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import VOCAB, build

from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import KVState
from kvlab.engine.paging import FULL, block_state_grid, read_block_grid
from kvlab.policies import make_policy
from kvlab.policies.quest import PageReads, Quest, page_bounds, pages_read
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


@torch.no_grad()
def test_reading_every_page_is_full_exactly() -> None:
    lm, _ = build("llama")
    ids = _ids(70)
    full, quest = KVState(lm), KVState(lm, reads=Quest(page_size=16).reads(80))  # 5 pages: all of them
    full.append(ids[:60])
    quest.append(ids[:60])
    quest.set_decoding(True)
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
