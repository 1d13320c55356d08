"""Page 1: a live multi-turn chat run through several cache policies side by side."""

from __future__ import annotations

import streamlit as st

from kvlab.engine.chatformat import DEFAULT_SYSTEM, PLAIN_DESCRIPTION, implicit_system, uses_plain_format
from kvlab.engine.timing import clock
from kvlab.errors import KvlabError, Stopped
from kvlab.export import table_csv, to_json
from kvlab.files import MB
from kvlab.paths import CONVERSATIONS_DIR, RETRIEVAL_DIR
from kvlab.policies import DEFAULT_COMPARISON, POLICIES
from kvlab.policies.memory import MIB
from kvlab.policies.oracle import NOT_DEPLOYABLE
from kvlab.saved import UNKNOWN, ReplayCheck, read_json
from kvlab.workloads.chat.budgets import BUDGET_UNITS, PERCENT_HELP, UNCONVERTED, mib_settings
from kvlab.workloads.chat.conversation import Conversation, list_workloads, load_conversation, short_replies
from kvlab.workloads.chat.estimate import LONG_TURN_S, ask_first_s
from kvlab.workloads.chat.files import MAX_SCBENCH_BYTES, workloads_from_bytes
from kvlab.workloads.chat.records import TurnResult, failures, turn_table
from kvlab.workloads.chat.replay import replay_session, session_to_json
from kvlab.workloads.chat.scbench import fit_to_context
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.session_file import ChatRecord, record_from_json, record_of, replay_differences
from kvlab.workloads.chat.settings import ChatSettings, model_policies
from ui.chat_results import show_turns
from ui.common import as_written, new_upload, page_bar, page_start, progress_in, say_replay
from ui.figures import download_all_figures
from ui.params import param_widgets
from ui.plugins import PLUGIN_HELP, policy_option
from ui.summaries import settings_summary

lm = page_start(
    "Multi-turn chat",
    "Every turn runs through each selected policy at one budget; caches carry over between turns and "
    "are compressed after your message and after the reply (SCBench multi-turn). Full is the exact reference.",
)

plain = uses_plain_format(lm.tokenizer)
if plain:
    st.info(PLAIN_DESCRIPTION)
state = st.session_state
SYSTEM_KEY = f"chat_system_{'plain' if plain else 'template'}"  # each kind of model keeps its own text


def apply_to_widgets(settings: ChatSettings, system: str | None) -> None:
    """Show a restored session's settings in the widgets (before they are drawn: Streamlit allows no later write)."""
    state.chat_policies = [p for p in settings.policies if p != "full"]
    state.chat_budget, state.chat_block = settings.budget, settings.block_size
    state.chat_budget_unit = ("percent" if settings.budget_percent is not None else "mib"
                              if settings.budget_mib is not None else "tokens")
    if settings.budget_percent is not None:
        state.chat_budget_percent = float(settings.budget_percent)
    if settings.budget_mib is not None:
        state.chat_budget_mib = float(settings.budget_mib)
    state.chat_mode, state.chat_max_new = settings.position_mode, settings.max_new_tokens
    for name, values in settings.params.items():
        for param, value in values.items():
            state[f"chat_{name}_{param}"] = value
    state[SYSTEM_KEY] = system or ""


if (restored := state.pop("chat_restored", None)) is not None:
    apply_to_widgets(restored.settings, restored.system)

