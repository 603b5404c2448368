"""The GPU gate's inputs, rendered on the CPU: prompts as token ids with their ``max_tokens``, and the base commit's
tree for the "specdec-before" engine, both in the git-ignored ``device_inputs/`` that travels with a device call.

    python -m benchmarks.gate_prompts [--before-commit SHA]      # -> device_inputs/gate_inputs.json (+ gate_before/)

Sets (three domains the project was not tuned on):
* ``agentic``: OpenHands SWE-bench conversations (the conversation so far, ``role: content`` lines, cut from the
  left to ``--max-prompt-tokens``); each cell from its own instances (``prepare_prompts.AGENT_GROUPS``);
* ``chat``: MT-Bench first turns and Spec-Bench questions (qa, math_reasoning, translation), taken in turn;
* ``code``: HumanEval prompts (a slice per cell); warm-up and the sampled cell on MBPP tasks.
Cells per set: ``warmup`` (not measured), ``b1`` (8 prompts one after another), ``b8``, ``b32``, ``b64`` (closed
batches) and, for code only, ``s8`` (temperature 0.8, one batch of 8). Every prompt of the file is distinct, so a
drafter with a global cache (vLLM suffix, specdec) is never measured on a prompt its engine answered before.
``max_tokens``: the recorded response's length in the target's tokens (OpenHands: the model's reply; MT-Bench: GPT-4o's
answer), clamped to ``MIN_TOKENS``-``MAX_TOKENS``; ``MAX_TOKENS`` where the set records none (Spec-Bench; HumanEval and
MBPP, whose solutions are human-written).

``--to-max-len M`` writes the near-end inputs instead (``device_inputs/gate_inputs_mmlM.json``): the engines run at
``max_model_len`` M (what an operator sets) and every request runs up to it (``max_tokens`` the room its prompt
leaves, as vLLM gives a request without one), the code set's ``TO_END_CELLS`` only, so that requests reach the end
of the model's length one after another while the others decode.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from benchmarks.prepare_prompts import (
    AGENT_GROUPS,
    _agentic_text,
    _encode,
    _mbpp_header,
    _mbpp_prompt,
    _message,
    _openhands_calls,
    _tokenizer,
    closed_picks,
)
from specdec.paths import REPO_ROOT, TARGET_MODEL, data_dir, require

SETS = ("agentic", "chat", "code")
CELLS = {"b1": 8, "b8": 16, "b32": 32, "b64": 64}  # measured cell -> prompts (b1: one at a time)
BATCH = {"b1": 1, "b8": 8, "b32": 32, "b64": 64, "s8": 8}  # cell -> requests in flight
SAMPLED_CELL, SAMPLED_SET, SAMPLED_PROMPTS = "s8", "code", 8
WARMUP_PROMPTS = 4
MIN_TOKENS, MAX_TOKENS = 32, 256
TO_END_SETS, TO_END_CELLS = ("code",), ("warmup", "b8", "b32")  # the near-end inputs (module docstring)
CHAT_CATEGORIES = ("qa", "math_reasoning", "translation")  # Spec-Bench's short open questions (no long contexts)
DEFAULT_OUT = REPO_ROOT / "device_inputs" / "gate_inputs.json"
BEFORE_DIR = "gate_before"  # under the inputs' folder: the base commit's tree (git archive)
BEFORE_STAMP = "GATE_COMMIT"  # in that tree: the commit it was exported from
CANDIDATES_DIR = "gate_candidates"  # under the inputs' folder: one tree per --candidates name (git archive)
CANDIDATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,39}")


def clamp_tokens(n: int | None) -> int:
    """``max_tokens`` of a prompt whose recorded response has ``n`` tokens (None: no recorded response)."""
    return MAX_TOKENS if n is None else max(MIN_TOKENS, min(MAX_TOKENS, n))


def _item(tok: Any, text: str, recorded: str | None, source: str, max_prompt: int) -> dict[str, Any]:
    n = None if recorded is None else len(tok.encode(recorded, add_special_tokens=False).ids)
    return {"ids": _encode(tok, text, max_prompt), "max_tokens": clamp_tokens(n), "source": source}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def agentic_items(tok: Any, max_prompt: int) -> dict[str, list[dict[str, Any]]]:
    """Cell -> prompts: each cell's conversations from its own OpenHands instances."""
    calls = _openhands_calls()
    instances = sorted(calls)
    out: dict[str, list[dict[str, Any]]] = {}
    for key, (lo, hi) in AGENT_GROUPS.items():
        cell = "warmup" if key == "warmup" else f"b{key}"
        want = WARMUP_PROMPTS if cell == "warmup" else CELLS[cell]
        group = instances[lo:hi]
        picks = closed_picks([len(calls[g]) for g in group], want)
        out[cell] = [
            _item(
                tok, _agentic_text(c), _message(c["response"]) if c["response"] else None, f"{group[i]}#{j}", max_prompt
            )
            for i, j in picks
            for c in [calls[group[i]][j]]
        ]
    return out


