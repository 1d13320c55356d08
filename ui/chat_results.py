"""The chat page's results: a turn picker and what each cache did on the picked turn, in tabs (attention sinks,
kept tokens, paged blocks, fidelity, the replies, DuoAttention's heads), for a live session or a saved one."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvlab.engine.facts import LoadedModel
from kvlab.engine.paging import block_state_grid, read_block_grid
from kvlab.viz.blocks import block_bytes_figure, block_bytes_rows, block_map_figure
from kvlab.viz.chat import (
    attention_profile,
    divergence_html,
    duo_heads_figure,
    fidelity_lines,
    retained_animation,
    sink_heatmap,
)
from kvlab.workloads.chat.records import TurnResult, failures, turn_table
from kvlab.workloads.chat.session_file import ChatRecord
from kvlab.workloads.chat.settings import ChatSettings
from ui.tables import RESULT_HEADERS, compact_table, mark, marked, past_marked

PAST_CONTEXT = (
    "**past trained context** ⚠: the policy's queries sat at rotary positions past the model's trained context this "
    "turn (**largest position** is its largest): the model never saw them in training, so its scores "
    "there are not like the others; where Full is past it, every KL and top-1 is measured against that reference. "
    "In re-rotated mode a bounded cache keeps its positions inside the cache; Full's grow with the conversation.")
TIME_COLUMNS = (
    "**largest position** is the largest rotary position a policy's queries reached in the turn, its own reply "
    "included: a policy whose own reply ran longer than Full's (which the conversation keeps) reached past the "
    "**conversation tokens**. Times: **turn s** is the whole turn, every policy together (one run, wall clock). The"
    " policies run together, so the forwards that feed and decode every cache at once are split evenly: **shared "
    "s**, the same for every policy of a batch, says nothing about which policy is cheaper. **own s** is work only "
    "that policy ran: its eviction step (**eviction ms**) and any pass of its own on top of the prefills (**extra "
    "prefill s**: KVzip's reconstruction, the oracle's run of Full over the script).")


def show_turns(shown: ChatRecord, lm: LoadedModel) -> None:
    """The picked turn of ``shown`` (the newest when a turn was added), tab by tab; ``lm`` tokenizes the replies."""
    state = st.session_state
    turns = shown.turns
    if state.get("chat_turns_seen") != len(turns):  # a new turn: show it, whatever turn was picked before
        state.chat_turns_seen = state.chat_turn = len(turns)
    pick = 1 if len(turns) == 1 else st.select_slider("Show turn", options=list(range(1, len(turns) + 1)),
                                                      persist_state="session", key="chat_turn")
    turn = turns[pick - 1]
    names = [n for n in turn.policies if turn.policies[n].error is None]
    for n, (k, error) in failures(turns[:pick]).items():  # the session goes on without it: no score from turn k on
        when = "this turn" if k == pick else f"turn {k}"
        st.error(f"**{n}** failed on {when} and was dropped from the session (no score from then on): {error}")

    tab_names = ["Attention sinks", "Retained tokens", "Paged blocks", "Fidelity", "Replies"]
    tab_sink, tab_kept, tab_blocks, tab_fid, tab_replies, *tab_heads = st.tabs(
        tab_names + (["Head pattern"] if shown.heads else []))
    with tab_sink:
        _sinks(turn, shown.settings, names, pick)
    with tab_kept:
        _kept(shown, names, pick)
    with tab_blocks:
        _blocks(turn, shown, names, pick)
    with tab_fid:
        _fidelity(turns, shown.settings)
    with tab_replies:
        _replies(turn, lm)
    for tab in tab_heads:
        with tab:
            _heads(shown)


def _sinks(turn: TurnResult, settings: ChatSettings, names: list[str], pick: int) -> None:
    """A policy's attention on the first tokens, layer by head, and Full's attention profile over the conversation."""
    who = st.selectbox("Policy", names, persist_state="session", key="chat_sink_policy")
    # the statistics are the message prefill's: a shorter message has fewer queries than the setting
    asked = next((g["end"] - g["start"] for g in turn.segments if g["turn"] == turn.index and g["role"] == "user"),
                 settings.stat_queries)
    st.plotly_chart(sink_heatmap(turn.policies[who].sink_mass, settings.sink_tokens, f"{who} (turn {pick})",
                                 [f"attention of the last {min(asked, settings.stat_queries)} queries of the message "
                                  f"on the first {settings.sink_tokens} tokens"]),
                    width="stretch", key="chat_sink_fig")
    n_layers = len(turn.profile)  # the records' model, which need not be the sidebar's
    if st.session_state.get("chat_profile_layer", 0) > n_layers - 1:  # kept from a deeper model: a slider refuses it
        st.session_state.chat_profile_layer = n_layers // 2
    layer = st.slider("Layer for the attention profile", 0, n_layers - 1, n_layers // 2,
                      persist_state="session", key="chat_profile_layer")
    st.plotly_chart(attention_profile(turn.profile, layer, turn.segments), width="stretch", key="chat_profile_fig")


def _kept(shown: ChatRecord, names: list[str], pick: int) -> None:
    """Each policy's kept tokens turn by turn, opened on the picked turn."""
    windows = shown.windows
    if any(windows):
        st.caption("Layers marked “window” are the model's own sliding-window layers: they drop keys further back "
                   "than their trained window under every policy, Full included — compare with StreamingLLM's "
                   "imposed window.")
    st.caption("Each map opens on the turn picked above; ▶ Play shows eviction turn by turn (the slider picks one). "
               + ("Hover a cell for the token's text." if shown.texts else
                  "This file kept no token texts (saved by an older kvlab): cells show positions only."))
    for n in names:
        if n == "full" and not any(windows):  # without trained windows Full keeps everything
            continue
        # a policy that failed is dropped from then on: its good turns are a prefix of the conversation
        done = [t for t in shown.turns if n in t.policies and t.policies[n].error is None]
        steps = [{"retained": t.policies[n].retained, "total": t.total_tokens, "segments": t.segments} for t in done]
        st.plotly_chart(retained_animation(steps, f"{n}: kept tokens", windows, shown.texts,
                                           active=min(pick, len(steps))),
                        width="stretch", key=f"chat_kept_{n}")


