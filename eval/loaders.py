"""Trace loaders: every shared-data trace format and the generic JSONL format -> ``TraceRecord`` lists.

    name, records = load_traces("openhands_swebench", tokenizer=None, limit=None)
    name, records = load_traces("my_traces.jsonl", tokenizer="../shared/models/code-target-53m", limit=400)

``source`` is a name of ``SHARED_TRACE_SETS`` (resolved under ``$SPECDEC_DATA`` or the shared data folder) or a
path. Formats (detected from the file name and the first record):

* ``generic``   JSONL, one object per line: ``prompt`` (text, or chat messages ``[{"role", "content"}]``) and
                ``response`` (text), or ``prompt_ids`` / ``response_ids`` (token ids); optional ``id``, ``group``.
* ``openhands`` OpenHands ``llm_completions`` tarball (.tar.gz): one record per LLM call, instances in sorted
                order, calls by timestamp; prompt = messages, response = content + rendered tool calls.
                ``limit`` counts instances here, so agent episodes are never cut in the middle.
* ``alpaca``    a JSON list of ``instruction`` [+ ``input``] -> ``output`` (AlpacaEval outputs, Code Alpaca).
* ``answers``   FastChat MT-Bench / Vicuna-bench answer JSONL (``question_id``, ``choices[0].turns``), joined
                with ``question.jsonl`` in the same or the parent folder. Turn 1 only (the anchors' rule);
                ``all_turns=True`` adds later turns with the earlier conversation as chat messages.
* ``gsm8k``     GSM8K ``example_model_solutions.jsonl(.gz)``: ``question`` -> ``175b_finetuning.solution``.

Prompts and responses are tokenized exactly like ``../shared/data/anchors_replay.py`` (see
``specdec.eval.tokenization``). Tokenized sets are cached under ``$SPECDEC_CACHE`` (default
``~/.cache/specdec/traces``) keyed by the file's sha256, the tokenizer's fingerprint, ``limit`` and options.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specdec.eval.records import TraceRecord, as_ids
from specdec.eval.tokenization import (
    TextTokenizer,
    encode_messages,
    join_content_and_calls,
    load_tokenizer,
    message_text,
)
from specdec.paths import data_dir

LOADER_VERSION = 1  # bump when rendering/tokenization changes (invalidates the cache)
MEDUSA_VICUNA_7B = (
    "mt_bench/model_answer_medusa_vicuna/medusa-vicuna-7b-v1.3-temperature-0.0-"
    "posterior_threshold-0.09-posterior_alpha-0.3.jsonl"
)
OPENHANDS_TAR = (
    "agent/openhands_swebench_verified/claude-3-5-sonnet-20241022_maxiter_50_N_"
    "v0.15.0-no-hint-no-condensation-run_1.tar.gz"
)
# The ANCHORS.md sets: name -> path relative to the shared data folder.
SHARED_TRACE_SETS: dict[str, str] = {
    "alpaca_eval_llama31_8b": "alpaca_eval/Meta-Llama-3.1-8B-Instruct-Turbo.model_outputs.json.gz",
    "code_alpaca": "code/code_alpaca_2k.json",
    "gsm8k_175b": "gsm8k/example_model_solutions.jsonl.gz",
    "mt_bench_vicuna7b_t1": MEDUSA_VICUNA_7B,
    "openhands_swebench": OPENHANDS_TAR,
}
FORMATS = ("generic", "openhands", "alpaca", "answers", "gsm8k")
GSM8K_SOLUTION_KEY = "175b_finetuning"


class TraceError(ValueError):
    """A trace source cannot be used; the one-line message names the file and what was expected."""


@dataclass
class RawItem:
    """One record before tokenization: prompt = text | messages (list) | ids (ndarray); response = text | ids."""

    id: str
    prompt: Any
    response: Any
    group: str = ""


# ------------------------------------------------------------------------------------------- paths
def resolve_data_dir(data: str | os.PathLike[str] | None = None) -> Path:
    """``data``, else ``$SPECDEC_DATA``, else the shared data folder (``specdec.paths.data_dir``)."""
    if data:
        return Path(data).expanduser()
    env = os.environ.get("SPECDEC_DATA")
    return Path(env).expanduser() if env else data_dir()


def resolve_source(source: str | os.PathLike[str], data: str | os.PathLike[str] | None = None) -> tuple[str, Path]:
    """(dataset name, file path) for a shared set name or a path; raises TraceError when missing."""
    src = str(source)
    if src in SHARED_TRACE_SETS:
        path = resolve_data_dir(data) / SHARED_TRACE_SETS[src]
        if not path.exists():
            raise TraceError(
                f"{path}: missing file for trace set {src!r}; point --data (or SPECDEC_DATA) at the shared data folder"
            )
        return src, path
    path = Path(src).expanduser()
    if not path.exists():
        raise TraceError(
            f"{path}: no such file; expected a trace file (.jsonl, .json[.gz], .tar.gz) or one of the "
            f"shared sets: {', '.join(SHARED_TRACE_SETS)}"
        )
    for name, rel in SHARED_TRACE_SETS.items():
        if path.resolve().as_posix().endswith(rel):
            return name, path
    stem = path.name
    for ext in (".gz", ".tar", ".jsonl", ".json"):
        stem = stem[: -len(ext)] if stem.endswith(ext) else stem
    return stem, path


# ------------------------------------------------------------------------------------------- reading
def read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped for ``*.gz``; a TraceError naming the file when it cannot be read."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as fh:
                return fh.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        what = "not a valid gzip file" if path.name.endswith(".gz") else "cannot be read"
        raise TraceError(
            f"{path}: {what} ({one_line(exc)}); expected "
            f"{'gzip-compressed ' if path.name.endswith('.gz') else ''}JSON text"
        ) from None


def one_line(exc: BaseException) -> str:
    """An exception's text on one line (tarfile and gzip messages span several)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _decode(path: Path, data: bytes, *, lineno: int | None = None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = lineno if lineno is not None else data[: exc.start].count(b"\n") + 1
        raise TraceError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); expected UTF-8 JSON") from None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Objects of a JSONL file (split on '\\n' only: some files hold U+2028 inside strings)."""
    rows = []
    for lineno, raw in enumerate(read_bytes(path).split(b"\n"), 1):
        line = _decode(path, raw, lineno=lineno)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            raise TraceError(f"{path}:{lineno}: not valid JSON ({msg}); expected one JSON object per line") from None
        if not isinstance(row, dict):
            raise TraceError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
        rows.append(row)
    return rows


