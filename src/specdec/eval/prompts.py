"""Prompt-only sets for live runs: Spec-Bench, MT-Bench, Vicuna-bench, HumanEval, MBPP, GSM8K, EAGLE subsets.

    name, items = load_prompts("humaneval", limit=80)        # -> [PromptRecord]
    ids = render_prompt(item, tokenizer)                     # token ids for the target

Code sets are raw code prompts (HumanEval: the task's ``prompt``; MBPP: a docstring with the task text and its
first test), trailing whitespace removed (see ``_record``), after the tokenizer's BOS token. Chat sets (question
``turns``, GSM8K ``question``) are chat messages: rendered with the tokenizer's chat template when it has one, else as
``role: content`` lines followed by ``assistant: `` (the generation cue). A generic JSONL file works too: ``prompt``
(text or messages) per line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdec.eval.loaders import TraceError, read_jsonl, resolve_data_dir
from specdec.eval.records import PromptRecord
from specdec.eval.tokenization import message_text

PROMPT_SETS: dict[str, str] = {
    "spec_bench": "spec_bench/question.jsonl",
    "mt_bench": "mt_bench/question.jsonl",
    "vicuna_bench": "vicuna_bench/question.jsonl",
    "humaneval": "human_eval/HumanEval.jsonl.gz",
    "mbpp": "mbpp/mbpp.jsonl",
    "gsm8k": "gsm8k/test.jsonl",
    "eagle_alpaca": "eagle/alpaca_question.jsonl",
    "eagle_gsm8k": "eagle/gsm8k_question.jsonl",
    "eagle_humaneval": "eagle/humaneval_question.jsonl",
    "eagle_qa": "eagle/qa_question.jsonl",
    "eagle_sum": "eagle/sum_question.jsonl",
}
GENERATION_CUE = "assistant: "


def _record(i: int, row: dict[str, Any], path: Path) -> PromptRecord:
    # Code prompts lose trailing whitespace: BPE merges "\n" with the next line's indentation, so a prompt cut
    # after a bare "\n" is a token boundary the model never saw (the shared target answers it with EOS).
    if "task_id" in row and "prompt" in row:  # HumanEval
        return PromptRecord(
            str(row["task_id"]), str(row["prompt"]).rstrip(), meta={"entry_point": row.get("entry_point")}
        )
    if "text" in row and "test_list" in row:  # MBPP
        tests = row["test_list"][0] if row["test_list"] else ""
        return PromptRecord(str(row.get("task_id", i)), f'"""\n{row["text"]}\n{tests}\n"""')
    if "turns" in row:  # FastChat / Spec-Bench / EAGLE questions
        turns = [str(t) for t in row["turns"]]
        return PromptRecord(
            str(row.get("question_id", i)),
            [{"role": "user", "content": turns[0]}],
            turns[1:],
            {"category": row.get("category", "")},
        )
    if "question" in row:  # GSM8K test
        return PromptRecord(str(i), [{"role": "user", "content": str(row["question"])}])
    if "prompt" in row:  # generic
        return PromptRecord(str(row.get("id", i)), row["prompt"])
    raise TraceError(
        f"{path}: record {i + 1} has keys {sorted(row)[:8]}; expected a prompt set (turns, "
        "prompt, task_id+prompt, text+test_list or question)"
    )


def load_prompts(source: str, *, limit: int | None = None, data: str | None = None) -> tuple[str, list[PromptRecord]]:
    """(name, prompt records) of a named set in ``PROMPT_SETS`` or a JSONL path."""
    if source in PROMPT_SETS:
        name, path = source, resolve_data_dir(data) / PROMPT_SETS[source]
        if not path.exists():
            raise TraceError(
                f"{path}: missing file for prompt set {source!r}; point --data (or SPECDEC_DATA) "
                "at the shared data folder"
            )
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise TraceError(f"{path}: no such file; expected a prompt JSONL or one of {', '.join(PROMPT_SETS)}")
        name = path.name.split(".")[0]
    rows = read_jsonl(path)[:limit]
    if not rows:
        raise TraceError(f"{path}: empty dataset (0 prompts)")
    return name, [_record(i, r, path) for i, r in enumerate(rows)]


def render_prompt(item: PromptRecord, tokenizer: Any, *, bos: bool = True) -> list[int]:
    """Token ids of a prompt for a HF tokenizer (chat template if it has one, else ``role: content`` lines).

    ``bos``: start with the tokenizer's BOS token when it has one (the shared models were trained on documents
    that follow ``<|endoftext|>``); never doubled when the tokenizer or template already adds it.
    """
    if isinstance(item.prompt, str):
        ids = list(tokenizer(item.prompt)["input_ids"])
    elif getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(item.prompt, add_generation_prompt=True, tokenize=True)
        ids = list(out["input_ids"] if isinstance(out, dict) else out)
    else:
        ids = list(tokenizer("".join(message_text(m) for m in item.prompt) + GENERATION_CUE)["input_ids"])
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos and bos_id is not None and (not ids or ids[0] != bos_id):
        ids = [int(bos_id)] + ids
    return ids
