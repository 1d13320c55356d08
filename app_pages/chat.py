"""Page 1: a live multi-turn chat run through several cache policies side by side."""

from __future__ import annotations

import json

import streamlit as st
import torch

from kvlab.chatformat import PLAIN_DESCRIPTION, uses_plain_format
from kvlab.codesource import DATA_DIR
from kvlab.conversation import conversation_from_bytes, list_workloads, load_conversation
from kvlab.errors import KvlabError
from kvlab.multiturn import ChatSession, ChatSettings, failures, replay_session, session_to_json, turn_table
from kvlab.paging import block_state_grid
from kvlab.policies import DEFAULT_COMPARISON, POLICIES
from kvlab.viz.blocks import block_bytes_figure, block_map_figure
from kvlab.viz.chat import attention_profile, fidelity_lines, retained_map, sink_heatmap
from ui.common import page_start
from ui.params import param_widgets


lm = page_start(
    "Multi-turn chat",
    "Every turn runs through each selected policy at one budget; caches carry over between turns and "
    "are compressed after your message and after the reply (SCBench multi-turn). Full is the exact reference.",
)

if uses_plain_format(lm.tokenizer):
    st.info(PLAIN_DESCRIPTION)
state = st.session_state

with st.expander("Comparison settings", expanded="chat" not in state):
    c1, c2, c3 = st.columns(3)
    policies = c1.multiselect("Policies (Full is always run as the reference)",
                              [p for p in POLICIES if p != "full"], default=list(DEFAULT_COMPARISON[1:]),
                              key="chat_policies")
    budget = c2.number_input("Budget (tokens per layer per KV head)", min_value=1, max_value=1_000_000,
                             value=128, step=16, key="chat_budget")
    block_size = c3.number_input("Block size", min_value=1, max_value=256, value=16, key="chat_block")
    c4, c5 = st.columns(2)
    mode = c4.radio("Positions", ["original", "rerotated"], key="chat_mode",
                    help="original: new tokens continue the text's positions (gaps allowed). rerotated: "
                         "kept keys are rotated to their cache slot and queries sit at the cache length "
                         "(StreamingLLM's scheme).")
    max_new = c5.number_input("Max reply tokens", min_value=1, max_value=512, value=48, key="chat_max_new")
    st.caption("Policy parameters (defaults follow each policy's reference code; hover for the variants)")
    params = param_widgets(policies, "chat")


def current_settings() -> ChatSettings:
    return ChatSettings(policies=tuple(policies), budget=int(budget), block_size=int(block_size),
                        position_mode=mode, max_new_tokens=int(max_new), params=params)


def session() -> ChatSession | None:
    return state.get("chat")


def start_session(system: str | None = None) -> ChatSession | None:
    try:
        state.chat = ChatSession(lm, current_settings(), system)
    except KvlabError as exc:
        st.error(str(exc))
        return None
    return state.chat


def run_turn(chat: ChatSession, user: str, golden: str | None = None, prefill: str = "", answer: str | None = None) -> bool:
    """Run one turn, streaming Full's reply into the chat; False (with a message) on bad input."""
    with st.chat_message("user"):
        st.markdown(user)
    with st.chat_message("assistant"):
        live = st.empty()
        status = st.status(f"Running {len(chat.policies)} policies…", expanded=False)

        def on_token(policy: str, text: str) -> None:
            if policy == "full":
                live.markdown(text + " ▌")
            else:
                status.update(label=f"{policy}: {text[-80:]}")

        try:
            turn = chat.run_turn(user, golden=golden, prefill=prefill, answer=answer, on_token=on_token)
        except KvlabError as exc:
            live.empty()
            status.update(label="Turn refused", state="error")
            st.error(str(exc))
            return False
        live.markdown(turn.reply)
        failed = [n for n, (k, _) in failures(chat.turns).items() if k == turn.index + 1]
        status.update(label=f"Turn {turn.index + 1}: {len(turn.policies)} policies in "
                            f"{sum(p.time_s for p in turn.policies.values()):.1f} s"
                            + (f"; failed: {', '.join(failed)}" if failed else ""), state="complete")
    return True


chat = session()
if chat is not None and chat.settings != current_settings() and chat.turns:
    st.info("Settings changed. This conversation keeps the settings it started with; press **New conversation** to apply them.")

top = st.columns([1, 1, 2])
if top[0].button("New conversation", key="chat_reset"):
    state.pop("chat", None)
    state.pop("script", None)
    chat = None

with top[2].popover("Save / restore session"):
    if chat is not None and chat.turns:
        st.download_button("Download session (JSON)", json.dumps(session_to_json(chat)), "kvlab-session.json",
                           "application/json", key="chat_save")
        st.download_button("Download per-turn table (CSV)", turn_table(chat.turns).to_csv(index=False),
                           "kvlab-turns.csv", "text/csv", key="chat_csv")
    upload = st.file_uploader("Restore a saved session", type=["json"], key="chat_restore")
    if upload is not None and st.button("Replay it", key="chat_replay"):
        try:
            data = json.loads(upload.getvalue().decode("utf-8"))
            bar = st.progress(0.0, text="Replaying…")
            state.chat = replay_session(lm, data, lambda i, n: bar.progress(i / n, text=f"Replayed turn {i}/{n}"))
            chat = state.chat
        except (UnicodeDecodeError, json.JSONDecodeError):
            st.error("That file is not UTF-8 JSON.")
        except KvlabError as exc:
            st.error(str(exc))