def chat_pool(tok: Any, max_prompt: int) -> list[dict[str, Any]]:
    """MT-Bench first turns (GPT-4o's answer recorded) and Spec-Bench questions of ``CHAT_CATEGORIES``, in turn."""
    answers = {
        r["question_id"]: r["choices"][0]["turns"][0] for r in _jsonl(data_dir() / "mt_bench/model_answer_gpt-4o.jsonl")
    }
    sources: list[list[dict[str, Any]]] = [[]]
    for q in _jsonl(require(data_dir() / "mt_bench/question.jsonl", "MT-Bench")):
        sources[0].append(
            _chat(tok, q["turns"][0], answers.get(q["question_id"]), f"mt_bench/{q['question_id']}", max_prompt)
        )
    spec_bench = _jsonl(require(data_dir() / "spec_bench/question.jsonl", "Spec-Bench"))
    for cat in CHAT_CATEGORIES:
        rows = [q for q in spec_bench if q["category"] == cat]
        sources.append([_chat(tok, q["turns"][0], None, f"spec_bench/{q['question_id']}", max_prompt) for q in rows])
    return [s[i] for i in range(max(map(len, sources))) for s in sources if i < len(s)]


def _chat(tok: Any, question: str, recorded: str | None, source: str, max_prompt: int) -> dict[str, Any]:
    text = _message({"role": "user", "content": question}) + "assistant: "
    return _item(tok, text, recorded, source, max_prompt)


def code_items(tok: Any, max_prompt: int) -> dict[str, list[dict[str, Any]]]:
    """Cell -> prompts: warm-up and the sampled cell on MBPP tasks, each measured cell on a HumanEval slice."""
    with gzip.open(require(data_dir() / "human_eval" / "HumanEval.jsonl.gz", "HumanEval"), "rt") as fh:
        humaneval = [json.loads(line) for line in fh.read().split("\n") if line.strip()]
    mbpp = _jsonl(require(data_dir() / "mbpp" / "mbpp.jsonl", "MBPP"))
    mbpp_items = [_item(tok, _mbpp_prompt(r) + _mbpp_header(r), None, f"mbpp/{r['task_id']}", max_prompt) for r in mbpp]
    out = {"warmup": mbpp_items[:WARMUP_PROMPTS], SAMPLED_CELL: mbpp_items[WARMUP_PROMPTS:][:SAMPLED_PROMPTS]}
    start = 0
    for cell, n in CELLS.items():
        rows = humaneval[start : start + n]
        # a prompt ending in a bare newline is answered with EOS at once: trailing whitespace removed
        out[cell] = [_item(tok, r["prompt"].rstrip(), None, r["task_id"], max_prompt) for r in rows]
        start += n
    return out


