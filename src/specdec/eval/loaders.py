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

import hashlib
import json
import os
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np

from specdec.eval.records import TraceRecord
from specdec.eval.tokenization import TextTokenizer, load_tokenizer
from specdec.eval.trace_formats import (
    ITEM_LOADERS,
    RECORD_ERRORS,
    RawItem,
    at_record,
    openhands_tokenized,
    tokenize_items,
)
from specdec.eval.trace_sources import (
    FORMATS,
    GSM8K_SOLUTION_KEY,
    MEDUSA_VICUNA_7B,
    OPENHANDS_TAR,
    SHARED_TRACE_SETS,
    TraceError,
    detect_format,
    one_line,
    read_bytes,
    read_json,
    read_jsonl,
    resolve_data_dir,
    resolve_source,
)

__all__ = [  # the loaders' public names (those of trace_sources and trace_formats re-exported)
    "FORMATS",
    "GSM8K_SOLUTION_KEY",
    "LOADER_VERSION",
    "MEDUSA_VICUNA_7B",
    "OPENHANDS_TAR",
    "RECORD_ERRORS",
    "SHARED_TRACE_SETS",
    "RawItem",
    "TraceError",
    "at_record",
    "cache_dir",
    "detect_format",
    "file_sha256",
    "load_traces",
    "one_line",
    "read_bytes",
    "read_json",
    "read_jsonl",
    "resolve_data_dir",
    "resolve_source",
]

LOADER_VERSION = 1  # bump when rendering/tokenization changes (invalidates the cache)


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
            records = openhands_tokenized(path, limit, tok, progress)
        else:
            records = tokenize_items(ITEM_LOADERS[fmt](path, limit, opts), tok, path)
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
