"""Trace formats: each format's records read into ``RawItem``s (generic JSONL, AlpacaEval / Code Alpaca, FastChat
answers, GSM8K) and tokenized, and OpenHands tarballs streamed and tokenized member by member. A malformed record
is a ``TraceError`` naming the file and the record.
"""

from __future__ import annotations

import json
import tarfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specdec.eval.records import TraceRecord, as_ids
from specdec.eval.tokenization import TextTokenizer, encode_messages, join_content_and_calls, message_text
from specdec.eval.trace_sources import GSM8K_SOLUTION_KEY, TraceError, decode_text, one_line, read_json, read_jsonl

RECORD_ERRORS = (KeyError, IndexError, TypeError, AttributeError, ValueError)  # a record of the wrong shape


@dataclass
class RawItem:
    """One record before tokenization: prompt = text | messages (list) | ids (ndarray); response = text | ids."""

    id: str
    prompt: Any
    response: Any
    group: str = ""


@contextmanager
def at_record(path: Path, index: int, expected: str) -> Iterator[None]:
    """Turn a malformed record's KeyError/TypeError/... into a TraceError naming the file and record (1-based)."""
    try:
        yield
    except TraceError:
        raise
    except RECORD_ERRORS as exc:
        what = f"missing key {exc}" if isinstance(exc, KeyError) else one_line(exc)
        raise TraceError(f"{path}: record {index}: malformed ({what}); expected {expected}") from None


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected text, got {type(value).__name__}")
    return value


def _items_generic(path: Path, limit: int | None, opts: dict[str, Any]) -> list[RawItem]:
    items = []
    for i, r in enumerate(read_jsonl(path)[:limit]):
        rid, group = str(r.get("id", i)), str(r.get("group", ""))
        if "prompt_ids" in r and "response_ids" in r:
            with at_record(path, i + 1, "'prompt_ids' and 'response_ids' as lists of token ids (integers >= 0)"):
                ids = [as_ids(r[k], what=k) for k in ("prompt_ids", "response_ids")]
            items.append(RawItem(rid, ids[0], ids[1], group))
        elif "prompt" in r and "response" in r:
            prompt = r["prompt"]
            if not isinstance(prompt, (str, list)) or not isinstance(r["response"], str):
                raise TraceError(
                    f"{path}: record {i + 1}: 'prompt' must be text or a list of chat messages and 'response' text"
                )
            items.append(RawItem(rid, prompt, r["response"], group))
        else:
            raise TraceError(
                f"{path}: record {i + 1} has keys {sorted(r)[:8]}; expected prompt+response or prompt_ids+response_ids"
            )
    return items


def _items_alpaca(path: Path, limit: int | None, opts: dict[str, Any]) -> list[RawItem]:
    rows = read_json(path)
    if not isinstance(rows, list):
        raise TraceError(f"{path}: expected a JSON list of {{instruction, output}} objects")
    items = []
    for i, r in enumerate(rows[:limit]):
        if not isinstance(r, dict) or "instruction" not in r or "output" not in r:
            raise TraceError(f"{path}: record {i + 1} lacks 'instruction'/'output'")
        with at_record(path, i + 1, "'instruction', 'input' and 'output' as text"):
            prompt = _text(r["instruction"]) + (f"\n{_text(r['input'])}" if r.get("input") else "")
            items.append(RawItem(str(i), prompt, _text(r["output"] or "")))
    return items


def _find_questions(path: Path) -> dict[Any, dict[str, Any]]:
    for cand in (path.parent / "question.jsonl", path.parent.parent / "question.jsonl"):
        if cand.exists():
            with at_record(cand, 0, "a question_id per question"):
                return {q["question_id"]: q for q in read_jsonl(cand)}
    raise TraceError(f"{path}: FastChat answers need question.jsonl in {path.parent} or its parent folder")


def _items_answers(path: Path, limit: int | None, opts: dict[str, Any]) -> list[RawItem]:
    questions = _find_questions(path)
    items = []
    for i, a in enumerate(read_jsonl(path)[:limit]):
        with at_record(path, i + 1, "FastChat answers: question_id and choices[0].turns (a list of text)"):
            qid = a.get("question_id")
            if qid not in questions:
                raise TraceError(f"{path}: question_id {qid!r} not found in question.jsonl")
            q_turns = [_text(t) for t in questions[qid]["turns"]]
            a_turns = [_text(t) for t in a["choices"][0]["turns"]]
        n_turns = min(len(q_turns), len(a_turns)) if opts.get("all_turns") else 1
        history: list[dict[str, str]] = []
        for t in range(n_turns):
            if t == 0:
                prompt: Any = q_turns[0]
            else:
                prompt = history + [{"role": "user", "content": q_turns[t]}]
            items.append(RawItem(f"{qid}/t{t + 1}", prompt, a_turns[t], str(qid)))
            history += [{"role": "user", "content": q_turns[t]}, {"role": "assistant", "content": a_turns[t]}]
    return items