def read_json(path: Path) -> Any:
    text = _decode(path, read_bytes(path))
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise TraceError(f"{path}: not valid JSON (nested too deeply)") from None


def detect_format(path: Path) -> str:
    """The trace format of ``path`` (see the module docstring); raises TraceError for anything else."""
    name = path.name
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        return "openhands"
    if name.endswith((".json", ".json.gz")):
        rows = read_json(path)
        if isinstance(rows, list) and rows and isinstance(rows[0], dict) and {"instruction", "output"} <= set(rows[0]):
            return "alpaca"
        raise TraceError(
            f"{path}: unknown JSON trace format; expected a list of {{instruction, output}} objects "
            "(AlpacaEval / Code Alpaca), or use JSONL with prompt/response"
        )
    if name.endswith((".jsonl", ".jsonl.gz")):
        rows = read_jsonl(path)
        if not rows:
            raise TraceError(f"{path}: empty dataset; expected at least one JSON object per line")
        keys = set(rows[0])
        if {"prompt_ids", "response_ids"} <= keys or {"prompt", "response"} <= keys:
            return "generic"
        if {"question_id", "choices"} <= keys:
            return "answers"
        if "question" in keys and GSM8K_SOLUTION_KEY in keys:
            return "gsm8k"
        raise TraceError(
            f"{path}: unknown trace format (first record has keys {sorted(keys)[:8]}); expected "
            "prompt+response, prompt_ids+response_ids, FastChat answers or GSM8K model solutions"
        )
    raise TraceError(
        f"{path}: unknown trace format; expected .jsonl[.gz] (generic, FastChat answers, GSM8K "
        "solutions), .json[.gz] (AlpacaEval, Code Alpaca) or an OpenHands .tar.gz"
    )


# ------------------------------------------------------------------------------------------- formats
RECORD_ERRORS = (KeyError, IndexError, TypeError, AttributeError, ValueError)  # a record of the wrong shape


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


def _openhands_tokenized(path: Path, limit: int | None, tok: TextTokenizer, progress: bool) -> list[TraceRecord]:
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
        d = json.loads(_decode(path, tf.extractfile(m).read()))
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


_ITEM_LOADERS: dict[str, Callable[[Path, int | None, dict[str, Any]], list[RawItem]]] = {
    "generic": _items_generic,
    "alpaca": _items_alpaca,
    "answers": _items_answers,
    "gsm8k": _items_gsm8k,
}


def _tokenize_items(items: list[RawItem], tok: TextTokenizer | None, path: Path) -> list[TraceRecord]:
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