with top[1].popover("Scripted conversation"):
    files = list_workloads(DATA_DIR / "conversations") + list_workloads(DATA_DIR / "retrieval")
    choice = st.selectbox("Workload", files, format_func=lambda p: f"{p.parent.name}/{p.stem}", key="chat_script_file")
    upload_conv = st.file_uploader("…or upload a conversation JSON", type=["json"], key="chat_script_upload")
    if st.button("Load", key="chat_script_load"):
        try:
            if upload_conv is not None:
                conv = conversation_from_bytes(upload_conv.getvalue(), upload_conv.name)
            else:
                conv = load_conversation(choice)
            if start_session(conv.system) is not None:
                state.script = conv
                chat = state.chat
        except KvlabError as exc:
            st.error(str(exc))

script = state.get("script")

for turn in chat.turns if chat else []:
    with st.chat_message("user"):
        st.markdown(turn.user)
    with st.chat_message("assistant"):
        st.markdown(turn.reply)
        if turn.reply_source == "golden":
            st.caption("golden reply from the script (every cache was fed this)")

if script is not None and chat is not None:
    done = len(chat.turns)
    remaining = script.turns[done:]
    st.caption(f"Script **{script.name}**: {done}/{len(script.turns)} turns played. {script.description}")
    b1, b2 = st.columns(2)
    if remaining and b1.button("Next turn", key="chat_next"):
        t = remaining[0]
        run_turn(chat, t.user, t.golden, t.prefill, t.answer)
    if remaining and b2.button("Play all", key="chat_all"):
        bar = st.progress(0.0, text="Playing the script…")
        for i, t in enumerate(remaining):
            if not run_turn(chat, t.user, t.golden, t.prefill, t.answer):
                break
            bar.progress((i + 1) / len(remaining), text=f"Turn {done + i + 1}/{len(script.turns)}")

message = st.chat_input("Message the model (every selected policy answers)")
if message is not None:
    if chat is None:
        chat = start_session()
    if chat is not None:
        run_turn(chat, message)

if chat is None or not chat.turns:
    st.info("Send a message or load a scripted conversation to start.")
    st.stop()

# ---- what the caches did ----
st.divider()
turns = chat.turns
if state.get("chat_turns_seen") != len(turns):  # a new turn: show it, whatever turn was picked before
    state.chat_turns_seen = state.chat_turn = len(turns)
pick = st.select_slider("Show turn", options=list(range(1, len(turns) + 1)), key="chat_turn") if len(turns) > 1 else 1
turn = turns[pick - 1]
names = [n for n in turn.policies if turn.policies[n].error is None]
for n, (k, error) in failures(turns[:pick]).items():  # the session goes on without it: no score from turn k on
    when = "this turn" if k == pick else f"turn {k}"
    st.error(f"**{n}** failed on {when} and was dropped from the session (no score from then on): {error}")

tab_sink, tab_kept, tab_blocks, tab_fid, tab_replies = st.tabs(
    ["Attention sinks", "Retained tokens", "Paged blocks", "Fidelity", "Replies"])

with tab_sink:
    s = chat.settings
    who = st.selectbox("Policy", names, key="chat_sink_policy")
    st.plotly_chart(sink_heatmap(turn.policies[who].sink_mass, s.sink_tokens,
                                 f"{who}: attention of the last {s.stat_queries} queries on the first "
                                 f"{s.sink_tokens} tokens (turn {pick})"), width="stretch", key="chat_sink_fig")
    layer = st.slider("Layer for the attention profile", 0, lm.facts.n_layers - 1, lm.facts.n_layers // 2,
                      key="chat_profile_layer")
    st.plotly_chart(attention_profile(turn.profile, layer, turn.segments), width="stretch", key="chat_profile_fig")

with tab_kept:
    windows = lm.facts.layer_windows
    if any(windows):
        st.caption("Layers marked “window” are the model's own sliding-window layers: they drop keys further back "
                   "than their trained window under every policy, Full included — compare with StreamingLLM's "
                   "imposed window.")
    for n in names:
        if n == "full" and not any(windows):  # without trained windows Full keeps everything
            continue
        st.plotly_chart(retained_map(turn.policies[n].retained, turn.total_tokens, turn.segments,
                                     f"{n}: kept tokens after turn {pick}", windows), width="stretch",
                        key=f"chat_kept_{n}")

with tab_blocks:
    rows = [{"policy": n, **turn.policies[n].blocks} for n in names]
    st.plotly_chart(block_bytes_figure(rows), width="stretch", key="chat_bytes_fig")
    st.dataframe(turn_table([turn])[["policy", "kv_kib", "free_blocks", "fragmented_blocks", "full_blocks"]],
                 hide_index=True, width="stretch")
    who = st.selectbox("Block map of", [n for n in names if n != "full"] or names, key="chat_block_policy")
    rec = turn.policies[who]
    grid = block_state_grid([torch.tensor(p) for p in rec.retained], turn.total_tokens, chat.settings.block_size)
    st.plotly_chart(block_map_figure(grid, f"{who}: blocks of {chat.settings.block_size} tokens after turn {pick}",
                                     block_size=chat.settings.block_size, total_tokens=turn.total_tokens,
                                     windows=lm.facts.layer_windows),
                    width="stretch", key="chat_block_fig")

with tab_fid:
    table = turn_table(turns)
    st.plotly_chart(fidelity_lines(table), width="stretch", key="chat_fid_fig")
    st.dataframe(table, hide_index=True, width="stretch")

with tab_replies:
    cols = st.columns(min(len(turn.policies), 3))
    for i, (n, rec) in enumerate(turn.policies.items()):
        with cols[i % len(cols)]:
            if rec.error:
                st.markdown(f"**{n}** · failed, no score")
                continue
            mark = "" if rec.correct is None else (" ✅" if rec.correct else " ❌")
            st.markdown(f"**{n}**{mark} · KL {rec.kl:.3f} · top-1 {rec.top1:.0%}")
            st.text(rec.reply or "(empty reply)")