def _items_gsm8k(path: Path, limit: int | None, opts: dict[str, Any]) -> list[RawItem]:
    key = opts.get("gsm8k_key", GSM8K_SOLUTION_KEY)
    items = []
    for i, r in enumerate(read_jsonl(path)[:limit]):
        if key not in r:
            raise TraceError(f"{path}: record {i + 1} lacks {key!r}; expected GSM8K example_model_solutions rows")
        with at_record(path, i + 1, f"'question' text and {key}.solution text"):
            items.append(RawItem(str(i), _text(r["question"]), _text(r[key]["solution"])))
    return items


def _openhands_members(tf: tarfile.TarFile, limit: int | None) -> list[tuple[str, tarfile.TarInfo]]:
    """(instance, member) for the llm_completions JSON files of the first ``limit`` instances (sorted)."""
    found: dict[str, list[tarfile.TarInfo]] = {}
    for m in tf.getmembers():
        parts = m.name.split("/")
        if m.isfile() and m.name.endswith(".json") and len(parts) >= 3 and parts[-3] == "llm_completions":
            found.setdefault(parts[-2], []).append(m)
    chosen = sorted(found)[:limit]
    return [(inst, m) for inst in chosen for m in found[inst]]


def _open_openhands_tar(path: Path) -> tarfile.TarFile:
    """The open tarball (the caller closes it); a ``TraceError`` when it cannot be opened as a tar archive."""
    try:
        return tarfile.open(path)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise TraceError(
            f"{path}: not a readable tar archive ({one_line(exc)}); expected an OpenHands llm_completions tarball"
        ) from None


def openhands_tokenized(path: Path, limit: int | None, tok: TextTokenizer, progress: bool) -> list[TraceRecord]:
    """Stream the tarball member by member (no extraction), tokenizing as it goes (~29 M prompt tokens)."""
    tf = _open_openhands_tar(path)
    calls = []
    try:
        with tf:
            members = _openhands_members(tf, limit)
            if not members:
                raise TraceError(f"{path}: no llm_completions/<instance>/*.json members; expected an OpenHands tarball")
            for inst, m in _progress(members, progress, f"tokenize {path.name[:24]}"):
                calls.append(_openhands_call(path, tf, inst, m, tok))
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise TraceError(f"{path}: truncated or corrupt tar archive ({one_line(exc)})") from None
    calls.sort(key=lambda c: c[0])
    return [rec for _, rec in calls]


def _openhands_call(
    path: Path, tf: tarfile.TarFile, inst: str, m: tarfile.TarInfo, tok: TextTokenizer
) -> tuple[tuple[str, float, str], TraceRecord]:
    """One LLM call of an OpenHands tarball: (sort key, record); a TraceError naming the member if malformed."""
    try:
        d = json.loads(decode_text(path, tf.extractfile(m).read()))
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: member {m.name}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    try:
        msg = d["response"]["choices"][0]["message"]
        response = join_content_and_calls(msg.get("content"), msg.get("tool_calls"))
        prompt = encode_messages(tok, [message_text(x) for x in d["messages"]])
        key = (inst, float(d["timestamp"]), m.name)
    except RECORD_ERRORS as exc:
        what = f"missing key {exc}" if isinstance(exc, KeyError) else one_line(exc)
        raise TraceError(
            f"{path}: member {m.name}: malformed ({what}); expected an OpenHands completion with "
            "messages, response.choices[0].message and timestamp"
        ) from None
    rid = f"{inst}/{m.name.rsplit('/', 1)[-1]}"
    return key, TraceRecord(rid, prompt, tok.encode(response), inst)


def _progress(items: list, enabled: bool, desc: str) -> Iterator:
    if not enabled:
        return iter(items)
    from tqdm import tqdm

    return iter(tqdm(items, desc=desc, unit="rec", leave=False))


ITEM_LOADERS: dict[str, Callable[[Path, int | None, dict[str, Any]], list[RawItem]]] = {
    "generic": _items_generic,
    "alpaca": _items_alpaca,
    "answers": _items_answers,
    "gsm8k": _items_gsm8k,
}


def tokenize_items(items: list[RawItem], tok: TextTokenizer | None, path: Path) -> list[TraceRecord]:
    out = []
    for i, it in enumerate(items):
        if isinstance(it.prompt, np.ndarray):
            prompt, response = it.prompt, it.response
        else:
            assert tok is not None
            with at_record(path, i + 1, "a prompt as text or a list of {role, content} messages"):
                if isinstance(it.prompt, list):
                    prompt = encode_messages(tok, it.prompt)
                else:
                    prompt = tok.encode(it.prompt)
                response = tok.encode(it.response)
        try:
            out.append(TraceRecord(it.id, prompt, response, it.group))
        except ValueError as exc:
            raise TraceError(f"{path}: {exc}") from None
    return out
