"""Trace sources: the shared trace sets, resolving a set name or path to a file, reading JSON / JSONL (gzipped
or not) with one-line errors, and detecting a file's trace format (the formats: ``specdec.eval.loaders``).
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from pathlib import Path
from typing import Any

from specdec.paths import data_dir

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


def decode_text(path: Path, data: bytes, *, lineno: int | None = None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = lineno if lineno is not None else data[: exc.start].count(b"\n") + 1
        raise TraceError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); expected UTF-8 JSON") from None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Objects of a JSONL file (split on '\\n' only: some files hold U+2028 inside strings)."""
    rows = []
    for lineno, raw in enumerate(read_bytes(path).split(b"\n"), 1):
        line = decode_text(path, raw, lineno=lineno)
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
    text = decode_text(path, read_bytes(path))
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise TraceError(f"{path}: not valid JSON (nested too deeply)") from None


def detect_format(path: Path) -> str:
    """The trace format of ``path`` (see ``specdec.eval.loaders``); raises TraceError for anything else."""
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