def split_pool(pool: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Consecutive slices of ``pool``: warm-up, then each measured cell."""
    sizes = {"warmup": WARMUP_PROMPTS, **CELLS}
    if len(pool) < sum(sizes.values()):
        raise SystemExit(f"chat pool has {len(pool)} prompts; the cells need {sum(sizes.values())}")
    out, start = {}, 0
    for cell, n in sizes.items():
        out[cell], start = pool[start : start + n], start + n
    return out


def check_disjoint(sets: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    """Fail if any two prompts of the file (any set, any cell) are the same token ids."""
    seen: dict[tuple[int, ...], str] = {}
    for name, cells in sets.items():
        for cell, items in cells.items():
            for i, it in enumerate(items):
                where = f"{name}/{cell}[{i}]"
                other = seen.setdefault(tuple(it["ids"]), where)
                if other != where:
                    raise SystemExit(f"prompt {where} repeats {other}: every prompt of the gate must be distinct")


def git_commit(ref: str = "HEAD", *, what: str = "--before-commit") -> tuple[str, bool]:
    """(full sha of ``ref``, whether the work tree has uncommitted changes to tracked files); ``what``: the flag
    that named ``ref``, for the error."""
    sha = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if sha.returncode != 0:
        raise SystemExit(f"{what} {ref}: not a commit of {REPO_ROOT} ({sha.stderr.strip()})")
    status = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=False,
    )
    return sha.stdout.strip(), bool(status.stdout.strip())


def export_tree(commit: str, dest: Path) -> Path:
    """The tree of ``commit`` (``git archive``, results files left out) in ``dest`` (replaced), with its sha in
    ``dest/BEFORE_STAMP``: installed on the GPU machine with ``pip install --target``."""
    tar = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", "--format=tar", commit, "--", ".", ":(exclude)eval/results"],
        capture_output=True,
        check=True,
    ).stdout
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        tf.extractall(dest, filter="data")
    (dest / BEFORE_STAMP).write_text(commit + "\n")
    return dest


def parse_candidates(spec: str) -> dict[str, str]:
    """``--candidates name=REF,name=REF`` -> {name: REF}; a one-line error names the bad entry and the fix."""
    out: dict[str, str] = {}
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
        name, sep, ref = entry.partition("=")
        if not sep or not ref or not CANDIDATE_NAME.fullmatch(name) or name in out:
            raise SystemExit(
                f"--candidates {entry!r}: give name=COMMIT, names of letters, digits, '-' and '_' (at most 40), each "
                "once, e.g. --candidates hold48=a1b2c3d,ragged=HEAD~2"
            )
        out[name] = ref
    return out


def export_candidates(spec: str, inputs: Path) -> dict[str, dict[str, str]]:
    """Each ``--candidates`` tree in ``inputs/CANDIDATES_DIR/<name>`` (the folder replaced, so that no earlier run's
    tree is installed again; ``spec`` "": none): ``gpu_gate.sh`` installs each into ``/tmp/specdec-cand/<name>``,
    which a benchmark variant's ``path`` puts first on its engine's import path. {name: {commit, folder}}."""
    wanted = {name: git_commit(ref, what="--candidates")[0] for name, ref in parse_candidates(spec).items()}
    root = inputs / CANDIDATES_DIR
    if root.exists():
        shutil.rmtree(root)
    return {
        name: {"commit": sha, "folder": str(export_tree(sha, root / name).relative_to(inputs.parent))}
        for name, sha in wanted.items()
    }


def build(tok: Any, max_prompt: int, max_code: int) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Set -> cell -> prompts (see the module docstring), checked disjoint."""
    sets = {
        "agentic": agentic_items(tok, max_prompt),
        "chat": split_pool(chat_pool(tok, max_prompt)),
        "code": code_items(tok, max_code),
    }
    check_disjoint(sets)
    return sets


def to_end(sets: dict[str, dict[str, list[dict[str, Any]]]], max_model_len: int) -> dict[str, Any]:
    """The near-end cells (``TO_END_SETS`` x ``TO_END_CELLS``), each request's ``max_tokens`` the room its prompt
    leaves under ``max_model_len``."""
    out: dict[str, Any] = {}
    for name in TO_END_SETS:
        cells = {c: sets[name][c] for c in TO_END_CELLS if c in sets[name]}
        out[name] = {c: [{**it, "max_tokens": max_model_len - len(it["ids"])} for it in v] for c, v in cells.items()}
        if any(it["max_tokens"] < 1 for v in out[name].values() for it in v):
            raise SystemExit(f"--to-max-len {max_model_len}: a {name} prompt has no room left; give a larger length")
    return out


def _mean(items: list[dict[str, Any]], key: str) -> int:
    vals = [len(it[key]) if isinstance(it[key], list) else it[key] for it in items]
    return sum(vals) // max(len(vals), 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help=f"default {DEFAULT_OUT} (--to-max-len M: gate_inputs_mmlM.json there)")
    ap.add_argument("--to-max-len", type=int, default=0, help="the near-end inputs at this max_model_len (docstring)")
    ap.add_argument("--before-commit", default="", help="export this commit's tree for the specdec-before engine")
    ap.add_argument(
        "--candidates",
        default="",
        help="name=COMMIT,...: export each tree too (gpu_gate.sh installs it into /tmp/specdec-cand/<name>; "
        'bench_vllm --variants \'{"name": {"base": "specdec", "path": "/tmp/specdec-cand/name"}}\')',
    )
    ap.add_argument("--max-prompt-tokens", type=int, default=1536, help="agentic and chat prompts keep their last N")
    ap.add_argument("--max-code-tokens", type=int, default=1024)
    args = ap.parse_args(argv)
    out = Path(
        args.out
        or (DEFAULT_OUT.with_name(f"gate_inputs_mml{args.to_max_len}.json") if args.to_max_len else DEFAULT_OUT)
    )
    commit, dirty = git_commit()
    before = None
    if args.before_commit:
        sha, _ = git_commit(args.before_commit)
        folder = export_tree(sha, out.parent / BEFORE_DIR)
        before = {"commit": sha, "folder": str(folder.relative_to(out.parent.parent))}
    candidates = export_candidates(args.candidates, out.parent)  # none: an earlier run's trees go
    sets = build(_tokenizer(), args.max_prompt_tokens, args.max_code_tokens)
    policy = (
        "every prompt distinct across sets and cells; max_tokens = recorded response length "
        f"clamped to {MIN_TOKENS}-{MAX_TOKENS} ({MAX_TOKENS} without one); EOS respected"
    )
    if args.to_max_len:
        sets = to_end(sets, args.to_max_len)
        policy = f"max_model_len {args.to_max_len}; max_tokens = the room each prompt leaves; EOS respected"
    doc = {
        "schema": 1,
        "commit": commit,
        "dirty": dirty,
        "before": before,
        "candidates": candidates,
        "tokenizer": TARGET_MODEL,
        "batch": BATCH,
        "sampled": {"set": SAMPLED_SET, "cell": SAMPLED_CELL},
        "policy": policy,
        "max_model_len": args.to_max_len or None,  # None: vLLM's default (the model's length)
        "sets": sets,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, separators=(",", ":")), encoding="utf-8")
    for name, cells in sets.items():
        line = ", ".join(
            f"{c}: {len(v)} ({_mean(v, 'ids')} tok, max_tokens {_mean(v, 'max_tokens')})" for c, v in cells.items()
        )
        print(f"{name}: {line}")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB); commit {commit[:7]}{' +dirty' if dirty else ''}")
    if before:
        print(f"before: {before['commit'][:7]} in {before['folder']}")


if __name__ == "__main__":
    main()