# ------------------------------------------------------------------------------------------- cache
def cache_dir() -> Path:
    env = os.environ.get("SPECDEC_CACHE")
    return Path(env).expanduser() / "traces" if env else Path.home() / ".cache" / "specdec" / "traces"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _cache_key(path: Path, fmt: str, tok_fp: str, limit: int | None, opts: dict[str, Any]) -> str:
    extra = ""
    if fmt == "answers":  # the joined question file is part of the input
        for cand in (path.parent / "question.jsonl", path.parent.parent / "question.jsonl"):
            if cand.exists():
                extra = file_sha256(cand)
                break
    blob = json.dumps([LOADER_VERSION, fmt, file_sha256(path), extra, tok_fp, limit, sorted(opts.items())])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _save_cache(file: Path, records: list[TraceRecord]) -> None:
    """Flat arrays + offsets in one .npz, written atomically (a crash never leaves a half file)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    lens_p = np.array([r.prompt_ids.size for r in records], np.int64)
    lens_r = np.array([r.response_ids.size for r in records], np.int64)
    flat_p = np.concatenate([r.prompt_ids for r in records]) if records else np.zeros(0, np.int32)
    flat_r = np.concatenate([r.response_ids for r in records]) if records else np.zeros(0, np.int32)
    meta = json.dumps({"ids": [r.id for r in records], "groups": [r.group for r in records]})
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, flat_p=flat_p, flat_r=flat_r, lens_p=lens_p, lens_r=lens_r, meta=np.array(meta))
    os.replace(tmp, file)


def _load_cache(file: Path) -> list[TraceRecord] | None:
    try:
        with np.load(file) as z:
            flat_p, flat_r, lens_p, lens_r = z["flat_p"], z["flat_r"], z["lens_p"], z["lens_r"]
            meta = json.loads(str(z["meta"]))
    except Exception:  # noqa: BLE001 - a corrupt cache entry is simply rebuilt
        return None
    off_p = np.concatenate([[0], np.cumsum(lens_p)])
    off_r = np.concatenate([[0], np.cumsum(lens_r)])
    return [
        TraceRecord(rid, flat_p[off_p[i] : off_p[i + 1]], flat_r[off_r[i] : off_r[i + 1]], grp)
        for i, (rid, grp) in enumerate(zip(meta["ids"], meta["groups"]))
    ]


# ------------------------------------------------------------------------------------------- entry point
def load_traces(
    source: str | os.PathLike[str],
    *,
    tokenizer: str | TextTokenizer | None = None,
    limit: int | None = None,
    data: str | os.PathLike[str] | None = None,
    fmt: str | None = None,
    all_turns: bool = False,
    use_cache: bool = True,
    progress: bool = False,
) -> tuple[str, list[TraceRecord]]:
    """Load and tokenize one trace set -> (dataset name, records in replay order).

    ``tokenizer``: a local HF folder, ``"bytes"``, a ``TextTokenizer``, or None (the shared target's tokenizer,
    else bytes). ``limit``: first N records (OpenHands: first N instances); None = all. ``fmt`` forces a format.
    Token-id traces are checked against the tokenizer's vocabulary when one is given or found.
    """
    name, path = resolve_source(source, data)
    if limit is not None and limit < 1:
        raise TraceError(f"{path}: limit={limit} must be >= 1 (or None for all records)")
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise TraceError(f"{path}: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    opts: dict[str, Any] = {"all_turns": True} if (all_turns and fmt == "answers") else {}
    tok = load_tokenizer(tokenizer)
    records: list[TraceRecord] | None = None
    cfile = cache_dir() / f"{name[:40]}-{_cache_key(path, fmt, tok.fingerprint, limit, opts)}.npz"
    if use_cache and cfile.exists():
        records = _load_cache(cfile)
    if records is None:
        if fmt == "openhands":
            records = _openhands_tokenized(path, limit, tok, progress)
        else:
            records = _tokenize_items(_ITEM_LOADERS[fmt](path, limit, opts), tok, path)
        if use_cache and records:
            with suppress(OSError):  # read-only home: run without a cache
                _save_cache(cfile, records)
    if not records:
        raise TraceError(f"{path}: empty dataset (0 records); expected at least one prompt/response pair")
    _check_vocab(path, records, tok, explicit=tokenizer is not None)
    return name, records


def _check_vocab(path: Path, records: list[TraceRecord], tok: TextTokenizer, *, explicit: bool) -> None:
    """Token ids must be < the tokenizer's vocabulary (a mismatch means the traces used another tokenizer)."""
    if not tok.vocab_size or (tok.name == "bytes" and not explicit):
        return
    top = max((int(a.max()) for r in records for a in (r.prompt_ids, r.response_ids) if a.size), default=-1)
    if top >= tok.vocab_size:
        raise TraceError(
            f"{path}: token id {top} >= vocab size {tok.vocab_size} of tokenizer {tok.name}; the "
            "traces were tokenized with another tokenizer: pass the matching --tokenizer, or "
            "--tokenizer none to replay the ids as they are"
        )