def _blocks(turn: TurnResult, shown: ChatRecord, names: list[str], pick: int) -> None:
    """Bytes each policy holds against its budget, and one policy's paged blocks (for Quest, the pages read)."""
    settings = shown.settings
    bytes_rows = block_bytes_rows([turn.policies[n] for n in names])
    st.plotly_chart(block_bytes_figure(bytes_rows, turn.index + 1), width="stretch",
                    key="chat_bytes_fig")
    memory = turn_table([turn])[["policy", "budget_tokens", "budget_kib", "kv_kib", "held_vs_budget", "held_share",
                                 "free_blocks", "fragmented_blocks", "full_blocks"]]
    data, config = compact_table(memory, RESULT_HEADERS, pinned="policy")
    st.dataframe(data, hide_index=True, width="stretch", placeholder="—", column_config=config)
    whole, left = divmod(turn.total_tokens, settings.block_size)
    tail = (f"The last block holds the {left} positions left over ({turn.total_tokens:,} = {whole} × "
            f"{settings.block_size} + {left}), so it is full when they are all kept: the slots an allocator leaves "
            "empty at the end for the next tokens are not counted." if left else "")
    st.caption("**budget allows KiB**: the K/V its budget allowed at the turn's last compression (—: no budget bounds "
               "what it holds); **K/V held KiB**: what it held after the turn; **held vs budget**: over it where a "
               "policy's minimum holds more than its budget allows (a small % of Full's, PyramidKV's integer floors); "
               "**held / Full's**: what it held over Full's. "
               "**Free / fragmented / full blocks**: blocks of the conversation's positions with none, some or all of "
               f"their tokens kept, in every layer and KV head. {tail}")
    who = st.selectbox("Block map of", [n for n in names if n != "full"] or names,
                       persist_state="session", key="chat_block_policy")
    rec = turn.policies[who]
    grid = block_state_grid(rec.retained, turn.total_tokens, settings.block_size)
    read = (read_block_grid(rec.pages_read, settings.params[who]["page_size"], turn.total_tokens,
                            settings.block_size) if rec.pages_read else None)
    if read is not None:
        st.caption(f"{who} keeps every key and reads only some pages per query: dark blocks were read by the turn's "
                   "last decoding query (its own page and the pages whose min/max bound on q·k is highest, by any "
                   "query head of the KV head); light blue blocks are held but were not read. The first "
                   f"{settings.params[who]['dense_layers']} layers read everything. The bars count its page "
                   "metadata (a min and a max key per page) in what it holds, as the table does.")
    st.plotly_chart(block_map_figure(grid, f"{who}: blocks of {settings.block_size} tokens after turn {pick}",
                                     block_size=settings.block_size, total_tokens=turn.total_tokens,
                                     windows=shown.windows, read=read),
                    width="stretch", key="chat_block_fig")