with st.expander("Comparison settings", expanded="chat" not in state):
    # a row of its own: in a third of the width the fourth tag would be clipped
    policies = st.multiselect("Policies (Full is always run as the reference)",
                              [p for p in POLICIES if p != "full"], default=list(DEFAULT_COMPARISON[1:]),
                              persist_state="session", key="chat_policies", format_func=policy_option,
                              help=PLUGIN_HELP)
    c2, c3, c4, c5 = st.columns(4)
    unit = c2.radio("Budget unit", list(BUDGET_UNITS),
                    persist_state="session", key="chat_budget_unit", horizontal=True,
                    format_func=BUDGET_UNITS.label, help="tokens: every policy keeps that many per layer and KV head. "
                    "MiB: the K/V the cache may hold; each policy keeps the most tokens whose worst case fits, so a "
                    "4-bit KIVI cache keeps several times the tokens of a full-precision one once its full-precision "
                    "residual (128 tokens by default) fits; KIVI without eviction keeps every token. " + PERCENT_HELP)
    # no min/max: Streamlit would quietly keep the last valid value; an out-of-range one is refused below
    if unit == "tokens":
        budget = c2.number_input("Budget (tokens per layer per KV head)", value=128, step=16,
                                 persist_state="session", key="chat_budget")
    elif unit == "mib":
        budget = c2.number_input(f"Budget (MiB of K/V; {lm.facts.kv_bytes(512) / MIB:.1f} MiB hold 512 tokens)",
                                 value=5.0, step=0.5, format="%g", persist_state="session", key="chat_budget_mib")
    else:
        budget = c2.number_input("Budget (% of Full's K/V bytes)", value=25.0, step=5.0, format="%g",
                                 persist_state="session", key="chat_budget_percent")
    block_size = c3.number_input("Block size", value=16, persist_state="session", key="chat_block")
    mode = c4.radio("Positions", ["original", "rerotated"], persist_state="session", key="chat_mode", horizontal=True,
                    help="original: new tokens continue the text's positions (gaps allowed). rerotated: "
                         "kept keys are rotated to their cache slot and queries sit at the cache length "
                         "(StreamingLLM's scheme).")
    max_new = c5.number_input("Max reply tokens", value=48, persist_state="session", key="chat_max_new")
    system_text = st.text_area(
        "System message (starts each new conversation; a scripted conversation brings its own)", DEFAULT_SYSTEM,
        persist_state="session", key=SYSTEM_KEY, height=68,
        help="Without one the small embedded chat model drifts into canned refusals. A model without a chat "
             "template gets it as the transcript's first line. Empty: no system message.")
    if "oracle" in policies:
        st.caption(f"**oracle**: {NOT_DEPLOYABLE}. It runs on a loaded scripted conversation, never in a live chat.")
    st.caption("Policy parameters (defaults follow each policy's reference code; hover for the variants)")
    params = param_widgets(policies, "chat")
    try:
        wanted: ChatSettings | None = ChatSettings(
            policies=tuple(policies), block_size=int(block_size),
            budget=int(budget) if unit == "tokens" else UNCONVERTED if unit == "mib" else 128,  # MiB: converted below
            position_mode=mode, max_new_tokens=int(max_new), params=params,
            budget_percent=float(budget) if unit == "percent" else None)
        if unit == "mib":  # each policy's tokens from the bytes, on this model
            wanted = mib_settings(wanted, float(budget), lm.facts)
        learning = st.empty()  # a bar only while a policy learns from the model (DuoAttention: once per model)
        model_policies(lm, wanted, progress_in(learning))
        learning.empty()
        refusal = None
    except KvlabError as exc:
        wanted, refusal = None, str(exc)
# under the panel, not in it: the panel folds shut once a conversation runs, and a refusal inside it went unseen
if refusal:
    st.error(f"Refused: {refusal}. No new conversation starts until this is fixed in the comparison settings (one "
             "under way keeps its own settings).")
wanted_system = system_text.strip() or None


def session() -> ChatSession | None:
    return state.get("chat")


def going_on() -> ChatSession | None:
    """The conversation the next turn runs on, or None where that turn starts one: there is none yet, or no turn has
    run on it and the panel's settings (or a live chat's system message) changed since it opened, so it takes them."""
    current = session()
    if current is None or current.turns:
        return current
    script = state.get("script")
    system = script.system if script is not None else wanted_system
    return current if current.settings == wanted and current.system == system else None


def refused(message: str | None = None) -> bool:
    """Whether the panel holds a refused value; then no conversation starts, and the page says why (quoting the
    ``message`` it would have answered, so that it is not lost)."""
    if refusal:
        again = f" and send your message again: {quoted(message)}" if message is not None else ""
        st.error(f"Not run: {refusal}. Fix it in the comparison settings{again}.")
    return refusal is not None


