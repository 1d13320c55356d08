"""SCBench sessions (Li et al., 2024): its published records as kvlab conversations, scored by its metrics.

Schema (``microsoft/SCBench`` on the hub, one JSONL or parquet file per task): a record is an object with
``id``, ``context`` (the shared context) and ``multi_turns``: a list of ``{"input", "answer", "options"?}``.
One record is one session: turn 1 is the task's prompt with the context and the first question, each later
turn one question, and the golden answers are the replies the history carries (SCBench's multi-turn mode;
kvlab's single-shot mode asks each later question against turn 1's cache, SCBench's multi-request mode).

Prompts follow MInference ``scbench/eval_utils.py`` (``multiturn_templates`` for turn 1 and the chat-template
follow-ups for later turns); metrics follow ``scbench/compute_scores.py`` where the answer is a string or an
option (``kvlab.workloads.chat.metrics``). Summaries (ROUGE), Chinese QA (F1) and RepoQA (pass@1) are loaded
with their golden answers but not scored. A context longer than the model's is cut in the middle as
``scbench/run_scbench.py`` does (``truncate_input``: the first and last halves of the first prompt's tokens).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvlab.engine.chatformat import chat_format
from kvlab.engine.facts import LoadedModel
from kvlab.errors import KvlabError
from kvlab.registry import Registry
from kvlab.workloads.chat.conversation import MAX_TURNS, Conversation, Turn
from kvlab.workloads.chat.metrics import METRICS

_PLAIN = "{context}\n\n{input}"
_CHOICE = "Question: {question}\nA. {A}\nB. {B}\nC. {C}\nD. {D}\n\nThe the correct answer is"
_KV = "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}"


@dataclass(frozen=True)
class ScbenchTask:
    """One SCBench task: turn 1's prompt with the context and first question and a later turn's message (SCBench's
    ``multiturn_templates`` and chat-template follow-ups), and the metric its answers are scored by
    (``compute_scores.py``'s ``NAME_TO_SCORE_GETTER``; None: ROUGE, F1 or pass@1, loaded but not scored here)."""

    name: str
    label: str
    summary: str
    metric: str | None
    first: str = _PLAIN
    follow_up: str = "{input}"
    mixed: bool = False  # each turn names its own task and is scored by that task's metric

    def __post_init__(self) -> None:
        if self.metric is not None:
            METRICS.key(self.metric)  # a metric misspelt here is refused when kvlab loads, not when a turn is scored


TASKS: Registry[ScbenchTask] = Registry("SCBench task", (
    ScbenchTask("scbench_kv", "Retr.KV", "the value of a key in a large JSON object", "contains", _KV),
    ScbenchTask("scbench_kv_hard", "Retr.KV (hard)", "the value of a key in a JSON object of look-alike keys",
                "contains", _KV),
    ScbenchTask("scbench_kv_compressible", "Retr.KV (compressible)", "the value of a key in a repetitive passage",
                "contains", "Extract the value corresponding to the specified key in the following passage.\n\n"
                            "{context}\n\n{input}"),
    ScbenchTask("scbench_prefix_suffix", "Retr.Prefix-Suffix", "the string with a given prefix and suffix",
                "contains"),
    ScbenchTask("scbench_hashhop", "Retr.MultiHop", "the end of a chain of hashes", "contains"),
    ScbenchTask("scbench_vt", "Variable tracking", "the variables a chain of assignments gives one value",
                "contains"),
    ScbenchTask("scbench_passkey", "Retr.PassKey", "a number hidden in irrelevant text", "first_number",
                "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                "I will quiz you about the important information.\n\n{context}\n\n{input}"),
    ScbenchTask("scbench_mf", "Math.Find", "the largest or smallest number of a list", "first_number",
                "{prefix}\n\n{context}\n\n{input}", "{prefix}\n\n{input}"),
    ScbenchTask("scbench_choice_eng", "En.MultiChoice", "multiple-choice questions on a novel", "option",
                "Read the book and answer the question.\n\n{context}\n\n" + _CHOICE, _CHOICE),
    ScbenchTask("scbench_qa_eng", "En.QA", "questions on a novel", "contains_any",
                "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\n"
                "Question: {question}\nAnswer:", "Question: {question}\nAnswer:"),
    ScbenchTask("scbench_many_shot", "ICL.ManyShot", "a label after many examples", "contains_any"),
    ScbenchTask("scbench_summary", "En.Sum", "a summary of a novel (ROUGE: not scored here)", None),
    ScbenchTask("scbench_qa_chn", "Zh.QA", "questions on a Chinese novel (F1: not scored here)", None,
                "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：", "问题：{question}\n答案："),
    ScbenchTask("scbench_repoqa", "Code.RepoQA", "a described function repeated from a repository (pass@1: not "
                "scored here)", None,
                "Based on the function description and code context, please retrieve and repeat the exact "
                "described function from the code context in a code block wrapped by ```:\n\n{context}\n\n{input}"),
    ScbenchTask("scbench_summary_with_needles", "Mix.Sum+NIAH", "summary turns with needle questions between", None,
                mixed=True),
    ScbenchTask("scbench_repoqa_and_kv", "Mix.RepoQA+KV", "RepoQA turns with key-value questions between", None,
                mixed=True),
))
# a file in SCBench's schema that names no task: its context and question plainly, every turn by kvlab's rule
_UNNAMED = ScbenchTask("session", "SCBench session", "a file of no named task", "contains")
_ANSWER_TYPES = (str, int, float, list)


def task_of(name: str) -> str | None:
    """The SCBench task a file or hub name names (``scbench_kv.jsonl`` -> ``scbench_kv``), or None."""
    match = re.search(r"scbench_[a-z_]+?(?=\.|$|-|\s)", name)
    if match is None:
        return None
    task = match.group(0)
    return task if task in TASKS else None


def _answer_refs(answer: object) -> list[str]:
    items = answer if isinstance(answer, list) else [answer]
    return [str(a) for a in items]


def _turn_metric(spec: ScbenchTask, turn: dict) -> str | None:
    """The metric a turn of ``spec`` is scored by: the task's, a mixed task's turn its own task's (None: not scored,
    where that task is unknown too)."""
    if spec.mixed:
        own = TASKS.get(str(turn.get("task")))
        return None if own is None or own.mixed else own.metric
    return spec.metric


def _fields(task: str | None, turn: dict, context: str | None) -> dict:
    """The template fields of one turn: the question, options, mf's prefix, the context."""
    fields = {"input": turn["input"], "question": turn["input"], "context": context}
    if "options" in turn:
        fields |= dict(zip("ABCD", turn["options"]))
    if task == "scbench_mf":
        target = re.findall(r"The .+ is", turn["input"])
        fields["prefix"] = f"What is {target[0].lower()[:-3]}?" if target else ""
    return fields


def _check_turn(where: str, task: str | None, index: int, turn: object) -> dict:
    at = f"{where}: multi_turns[{index}]"
    if not isinstance(turn, dict):
        raise KvlabError(f"{at} must be an object with 'input' and 'answer', not {type(turn).__name__}")
    for key in ("input", "answer"):
        if key not in turn:
            raise KvlabError(f"{at} has no '{key}'")
    if not isinstance(turn["input"], str) or not turn["input"].strip():
        raise KvlabError(f"{at}: 'input' must be a non-empty string")
    answer = turn["answer"]
    if not isinstance(answer, _ANSWER_TYPES) or isinstance(answer, bool) or not _answer_refs(answer) \
            or not all(r.strip() for r in _answer_refs(answer)):
        raise KvlabError(f"{at}: 'answer' must be a non-empty string, number or list of them")
    options = turn.get("options")
    if task == "scbench_choice_eng" or options is not None:
        if not (isinstance(options, list) and len(options) == 4 and all(isinstance(o, str) for o in options)):
            raise KvlabError(f"{at}: 'options' must be a list of four strings")
        if str(answer) not in options:
            raise KvlabError(f"{at}: the 'answer' is not one of its 'options'")
    return turn


def _scored(metric: str | None, turn: dict) -> str | None:
    """The turn's kvlab answer for ``metric``: references one per line, an option's letter then its text."""
    if metric is None:
        return None
    refs = _answer_refs(turn["answer"])
    if metric == "option":
        text = str(turn["answer"])
        return f"{'ABCD'[turn['options'].index(text)]}\n{text}"
    return refs[0] if metric == "first_number" else "\n".join(refs)


def record_conversation(record: object, task: str | None, stem: str, index: int) -> Conversation:
    """One SCBench record as a conversation; KvlabError names the record and the offending field."""
    where = f"record {index + 1}"
    if not isinstance(record, dict):
        raise KvlabError(f"{where} must be an object with 'id', 'context' and 'multi_turns', "
                         f"not {type(record).__name__}")
    for key in ("id", "context", "multi_turns"):
        if key not in record:
            raise KvlabError(f"{where} has no '{key}'")
    where = f"record {index + 1} (id {record['id']})"
    context, raw = record["context"], record["multi_turns"]
    if not isinstance(context, str) or not context.strip():
        raise KvlabError(f"{where}: 'context' must be a non-empty string")
    if not isinstance(raw, list) or not raw:
        raise KvlabError(f"{where}: 'multi_turns' must be a non-empty list")
    if len(raw) > MAX_TURNS:
        raise KvlabError(f"{where}: 'multi_turns' has {len(raw)} turns; at most {MAX_TURNS} are allowed")
    spec = TASKS[task] if task else _UNNAMED
    turns = []
    for i, turn in enumerate(raw):
        turn = _check_turn(where, task, i, turn)
        template = spec.first if i == 0 else spec.follow_up
        metric = _turn_metric(spec, turn)
        golden = ", ".join(_answer_refs(turn["answer"]))
        turns.append(Turn(user=template.format(**_fields(task, turn, context)), golden=golden,
                          answer=_scored(metric, turn), metric=metric or "contains"))
    metrics = sorted({t.metric for t in turns if t.answer is not None})
    unscored = sum(t.answer is None for t in turns)
    description = (f"SCBench {task or 'session'}, record {record['id']}: {len(turns)} questions on a shared context "
                   f"of {len(context)} characters; metric {', '.join(metrics) or 'none'}"
                   + (f"; {unscored} turn(s) not scored (their SCBench metric is ROUGE, F1 or pass@1, or their task "
                      "unknown)"
                      if unscored else ""))
    return Conversation(name=f"{task or stem}-{record['id']}", description=description, system=None,
                        turns=tuple(turns), truncatable=True)


def records_conversations(records: list, name: str, record: str | None = None) -> list[Conversation]:
    """Every record (or only the one whose id is ``record``) of a file or hub split named ``name``."""
    task = task_of(name)
    stem = name.rsplit(".", 1)[0]
    if not records:
        raise KvlabError(f"{name} holds no SCBench record")
    if record is not None:
        ids = [str(r.get("id")) if isinstance(r, dict) else None for r in records]
        if record not in ids:
            shown = ", ".join(i for i in ids[:8] if i is not None)
            raise KvlabError(f"{name} has no record with id {record!r}; its ids: {shown}{' …' if len(ids) > 8 else ''}")
        index = ids.index(record)
        return [record_conversation(records[index], task, stem, index)]
    return [record_conversation(r, task, stem, i) for i, r in enumerate(records)]


def hub_records(task: str) -> list:
    """A task's test split from the hub through ``datasets`` (the user asked for it by name)."""
    task = TASKS.key(task)
    try:
        from datasets import load_dataset  # optional: only --scbench needs it
    except ImportError:
        raise KvlabError("--scbench needs the datasets package, which is not installed; download the task's JSONL "
                         "from huggingface.co/datasets/microsoft/SCBench and pass the file instead") from None
    try:
        return [dict(r) for r in load_dataset("microsoft/SCBench", task, split="test")]
    except Exception as exc:  # no network, no such config: said in one line
        raise KvlabError(f"could not load SCBench {task} from the hub: {type(exc).__name__}: {exc}") from None


def fit_to_context(conv: Conversation, lm: LoadedModel, max_new_tokens: int) -> Conversation:
    """``conv`` as it fits ``lm``'s context: a truncatable turn 1 is cut in the middle (SCBench's rule: the
    first and last halves of its tokens), and the notice says so. Other conversations come back as they are."""
    if not conv.truncatable:
        return conv
    fmt = chat_format(lm.tokenizer, conv.system)
    limit = lm.facts.context_length
    first = conv.turns[0].user
    others = len(fmt.start_ids) + len(lm.encode(fmt.opening + fmt.user_block(""))) + max_new_tokens
    others += sum(len(lm.encode(fmt.user_block(t.user))) for t in conv.turns[1:])
    others += sum(len(lm.encode(t.golden + fmt.assistant_end)) for t in conv.turns if t.golden)
    ids = lm.encode(first)
    n_before, keep = len(ids), limit - others
    if n_before <= keep:
        return conv
    if keep < 64:
        raise KvlabError(f"{conv.name}: its questions and answers alone need {others} of {lm.facts.name}'s "
                         f"{limit} positions; no context would be left")
    target = keep
    while True:  # decoding then encoding at the cut may add a token or two: cut a little more
        half = target // 2
        text = lm.decode(ids[:half] + ids[-half:])
        n_after = len(lm.encode(text))
        if n_after <= keep:
            break
        target -= n_after - keep
    turns = (Turn(user=text, golden=conv.turns[0].golden, prefill=conv.turns[0].prefill,
                  answer=conv.turns[0].answer, metric=conv.turns[0].metric), *conv.turns[1:])
    notice = (f"{conv.name}: turn 1 (the shared context and first question) was cut in the middle from {n_before} to "
              f"{n_after} tokens to fit {lm.facts.name}'s context of {limit} (SCBench keeps the first and last halves)")
    return Conversation(name=conv.name, description=conv.description, system=conv.system, turns=turns,
                        notice=notice, truncatable=False)