def answers_shown(table: pd.DataFrame) -> pd.DataFrame:
    """The turn table's answer checks as marks, or without its answer columns where no turn has an answer to check
    (by the turns' metrics, not the marks: a chat where every answer was wrong keeps its ✗)."""
    return table.drop(columns=["correct", "metric"]) if table["metric"].isna().all() else marked(table, "correct")


def _fidelity(turns: list[TurnResult], settings: ChatSettings) -> None:
    """Every policy's fidelity to Full turn by turn, as lines and as the table."""
    table = turn_table(turns)
    st.plotly_chart(fidelity_lines(table), width="stretch", key="chat_fid_fig")
    st.caption("**mean KL** and **top-1 agreement** are taken over every token the turn feeds each cache after the "
               "message: the reply every cache is fed (Full's, or the script's golden one) and the chat template's "
               "end-of-turn marker after it, which the next turn's context holds too. A reply cut at 8 tokens is "
               "scored over those 8 and the marker's tokens.")
    shown = answers_shown(table)
    data, config = compact_table(past_marked(shown), RESULT_HEADERS, pinned="policy", quiet=("past_context",))
    st.dataframe(data, hide_index=True, width="stretch", placeholder="—",  # "—": no number (Full's budget, a failure)
                 column_config=config)
    if table.past_context.any():
        st.caption(PAST_CONTEXT)
    for name, (residual, held) in settings.unquantized(turns[-1]).items():
        st.caption(f"**{name}** has quantized nothing yet: it keeps its newest {residual} tokens at full precision "
                   f"(its residual) and holds {held:g} tokens after turn {turns[-1].index + 1}, so its cache is still "
                   "at the model's precision.")
    st.caption(TIME_COLUMNS)


def _replies(turn: TurnResult, lm: LoadedModel) -> None:
    """Each policy's own reply beside Full's, from the first token where it leaves Full's."""
    st.caption("Each policy's own greedy reply from its own cache. Highlighted: the first token where it leaves "
               "Full's reply; greyed: what follows from there. ✓ / ✗: the turn's answer found or not.")
    reference = lm.encode(turn.policies["full"].reply)
    cols = st.columns(min(len(turn.policies), 2))  # two cards a row: three left a reply a few words wide
    for i, (n, rec) in enumerate(turn.policies.items()):
        with cols[i % len(cols)].container(border=True):
            if rec.error:
                st.markdown(f"**{n}** · failed, no score")
                continue
            answer = "" if rec.correct is None else f" {mark(rec.correct)}"
            score = "the reference" if n == "full" else f"KL {rec.kl:.3f} · top-1 {rec.top1:.0%}"
            st.markdown(f"**{n}**{answer} · {score}")
            if n == "full":
                st.text(rec.reply or "(empty reply)")
            else:
                st.markdown(divergence_html(lm.encode(rec.reply), reference, lm.decode), unsafe_allow_html=True)


def _heads(shown: ChatRecord) -> None:
    """DuoAttention's retrieval and streaming heads, as found before the first turn."""
    st.caption("DuoAttention's split, found on the model before the first turn (not downloaded): each KV head's "
               "gate α, high where replacing full attention by sinks + recent keys changes the model's output "
               "most. The heads marked R are retrieval heads and keep every key; the others keep "
               "sinks + recent keys only.")
    for n, (pattern, ratio) in shown.heads.items():
        st.plotly_chart(duo_heads_figure(pattern, ratio), width="stretch", key=f"chat_heads_{n}")