def start_session(system: str | None, script: Conversation | None = None, message: str | None = None
                  ) -> ChatSession | None:
    """A new conversation with the panel's settings, or None with the reason in the page (and the ``message`` it
    would have answered, so that it is not lost)."""
    if refused(message):
        return None
    try:
        state.chat = ChatSession(lm, wanted, system, script=script)
    except KvlabError as exc:
        unsent = f" Not run: your message {quoted(message)}; change the policies and send it again."
        st.error(f"{str(exc).rstrip('.')}." + (unsent if message is not None else ""))
        return None
    return state.chat


def stop_pressed(user: str) -> None:
    """Stop's callback, first thing in the run the click starts (alongside the running one): the turn stops
    before its next decoder layer and rolls back; the page waits for that below."""
    state.chat_stop = (clock(), user)
    if (running := session()) is not None:
        running.request_stop()


def run_turn(chat: ChatSession, user: str, golden: str | None = None, prefill: str = "", answer: str | None = None,
             metric: str = "contains") -> bool:
    """Run one turn, streaming Full's reply into the chat; False (with a message) on bad input.

    Stop asks the engine to end the turn before its next decoder layer (any other click ends this run at
    its next write to the page); either way every cache is rolled back. The conversation runs on its own
    settings, whatever the panel holds now.
    """
    with transcript:
        return _turn_in_transcript(chat, user, golden, prefill, answer, metric)


def _turn_in_transcript(chat: ChatSession, user: str, golden: str | None, prefill: str, answer: str | None,
                        metric: str) -> bool:
    """``run_turn``'s body, drawn where the page's container says."""
    say_turn_undone(chat, 30)
    with st.chat_message("user"):
        st.markdown(user)
    with st.chat_message("assistant"):
        live = st.empty()
        status = st.status(f"Running {len(chat.policies)} policies…", expanded=False)
        with status:  # one line per policy, each labelled: one status line flipping between policies reads as noise
            lines = {n: st.empty() for n in chat.policies if n != "full"}
        stop = st.empty()
        # one Stop per turn: Play all draws several turns in one run, and keys must be unique within a run
        stop.button("Stop", key=f"chat_stop_button_{len(chat.turns)}", icon=":material/stop_circle:",
                    on_click=stop_pressed,
                    args=(user,), help="Ends the turn at the next decode step; every cache goes back to before it.")

        def on_token(policy: str, text: str) -> None:
            if policy == "full":
                live.markdown(f"**full** (the reference) · {text} ▌")
            else:
                lines[policy].markdown(f"**{policy}** · {text[-120:]}")

        def on_phase(what: str) -> None:
            status.update(label=f"{len(chat.policies)} policies: {what}…")

        try:
            turn = chat.run_turn(user, golden=golden, prefill=prefill, answer=answer, metric=metric, on_token=on_token,
                                 on_phase=on_phase)
        except Stopped:  # Stop's own run says so
            return False
        except KvlabError as exc:
            stop.empty()
            live.empty()
            status.update(label="Turn refused", state="error")
            st.error(str(exc))
            return False
        stop.empty()
        live.markdown(reply_text(turn.reply))
        st.caption(reply_caption(turn))
        failed = [n for n, (k, _) in failures(chat.turns).items() if k == turn.index + 1]
        status.update(label=f"Turn {turn.index + 1}: {len(turn.policies)} policies in "
                            f"{turn.turn_s:.1f} s"
                            + (f"; failed: {', '.join(failed)}" if failed else ""), state="complete")
    return True


def reply_text(reply: str) -> str:
    """A reply as its bubble shows it: an empty one said in words, not a blank bubble."""
    return reply if reply.strip() else "*(an empty reply: the model ended it at once)*"


def reply_caption(turn: TurnResult) -> str:
    """What the reply under a turn is: the script's golden reply or Full's, and that every cache was fed it."""
    if turn.reply_source == "golden":
        return "golden reply from the script (every cache was fed this)"
    return "**Full**'s reply (every cache was fed this); each policy's own reply: the *Replies* tab below"


