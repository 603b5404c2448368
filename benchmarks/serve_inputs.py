"""Prompt pools for the serving benchmark: written on the CPU (`serve_bench prepare`), carried to the GPU machine in
the git-ignored device_inputs/ folder, cut there into disjoint slices (one per request rate) and written as the
JSONL files `vllm bench serve --dataset-name custom` reads.

Pools (text prompts: the tokenizer has no chat template, so requests go to the completions API as raw text, each
starting with BOS ``<|endoftext|>`` as the shared models were trained):
* ``code``: HumanEval prompts, then MBPP tasks (each opening its function), cut to ``max_code_tokens`` from the left;
* ``agentic``: OpenHands SWE-bench trajectories (each LLM call = the conversation so far), grouped by instance so
  consecutive slices come from different trajectories, cut to ``max_agentic_tokens`` from the left;
* ``chat``: AlpacaEval instructions as "user: ...\\nassistant: " (open-ended chat: low-acceptance traffic).
Each prompt's ``output_tokens`` is the length of its recorded response (HumanEval's canonical solution, the MBPP
task's code, the OpenHands call's reply with its tool calls, GPT-4's AlpacaEval answer) in the shared tokenizer, kept
within [MIN_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS]; `vllm bench serve --custom-output-len -1` sends it as ``max_tokens``
and EOS ends a request earlier.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from benchmarks.serve_common import ServeError

MIN_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS = 16, 1024  # a response's length kept within these (the longest answers run on)
BOS_TEXT = "<|endoftext|>"
MAX_INPUT_BYTES = 5_000_000  # the pool file travels with every device call
ALPACA_FILE = "alpaca_eval/gpt4_1106_preview.model_outputs.json.gz"
POOLS = ("code", "agentic", "chat")
RANDOM_DATASET = "random"  # vLLM's own random dataset (no pool): low-acceptance traffic
DATASETS = (*POOLS, RANDOM_DATASET)


def _cut(tok: Any, text: str, max_tokens: int) -> str:
    """``text`` cut from the left to at most ``max_tokens - 1`` tokens (BOS is the last one), BOS prepended."""
    ids = tok.encode(text, add_special_tokens=False).ids[-(max_tokens - 1) :]
    return BOS_TEXT + tok.decode(ids, skip_special_tokens=False)


def code_texts() -> list[tuple[str, str]]:
    """(prompt, recorded response): HumanEval with its canonical solution, then MBPP tasks with their code."""
    from benchmarks.prepare_prompts import _mbpp_header, _mbpp_prompt
    from specdec.paths import data_dir, require

    with gzip.open(require(data_dir() / "human_eval" / "HumanEval.jsonl.gz", "HumanEval"), "rt") as fh:
        humaneval = [json.loads(line) for line in fh if line.strip()]
    mbpp_text = require(data_dir() / "mbpp" / "mbpp.jsonl", "MBPP").read_text(encoding="utf-8")
    mbpp = [json.loads(line) for line in mbpp_text.splitlines() if line.strip()]
    return [(r["prompt"].rstrip(), r["canonical_solution"]) for r in humaneval] + [
        (_mbpp_prompt(r) + _mbpp_header(r), r["code"]) for r in mbpp
    ]


def agentic_texts() -> list[tuple[str, str]]:
    """(the conversation so far, the reply the LLM gave with its tool calls) per OpenHands call."""
    from benchmarks.prepare_prompts import _agentic_text, _message, _openhands_calls

    calls = _openhands_calls()
    return [(_agentic_text(c), _message(c["response"])) for inst in sorted(calls) for c in calls[inst]]


def chat_texts() -> list[tuple[str, str]]:
    """(an AlpacaEval instruction as a chat turn, GPT-4's recorded answer)."""
    from specdec.paths import data_dir, require

    with gzip.open(require(data_dir() / ALPACA_FILE, "AlpacaEval"), "rt") as fh:
        rows = json.load(fh)
    return [(f"user: {r['instruction']}\nassistant: ", r["output"]) for r in rows]


def output_tokens(tok: Any, response: str) -> int:
    """A recorded response's length in tokens, kept within [MIN_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS]."""
    n = len(tok.encode(response, add_special_tokens=False).ids)
    return max(MIN_OUTPUT_TOKENS, min(MAX_OUTPUT_TOKENS, n))


def build_pools(*, per_pool: int, max_code_tokens: int, max_agentic_tokens: int) -> dict[str, list[dict[str, Any]]]:
    """{pool: [{"prompt": text, "output_tokens": n}]}, at most ``per_pool`` distinct prompts each (a prompt's first
    recorded response sets its length)."""
    from benchmarks.prepare_prompts import _tokenizer

    tok = _tokenizer()
    sources = {
        "code": (code_texts, max_code_tokens),
        "agentic": (agentic_texts, max_agentic_tokens),
        "chat": (chat_texts, max_code_tokens),
    }
    pools = {}
    for name, (load, max_tokens) in sources.items():
        first: dict[str, str] = {}
        for prompt, response in load():
            first.setdefault(_cut(tok, prompt, max_tokens), response)
        texts = list(first)[:per_pool]
        pools[name] = [{"prompt": t, "output_tokens": output_tokens(tok, first[t])} for t in texts]
    return pools


def write_pools(path: Path, pools: dict[str, list[dict[str, Any]]], settings: dict[str, Any]) -> int:
    doc = {"format": "serve_bench pools: {pool: [{prompt, output_tokens}]}", "settings": settings, "pools": pools}
    text = json.dumps(doc)
    if len(text.encode()) > MAX_INPUT_BYTES:
        raise ServeError(
            f"{path}: {len(text.encode()) / 1e6:.1f} MB is over the {MAX_INPUT_BYTES / 1e6:.0f} MB a "
            "device call carries: lower --per-pool or the --max-*-tokens"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return len(text.encode())


def load_pools(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The pools of a prepared file; a one-line error for a missing file, bad JSON or a pool without prompts."""
    if not path.exists():
        raise ServeError(f"prompts file {path} not found: write it with `python -m benchmarks.serve_bench prepare`")
    try:
        pools = json.loads(path.read_text(encoding="utf-8"))["pools"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ServeError(
            f"{path}: not a serve_bench prompts file ({type(exc).__name__}: {exc}); write it with "
            "`python -m benchmarks.serve_bench prepare`"
        ) from None
    for name, rows in pools.items():
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict) or not r.get("prompt")), None)
        if not rows or bad is not None:
            where = "no prompts" if not rows else f"row {bad} has no 'prompt'"
            raise ServeError(
                f"{path}: pool {name!r} has {where}: write the file again with "
                "`python -m benchmarks.serve_bench prepare`"
            )
    return pools


def check_datasets(names: list[str], pools: dict[str, list[dict[str, Any]]] | None, path: Path) -> None:
    for name in names:
        if name not in DATASETS:
            raise ServeError(f"unknown dataset {name!r}: use one of {', '.join(DATASETS)}")
        if name != RANDOM_DATASET and (pools is None or name not in pools):
            raise ServeError(f"dataset {name!r} is not in {path}: its pools are {sorted(pools or {})}")


def rate_slice(rows: list[dict[str, Any]], index: int, size: int, *, pool: str) -> list[dict[str, Any]]:
    """Slice ``index`` of ``size`` prompts (slices are disjoint: a server never sees a prompt twice)."""
    lo, hi = index * size, (index + 1) * size
    if hi > len(rows):
        raise ServeError(
            f"pool {pool!r} has {len(rows)} prompts; slice {index} of {size} needs {hi}: lower "
            "--num-prompts or prepare a larger pool (--per-pool)"
        )
    return rows[lo:hi]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
