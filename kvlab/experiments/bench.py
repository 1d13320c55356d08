"""Benchmarks: kvlab's instrumented runs against plain runs of the same model, as ratios.

Everything runs in one process on one loaded model. Each timed ratio is the median over ``runs`` runs in which both
sides run back to back, first one then the other, so a machine that gets busier half-way through moves both sides
together. Targets come from the release bar (issue 6); a row passes when its median meets the target. Nothing here is
asserted in tests: the numbers go into the README.

Rows:

- ``full_turn``: a Full-only ``ChatSession`` turn (probe statistics, sink mass, attention profile,
  greedy reply, teacher-forced reply append, fidelity, block figures) over a plain transformers
  prefill and greedy decode of the same prompt, same number of new tokens, same attention function.
- ``five_policies``: Full, StreamingLLM, H2O, SnapKV and PyramidKV side by side over Full alone, for
  that turn plus a short follow-up (by then the evicting caches differ, so the follow-up is batched).
- ``first_turn_N`` / ``follow_up_N``: the same two turns of five policies over Full alone, turn by turn, at each
  first message of ``contexts`` tokens.
- ``evict_share``: the five-policy chat's summed eviction time over its wall time.
- ``rag_recompose`` / ``rag_cacheblend``: full prefill's TTFT over the strategy's TTFT, 4 documents.
- ``edit_reprefill``: full prefill over re-prefill with prefix reuse after an edit at 90% of a file.
- ``probe_memory``: peak extra tensor memory of a prefill that collects the chat page's attention
  statistics (its windows plus H2O's column sums) over the same prefill without them.
- ``stream_recompute`` / ``stream_side_by_side``: ``kvlab.experiments.bench_stream``.
- ``arena_workers``: a small arena grid on 1 local Ray worker over the same grid on 2 (one torch
  thread each), timed from the first worker up to the last cell; starting Ray is reported beside it.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterator

import torch

from kvlab.engine.attention import Probe, forward_context
from kvlab.engine.batched import append_together
from kvlab.engine.chatformat import chat_format
from kvlab.engine.facts import LoadedModel
from kvlab.engine.kvstate import KVState
from kvlab.engine.progress import Progress, part_of
from kvlab.engine.reference import plain_greedy, plain_rows_ratio, prefill_peak_bytes
from kvlab.engine.timing import clock, host_clock, time_call
from kvlab.experiments.bench_rows import BenchConfig, BenchRow, row
from kvlab.experiments.bench_stream import bench_stream
from kvlab.experiments.plan import ArenaSettings, ModelSpec, RayPlan
from kvlab.experiments.runner import check_grid
from kvlab.paths import CODE_DIR, CONVERSATIONS_DIR
from kvlab.policies import DEFAULT_COMPARISON, make_policy
from kvlab.policies.snapkv import SnapKV
from kvlab.workloads.chat.conversation import load_conversation
from kvlab.workloads.chat.records import TurnResult
from kvlab.workloads.chat.session import ChatSession
from kvlab.workloads.chat.settings import ChatSettings
from kvlab.workloads.code.edits import Edit, apply_edit, reuse_edit, start_state
from kvlab.workloads.rag.corpus import DEFAULT_CORPUS, load_corpus
from kvlab.workloads.rag.run import RagLab, RagSettings
from kvlab.workloads.rag.strategies import STRATEGIES

CODE_FILE = CODE_DIR / "expr_parser.py"
GRID_WORKLOAD = CONVERSATIONS_DIR / "cooking-questions.json"
TURN_REQUEST = "\n\nRetell the text above in detail."
FOLLOW_UP = "Which of these topics interests you most, and why?"
EDIT_TEXT = "# kvlab bench: a line inserted at 90% of the file\n"


def prose_ids(lm: LoadedModel, n_tokens: int) -> list[int]:
    """``n_tokens`` token ids of natural prose (the RAG corpus's documents, repeated if needed)."""
    text = "\n\n".join(d.text for d in load_corpus(DEFAULT_CORPUS).documents)
    ids = lm.encode(text)
    return (ids * (n_tokens // len(ids) + 1))[:n_tokens]


def code_text(lm: LoadedModel, n_tokens: int) -> str:
    """The first whole lines of the bundled code file that fit in ``n_tokens`` tokens."""
    lines = CODE_FILE.read_text(encoding="utf-8").splitlines(keepends=True)
    fit = bisect.bisect_right(range(1, len(lines) + 1), n_tokens, key=lambda m: len(lm.encode("".join(lines[:m]))))
    return "".join(lines[:max(1, fit)])  # the most lines whose tokens fit, one at least


def turn_errors(*turns: TurnResult) -> set[str]:
    """"policy: error" of every policy that failed in ``turns``."""
    return {f"{n}: {p.error}" for t in turns for n, p in t.policies.items() if p.error}


def _first_token(session: ChatSession, user: str) -> tuple[tuple[float, float], TurnResult]:
    """Run a turn → ((whole turn s, s until the first reply text streamed), the turn); streaming on."""
    t0 = clock()
    first: list[float] = []

    def mark(_name: str, _text: str) -> None:
        if not first:
            first.append(clock() - t0)

    turn = session.run_turn(user, on_token=mark)
    total = clock() - t0
    return (total, first[0] if first else total), turn


def bench_chat(lm: LoadedModel, cfg: BenchConfig, progress: Progress | None = None) -> list[BenchRow]:
    """Instrumented Full turn vs plain, five policies vs one over a two-turn chat, and the eviction share.

    The chat is a long document (turn 1: every cache still identical) and a short follow-up
    (turn 2: the evicting policies' caches now differ from Full's and from each other).
    """
    user = lm.decode(prose_ids(lm, cfg.turn_tokens)) + TURN_REQUEST
    fmt = chat_format(lm.tokenizer, None)
    ids = [*fmt.start_ids, *lm.encode(fmt.opening + fmt.user_block(user))]  # what ChatSession prefills first
    one = ChatSettings(policies=("full",), budget=cfg.budget, max_new_tokens=cfg.new_tokens)
    five = ChatSettings(policies=DEFAULT_COMPARISON, budget=cfg.budget, max_new_tokens=cfg.new_tokens)
    plain_greedy(lm, ids[:16], 2, set())  # warm-up: first-call allocations stay out of the timings
    overhead, side_by_side, evict_share = [], [], []
    plain_s, turn1_s, full_s, five_s, same_reply, errors = [], [], [], [], True, set()
    turn_ratios: tuple[list[float], list[float]] = ([], [])
    ttft_ratio: list[float] = []
    ttft_s: list[tuple[float, float]] = []
    for run in range(cfg.runs):
        if progress:
            progress(run / cfg.runs, f"chat turn {run + 1}/{cfg.runs}")
        session = ChatSession(lm, one)
        sides = [lambda: plain_greedy(lm, ids, cfg.new_tokens, session.stop_ids), lambda: session.run_turn(user)]
        order = [1, 0] if run % 2 else [0, 1]  # alternate which side runs first: an order effect cancels
        timed = {side: time_call(sides[side]) for side in order}
        (plain_timing, reply), (full_timing, turn) = timed[0], timed[1]
        t_plain, t_full = plain_timing.median, full_timing.median
        (t_full2, ttft_one), _ = _first_token(session, FOLLOW_UP)
        many = ChatSession(lm, five)
        five_timing, turn5 = time_call(lambda: many.run_turn(user))
        t_five = five_timing.median
        (t_five2, ttft_five), turn5b = _first_token(many, FOLLOW_UP)
        ttft_ratio.append(ttft_five / ttft_one)
        ttft_s.append((ttft_five, ttft_one))
        same_reply &= lm.decode(reply) == turn.reply
        errors |= turn_errors(turn5, turn5b)
        plain_s.append(t_plain)
        turn1_s.append(t_full)
        full_s.append(t_full + t_full2)
        five_s.append(t_five + t_five2)
        turn_ratios[0].append(t_five / t_full)
        turn_ratios[1].append(t_five2 / t_full2)
        overhead.append(t_full / t_plain)
        side_by_side.append((t_five + t_five2) / (t_full + t_full2))
        evict_s = sum(p.evict_s for t in (turn5, turn5b) for p in t.policies.values())
        evict_share.append(100 * evict_s / (t_five + t_five2))
    med = statistics.median
    shape = f"{len(ids)}-token prompt, {len(reply)} new tokens"
    return [
        row("full_turn", "Instrumented Full turn / plain prefill + greedy decode", overhead, "×", "<=", 1.10,
             f"{shape}; {med(turn1_s):.2f} s vs {med(plain_s):.2f} s; same reply: {same_reply}"),
        row("five_policies", "Five policies side by side / Full alone", side_by_side, "×", "<=", 2.5,
             f"{', '.join(DEFAULT_COMPARISON)} at budget {cfg.budget}, two turns ({shape}, then a "
             f"{len(lm.encode(FOLLOW_UP))}-token follow-up); {med(five_s):.2f} s vs {med(full_s):.2f} s; "
             f"turn 1 {med(turn_ratios[0]):.2f}×, turn 2 {med(turn_ratios[1]):.2f}×"
             + (f"; failed: {'; '.join(sorted(errors))}" if errors else "")),
        row("evict_share", "Eviction step's share of a five-policy turn", evict_share, "%", "<=", 3.0,
             f"sum of evict_s over the policies / wall time of both turns; {shape}"),
        row("follow_up_ttft", "First streamed token of a five-policy follow-up turn / Full alone", ttft_ratio,
             "×", "<=", 1.5,
             f"the follow-up after the {len(ids)}-token turn, caches already evicted to budget {cfg.budget}; "
             f"{med(t[0] for t in ttft_s):.2f} s vs {med(t[1] for t in ttft_s):.2f} s (Full's first words stream "
             "before the other caches are prefilled)"),
    ]


def _size(tokens: int) -> str:
    """A row key's size: 1024 → "1k", 160 → "160"."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def bench_turns(lm: LoadedModel, cfg: BenchConfig, progress: Progress | None = None) -> list[BenchRow]:
    """Five policies over Full alone, turn by turn, at each first message of ``cfg.contexts`` tokens.

    The first turn feeds a long message to caches that are all still Full's; the short follow-up comes after
    the evicting policies have cut theirs to the budget, so it is decoded and fed on five different caches.
    Each run times both chats back to back, in alternating order, and the row is the median of the runs' ratios.
    """
    five = ChatSettings(policies=DEFAULT_COMPARISON, budget=cfg.budget, max_new_tokens=cfg.new_tokens)
    one = ChatSettings(policies=("full",), budget=cfg.budget, max_new_tokens=cfg.new_tokens)
    out: list[BenchRow] = []
    floor = step_floor(lm, cfg)
    for c, tokens in enumerate(cfg.contexts):
        user = lm.decode(prose_ids(lm, tokens)) + TURN_REQUEST
        ratios: tuple[list[float], list[float]] = ([], [])
        seconds: dict[int, list[tuple[float, float]]] = {1: [], 5: []}
        errors: set[str] = set()
        context = 0
        for run in range(cfg.turn_runs):
            if progress:
                progress((c * cfg.turn_runs + run) / (len(cfg.contexts) * cfg.turn_runs),
                         f"turn by turn at {_size(tokens)} tokens, {run + 1}/{cfg.turn_runs}")
            for settings in (one, five) if run % 2 == 0 else (five, one):
                session = ChatSession(lm, settings)
                t0 = clock()
                first = session.run_turn(user)
                t1 = clock()
                second = session.run_turn(FOLLOW_UP)
                seconds[len(settings.policies)].append((t1 - t0, clock() - t1))
                errors |= turn_errors(first, second)
                context = first.total_tokens
            for turn in (0, 1):
                ratios[turn].append(seconds[5][-1][turn] / seconds[1][-1][turn])

        def detail(turn: int, what: str) -> str:
            med = statistics.median
            return (f"{what}; {', '.join(DEFAULT_COMPARISON)} at budget {cfg.budget}, {cfg.new_tokens} new tokens; "
                    f"{med(s[turn] for s in seconds[5]):.2f} s vs {med(s[turn] for s in seconds[1]):.2f} s; {floor}"
                    + (f"; failed: {'; '.join(sorted(errors))}" if errors else ""))

        size = _size(tokens)
        out += [
            row(f"first_turn_{size}", f"First turn of five policies / Full alone, {size}-token message", ratios[0],
                "×", "<=", 1.3, detail(0, f"a {tokens}-token message into caches that are all still Full's")),
            row(f"follow_up_{size}", f"Follow-up of five policies / Full alone after a {size}-token turn", ratios[1],
                "×", "<=", 1.5, detail(1, f"the {len(lm.encode(FOLLOW_UP))}-token follow-up after {context} tokens, "
                                          "five different caches")),
        ]
    return out


def step_floor(lm: LoadedModel, cfg: BenchConfig) -> str:
    """The floor of every side-by-side turn's decoding on this machine, said beside its ratio."""
    ratio = plain_rows_ratio(lm, prose_ids(lm, cfg.budget), 5, cfg.turn_runs)
    return f"a plain decoding step of five rows over {cfg.budget} tokens costs {ratio:.2f}× one row's here"


def bench_rag(lm: LoadedModel, cfg: BenchConfig, progress: Progress | None = None) -> list[BenchRow]:
    """TTFT of RoPE recomposition and CacheBlend-15% against full prefill of the same prompt."""
    corpus = load_corpus(DEFAULT_CORPUS)
    lab = RagLab(lm, corpus)
    settings = RagSettings(k=cfg.rag_docs, strategies=("recompose", "cacheblend"), recompute=0.15, answer_tokens=1)
    question = corpus.questions[0]
    speedups: dict[str, list[float]] = {"recompose": [], "cacheblend": []}
    ttft: dict[str, list[float]] = {"full": [], "recompose": [], "cacheblend": []}
    kl: dict[str, float] = {}
    errors: dict[str, str] = {}
    tokens = 0
    for run in range(cfg.runs):
        if progress:
            progress(run / cfg.runs, f"RAG {run + 1}/{cfg.runs}")
        result = lab.run(question, settings)
        tokens = result.prompt_tokens
        ttft["full"].append(result.results[0].ttft_s)
        for r in result.results[1:]:
            if r.error:
                errors[r.strategy] = r.error
                continue
            speedups[r.strategy].append(r.speedup)
            ttft[r.strategy].append(r.ttft_s)
            kl[r.strategy] = r.kl

    def detail(name: str) -> str:
        if name in errors:
            return f"failed: {errors[name]}"
        return (f"{cfg.rag_docs} docs, {tokens}-token prompt; TTFT {1000 * statistics.median(ttft[name]):.0f} ms "
                f"vs full {1000 * statistics.median(ttft['full']):.0f} ms; KL {kl[name]:.3g}")

    return [
        row("rag_recompose", f"RAG TTFT speed-up: {STRATEGIES['recompose'].label}", speedups["recompose"], "×",
             ">=", 4.0, detail("recompose")),
        row("rag_cacheblend", f"RAG TTFT speed-up: {STRATEGIES['cacheblend'].label} 15%", speedups["cacheblend"],
             "×", ">=", 2.0, detail("cacheblend")),
    ]


def bench_edit(lm: LoadedModel, cfg: BenchConfig, progress: Progress | None = None) -> list[BenchRow]:
    """Re-prefill with prefix reuse after an edit at 90% of a code file vs a full prefill."""
    if progress:
        progress(0.0, "code edit")
    text = code_text(lm, cfg.code_tokens)
    state = start_state(lm, text)
    new_text, line = apply_edit(text, Edit(op="insert", at=0.9, text=EDIT_TEXT, label="insert at 90%"))
    _, res = reuse_edit(lm, state, new_text, label="insert at 90%", op="insert", line=line, repeats=cfg.runs)
    return [
        row("edit_reprefill", "Re-prefill speed-up after an edit at 90% of the file", res.speedups, "×", ">=", 5.0,
             f"{res.new_tokens}-token file, line {line}, {res.reuse_pct:.0f}% reused; {res.reprefill_ms:.0f} ms vs "
             f"full {res.full_ms:.0f} ms (medians of {cfg.runs}, timed in alternating pairs); max logit diff "
             f"{res.max_logit_diff:.1e}"),
    ]


def bench_probe_memory(lm: LoadedModel, cfg: BenchConfig, progress: Progress | None = None) -> list[BenchRow]:
    """Peak extra memory of the chat page's attention statistics (windows + column sums)."""
    if progress:
        progress(0.0, "attention statistics memory")
    ids = prose_ids(lm, cfg.memory_tokens)
    windows = tuple(sorted({ChatSettings().stat_queries, SnapKV().window}))
    base = prefill_peak_bytes(lm, ids, None)
    probe = Probe(windows=windows, colsum=True)
    with_stats = prefill_peak_bytes(lm, ids, probe)
    kept = sum(t.numel() * t.element_size() for per_layer in probe.window_means.values() for t in per_layer.values())
    kept += sum(t.numel() * t.element_size() for t in probe.colsums.values())
    return [
        row("probe_memory", "Peak extra memory of attention statistics", [(with_stats - base) / 1e6], "MB", "<=",
             100.0, f"{len(ids)} tokens, windows {windows} + column sums; peak tensor bytes {with_stats / 1e6:.0f} "
                    f"vs {base / 1e6:.0f} MB (counted per torch op); statistics kept {kept / 1e6:.1f} MB"),
    ]


def bench_workers(lm: LoadedModel, cfg: BenchConfig, progress: Progress | None = None) -> list[BenchRow]:
    """The same arena grid on 1 local Ray worker and on 2, each worker one torch thread.

    Each side is timed from its first worker having loaded the model to the last cell: the grid's
    own wall time. Starting Ray and loading the model is a fixed cost per run, reported in the detail.
    """
    label, target = "Arena grid: 2 Ray workers over 1 (one torch thread each)", 1.7
    try:
        from kvlab.experiments.workers import run_arena_ray  # Ray is imported only for this row
    except ModuleNotFoundError as e:  # an image without Ray (a GPU's): the row says so, the command fails, not the run
        if (e.name or "").split(".")[0] != "ray":
            raise
        return [row("arena_workers", label, [], "×", ">=", target, f"not measured: Ray cannot be imported ({e})")]
    conv = load_conversation(GRID_WORKLOAD)
    settings = ArenaSettings(policies=DEFAULT_COMPARISON, budgets=cfg.grid_budgets, max_new_tokens=cfg.new_tokens,
                             max_turns=cfg.grid_turns)
    check_grid(lm, [conv], settings)
    source = ModelSpec(lm.facts.name, device=lm.facts.device, dtype=lm.facts.dtype)
    wall: dict[int, list[float]] = {1: [], 2: []}
    start: dict[int, list[float]] = {1: [], 2: []}
    speedups, errors = [], set()
    for run in range(cfg.grid_runs):
        for n in (1, 2) if run % 2 == 0 else (2, 1):  # alternate which side runs first: an order effect cancels
            if progress:
                progress((len(wall[1]) + len(wall[2])) / (2 * cfg.grid_runs),
                         f"arena grid on {n} Ray worker{'s' if n > 1 else ''} {run + 1}/{cfg.grid_runs}")
            up: list[float] = []
            t0 = host_clock()
            table = run_arena_ray(source, [conv], settings, RayPlan(workers=n),
                                  first_worker_up=lambda: up.append(host_clock()))
            wall[n].append(host_clock() - up[0])
            start[n].append(up[0] - t0)
            errors |= set(table["error"].dropna())
        speedups.append(wall[1][-1] / wall[2][-1])
    med = statistics.median
    cells, turns = len(settings.budgets), settings.turns_of(conv)
    return [
        row("arena_workers", label, speedups, "×", ">=", target,
             f"{cells} cells ({conv.name}, {turns} turn{'s' * (turns != 1)}, {', '.join(DEFAULT_COMPARISON)} at "
             f"budgets {', '.join(map(str, settings.budgets))}); grid {med(wall[1]):.1f} s vs {med(wall[2]):.1f} s; "
             f"starting Ray and loading the model {med(start[1]):.1f} s / {med(start[2]):.1f} s more per run"
             + (f"; failed: {'; '.join(sorted(errors))}" if errors else "")),
    ]


@torch.no_grad()
def bench_sparse_and_quantized(lm: LoadedModel, cfg: BenchConfig, progress: Progress | None = None) -> list[BenchRow]:
    """Quest's decode step and its attention against Full's at a long context, and the bytes Quest and KIVI hold."""
    if progress:
        progress(0.0, "quest and kivi")
    ids, quest, kivi = prose_ids(lm, cfg.memory_tokens), make_policy("quest"), make_policy("kivi", bits=2)
    full, sparse = KVState(lm), KVState(lm, reads=quest.reads(cfg.memory_tokens // 4))
    packed = KVState(lm, quant=kivi.quantizer())
    append_together([full, sparse, packed], ids, logits_to_keep=1)  # one prefill: the caches are still identical
    sparse.set_decoding(True)
    # successive decoding steps, as a reply is generated (KVState.generate): each appends in place
    step, pos, lengths = torch.tensor([ids[0]]), full.next_positions(cfg.decode_steps + 1), full.lengths()
    took: dict[str, list[tuple[float, float]]] = {"full": [], "quest": []}  # (step, attention) seconds per run
    for run in range(cfg.decode_steps + 1):  # the first run warms up (Quest takes its page extremes once)
        for name, state in (("full", full), ("quest", sparse))[:: 1 if run % 2 else -1]:
            with forward_context(attention_seconds=[]) as block:
                seconds = time_call(lambda: state.forward(step, pos[run : run + 1], None, already=run))[0].median
            took[name] += [(seconds, sum(block.attention_seconds))] if run else []
    read = sparse.reads.pages_read_last()  # [layer][kv_head] the pages the last step's query heads read together
    pages = -(-sparse.lengths()[0] // quest.page_size)  # every layer holds every token (Quest evicts nothing)
    union = statistics.mean(len(p) for layer in read[quest.dense_layers :] for p in layer) / pages
    for state in (full, sparse):
        state.truncate(lengths)
    ratio = [[q[i] / f[i] for f, q in zip(took["full"], took["quest"])] for i in (0, 1)]
    ms = {name: [statistics.median(t[i] for t in runs) * 1000 for i in (0, 1)] for name, runs in took.items()}
    key_bytes = lm.facts.kv_bytes(sum(full.lengths()), layers=1) // 2  # the keys: half of K and V
    metadata = sparse.kv_bytes() - full.kv_bytes()
    context = (f"{len(ids)}-token context, token budget {cfg.memory_tokens // 4} (pages of {quest.page_size}; the "
               f"first {quest.dense_layers} layers read all)")
    return [
        row("quest_reads", "Keys a Quest decode step reads / keys held", [sparse.reads.read_share], "×", "<=", 0.35,
             f"{context}; each query head reads the keys of its pages only, where they lie"),
        row("quest_step", "Quest decode step / Full decode step", ratio[0], "×", "<=", 1.0, f"{context}; "
             f"{ms['quest'][0]:.1f} ms vs {ms['full'][0]:.1f} ms"),
        row("quest_attention", "Quest's attention / Full's in a decode step", ratio[1], "×", "<=", 0.5, "every "
             f"layer's attention call, pages chosen and read: {ms['quest'][1]:.1f} ms vs {ms['full'][1]:.1f} ms; a KV "
             f"head's query heads read {union:.0%} of its pages between them (each once), after all pages' extremes"),
        row("quest_metadata", "Quest's page metadata / key bytes", [metadata / key_bytes], "×", "<=", 0.125 + 1e-9,
             f"a min and a max key per page of {quest.page_size}: 2/{quest.page_size} of the key bytes, "
             f"{metadata / 1e6:.2f} MB on {len(ids)} tokens"),
        row("kivi_memory", "KIVI-2 held tensor bytes / Full's at equal tokens", [packed.kv_bytes() / full.kv_bytes()],
             "×", "<=", 0.2, f"{len(ids)} tokens, group {kivi.group_size}, residual {kivi.residual} in full precision; "
             f"the nbytes of its codes, a min and a max per group ({lm.facts.dtype})"),
    ]


BENCHES = (bench_chat, bench_turns, bench_rag, bench_edit, bench_probe_memory, bench_sparse_and_quantized, bench_stream,
           bench_workers)


def run_bench(lm: LoadedModel, cfg: BenchConfig, progress: Progress | None = None) -> Iterator[list[BenchRow]]:
    """Each benchmark's rows as it finishes, in table order (a run stopped midway keeps the benchmarks done); each
    benchmark reports its own share of ``progress``."""
    for i, bench in enumerate(BENCHES):
        yield bench(lm, cfg, progress and part_of(progress, i / len(BENCHES), (i + 1) / len(BENCHES)))