def quoted(user: str) -> str:
    """A user's message as the page quotes it back in a message: the first 300 characters, as typed."""
    return f"“{as_written(user[:300])}{'…' if len(user) > 300 else ''}”"


def say_turn_undone(chat: ChatSession, timeout: float) -> None:
    """Say so if the page's last run ended mid-turn (a new message or another click ran it again): the engine rolled
    that turn back, and nothing else would tell the user their message went unanswered."""
    if (cut := chat.take_cut_short(timeout)) is not None:
        st.warning(f"Your message {quoted(cut)} was still being answered when the page ran again (a new message or "
                   "another click), so that turn was stopped and undone: every cache is as it was before it. Send it "
                   "again, or press Next turn for a scripted one, to run it.")


def new_conversation() -> None:
    """A callback, so the page that follows the click already has no conversation (and no stale notice)."""
    for key in ("chat", "script", "chat_pending", "chat_stop", "chat_view", "chat_view_data", "chat_replace",
                "chat_replay_check"):
        state.pop(key, None)


def in_progress() -> bool:
    """Whether the page holds a conversation that loading something else would replace."""
    return bool((state.get("chat") is not None and state.chat.turns) or state.get("chat_view") is not None)


def open_script(conv) -> None:
    """Start the scripted conversation ``conv`` (its own system message) in place of whatever the page held."""
    new_conversation()
    if start_session(conv.system, conv) is not None:
        state.script = conv


def open_saved(view: ChatRecord, data: dict) -> None:
    """Show a saved session's records in place of whatever the page held: no model run (Replay re-runs it)."""
    new_conversation()
    state.chat_view, state.chat_view_data = view, data
    state.chat_restored = view  # the next run shows its settings in the panel


def replace_with(what: str, item: object, data: dict | None = None) -> None:
    """Open a script or a saved session at once, or first ask when it would replace a conversation in progress."""
    if in_progress():
        state.chat_replace = (what, item, data)
    elif what == "script":
        open_script(item)
    else:
        open_saved(item, data)
    # the next run draws the script popover afresh, closed: an open one covered Next turn and Play all. A new key
    # rather than its state set to closed, which the browser can miss when Load is pressed during the run that
    # opening the popover started (its open and closed states then reach it in one update)
    state.chat_script_popovers = state.get("chat_script_popovers", 0) + 1
    st.rerun()


chat = session()
if (stopped := state.pop("chat_stop", None)) is not None:
    pressed, user = stopped
    # the stopped turn ends before its next decoder layer and rolls back before it lets go of the session
    ended = chat is None or chat.wait_idle(30)
    took = f"{clock() - pressed:.1f} s after Stop" if ended else "still running 30 s after Stop"
    st.warning(f"Stopped: the turn ended {took} and was undone, so every cache is as it was before it. "
               f"Your message was: {quoted(user)}")
elif chat is not None:
    say_turn_undone(chat, 0)  # a turn still rolling back is told before the next turn, which waits for it anyway
if (chat is not None and chat.turns and wanted is not None
        and (chat.settings != wanted or (state.get("script") is None and chat.system != wanted_system))):
    st.info("Settings changed. This conversation keeps the settings it started with; press **New conversation** "
            "to apply them.")

top = st.container(horizontal=True)  # each control as wide as its label: columns would clip them
top.button("New conversation", key="chat_reset", on_click=new_conversation)

with top.popover("Scripted conversation", key=f"chat_script_popover_{state.get('chat_script_popovers', 0)}",
                 on_change="rerun"):
    files = list_workloads(CONVERSATIONS_DIR) + list_workloads(RETRIEVAL_DIR)
    choice = st.selectbox("Workload", files, format_func=lambda p: f"{p.parent.name}/{p.stem}",
                          persist_state="session", key="chat_script_file")
    upload_conv = st.file_uploader("…or upload a conversation (kvlab JSON or JSONL, SCBench JSONL or parquet: its "
                                   "first record)", type=["json", "jsonl", "parquet"], key="chat_script_upload",
                                   max_upload_size=MAX_SCBENCH_BYTES // MB)
    if st.button("Load", key="chat_script_load"):
        try:
            if upload_conv is not None:
                conv = workloads_from_bytes(upload_conv.getvalue(), upload_conv.name)[0]
            else:
                conv = load_conversation(choice)
            replace_with("script", fit_to_context(conv, lm, wanted.max_new_tokens if wanted else 0))
        except KvlabError as exc:
            st.error(str(exc))

with top.popover("Save / restore session"):
    downloads = st.container()  # filled at the end of the run, once this run's turn has finished
    raw = new_upload("Open a saved session (drawn from the file at once, no model run)", "chat_restore")
    if raw is not None:
        try:
            data = read_json(raw, "session file")
            replace_with("saved", record_from_json(data), data)
        except KvlabError as exc:
            st.error(str(exc))

if (replacing := state.get("chat_replace")) is not None:
    what, item, data = replacing
    name = f"the script **{item.name}**" if what == "script" else "the saved session"
    held = state.get("chat_view") or session()
    ask = st.container(border=True)
    n = len(held.turns)
    ask.warning(f"Opening {name} replaces the conversation on the page ({n} turn{'' if n == 1 else 's'}). Download it "
                "first (Save / restore session) to keep it.")
    r1, r2 = ask.columns([1, 4])
    if r1.button("Replace it", key="chat_replace_yes", type="primary"):
        state.pop("chat_replace")
        open_script(item) if what == "script" else open_saved(item, data)
        st.rerun()
    if r2.button("Keep the conversation", key="chat_replace_no"):
        state.pop("chat_replace")
        st.rerun()

chat = session()
view: ChatRecord | None = state.get("chat_view")
script = state.get("script")
if view is not None:
    stamp = view.stamp
    st.info(f"**Opened from a file, no model run**: every turn, figure and table below is the file's record "
            f"({stamp.label()}). **Replay** re-runs it on the model in the sidebar and checks that every turn "
            "comes out identical; a new message needs that replay first.")
    if stamp.model not in (UNKNOWN, lm.facts.name):
        st.warning(f"The file was made on {stamp.model}; the sidebar has {lm.facts.name}. A replay runs "
                   f"{lm.facts.name}, so it would not reproduce the file.")
    if st.button("Replay it", key="chat_replay", icon=":material/replay:"):
        try:
            replayed = replay_session(lm, state.chat_view_data, page_bar("Replaying…"))
            check = ReplayCheck(replay_differences(view.turns, replayed.turns),
                                "every turn (replies, kept tokens, bytes, scores)", stamp, lm.facts.name)
            scripted = state.chat_view_data.get("script") is not None
            new_conversation()
            state.chat, state.chat_replay_check = replayed, check
            if scripted:  # its turns to come stay playable
                state.script = replayed.script
            st.rerun()
        except KvlabError as exc:
            st.error(str(exc))
if (check := state.get("chat_replay_check")) is not None and chat is not None:
    say_replay(check, "The conversation goes on from here.")

summary_slot = st.empty()  # filled at the end of the run: a first message starts the conversation below
for turn in view.turns if view is not None else chat.turns if chat is not None else []:
    with st.chat_message("user"):
        st.markdown(turn.user)
    with st.chat_message("assistant"):
        st.markdown(reply_text(turn.reply))
        st.caption(reply_caption(turn))
transcript = st.container()  # the turns this run plays: under the earlier ones, above a script's controls and bar

if script is not None and chat is not None:
    done = len(chat.turns)
    remaining = script.turns[done:]
    played = st.empty()  # rewritten after each turn this run plays

    def show_played() -> None:
        played.caption(f"Script **{script.name}**: {len(chat.turns)}/{len(script.turns)} turns played. "
                       f"{script.description}" + (f" **Note:** {script.notice}" if script.notice else ""))

    show_played()
    if remaining and (short := short_replies(lm.encode, [script], chat.settings.max_new_tokens)):
        st.warning(short)
    buttons = st.empty()  # gone once this run has played the last turn
    b1, b2 = buttons.container().columns(2)
    if remaining and b1.button("Next turn", key="chat_next"):
        t = remaining[0]
        if (chat := going_on() or start_session(script.system, script)) is not None:
            run_turn(chat, t.user, t.golden, t.prefill, t.answer, t.metric)
            show_played()
    if remaining and b2.button("Play all", key="chat_all") and (
            chat := going_on() or start_session(script.system, script)) is not None:
        progress = page_bar("Playing the script…")
        for i, t in enumerate(remaining):
            if not run_turn(chat, t.user, t.golden, t.prefill, t.answer, t.metric):
                break
            show_played()
            progress((i + 1) / len(remaining), f"Turn {done + i + 1}/{len(script.turns)}")
    if chat is not None and len(chat.turns) >= len(script.turns):
        buttons.empty()


def send(message: str) -> None:
    """Run ``message`` as the next turn, starting a conversation with the panel's settings if there is none."""
    if not message.strip():
        st.error("Not sent: the message is empty.")
        return
    current = going_on() or start_session(wanted_system, message=message)
    if current is not None:
        run_turn(current, message)


def estimate(message: str) -> float:
    """Seconds the turn would take, where worth asking about first (``ask_first_s``); 0 where settings are refused."""
    current = going_on()
    if current is None and refusal:
        return 0.0
    settings, held = (current.settings, current.total_tokens) if current is not None else (wanted, 0)
    return ask_first_s(lm, settings, held, len(lm.encode(message)), fresh=current is None or not current.turns)


message = st.chat_input("Message the model (every selected policy answers)")
if message is not None and view is not None:
    st.warning("The conversation on the page was opened from a file and has no caches on the model: press **Replay "
               "it** above to rebuild them and go on, or **New conversation** to start afresh. Your message was: "
               + quoted(message))
elif message is not None:
    state.pop("chat_pending", None)
    seconds = estimate(message)
    if seconds > LONG_TURN_S:
        state.chat_pending = (message, seconds)
    else:
        send(message)
if (pending := state.get("chat_pending")) is not None:
    text, seconds = pending
    slot = st.empty()  # cleared once answered
    ask = slot.container()
    runs_on = going_on()
    n_policies = len(runs_on.settings.policies) if runs_on is not None else len(policies) + 1  # with Full
    ask.warning(f"This message is {len(text):,} characters ({len(lm.encode(text)):,} tokens, a few more with the "
                "chat template's turn markers). Run through "
                f"{n_policies} policies on this machine it would take roughly {seconds:.0f} s or more (timed just "
                "now). Run it anyway? Stop ends it at any time.")
    a1 = a2 = ask.container(horizontal=True)  # side by side, each as wide as its label
    if a1.button("Run it", key="chat_long_run", type="primary"):
        state.pop("chat_pending")
        slot.empty()
        send(text)
    elif a2.button("Discard it", key="chat_long_drop"):
        state.pop("chat_pending")
        st.rerun()

chat = session()
shown: ChatRecord | None = view
if view is None and chat is not None:
    shown = record_of(chat)  # with this run's turn
    implicit = implicit_system(chat.lm.tokenizer)
    summary_slot.caption(f"This conversation runs with: {settings_summary(chat.settings, chat.system, implicit)}")
    if chat.turns:
        with downloads:  # after this run's turn, so they hold every finished turn; a download reruns nothing
            # written when clicked: a long session's file is megabytes, too slow to build on every rerun
            st.download_button("Download session (JSON)", lambda: to_json(session_to_json(chat)),
                               "kvlab-session.json", "application/json", key="chat_save", on_click="ignore")
            st.download_button("Download per-turn table (CSV)", table_csv(turn_table(chat.turns)),
                               "kvlab-turns.csv", "text/csv", key="chat_csv", on_click="ignore")
elif view is not None:
    ran_on = view.stamp is None or view.stamp.model == lm.facts.name  # the template in hand is the file's model's
    implicit = implicit_system(lm.tokenizer) if ran_on else None
    summary_slot.caption(f"This conversation ran with: {settings_summary(view.settings, view.system, implicit)}")

if shown is None or not shown.turns:
    if script is None:  # a loaded script says what to press next above
        st.info("Send a message or load a scripted conversation to start.")
    st.stop()

st.divider()  # what the caches did
show_turns(shown, lm)

download_all_figures("chat")
