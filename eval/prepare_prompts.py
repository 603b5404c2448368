"""Render the vLLM benchmark's prompts to token ids in a git-ignored folder, to carry to the GPU machine.

    python -m specdec.eval.prepare_prompts                 # -> device_inputs/prompts.json

Sets (cache policy: every prompt set is disjoint from every other, so a drafter with a global cache, vLLM suffix
or ours, is never measured on a prompt it has already answered in the same engine):
* ``code``: warm-up on MBPP tasks; measured on HumanEval prompts, a different slice per batch size.
* ``agentic``: OpenHands SWE-bench trajectories (prompt = the conversation so far, messages flattened to
  "role: content\\n", truncated from the left to ``--max-prompt-tokens``); instances are split into disjoint
  groups: warm-up, and one group per batch size.
Token ids start with BOS (<|endoftext|>, id 0), as the shared models were trained.
"""
from __future__ import annotations

import argparse
import gzip
import json
import tarfile
from pathlib import Path
from typing import Any

from specdec.paths import REPO_ROOT, TARGET_MODEL, data_dir, model_path, require

BATCH_SIZES = (1, 8, 32, 64)
PROMPTS_PER_BATCH = {1: 8, 8: 16, 32: 32, 64: 64}  # measured prompts per batch size
WARMUP_PROMPTS = 16
BOS_ID = 0
CHARS_PER_TOKEN_MAX = 8  # text kept before tokenizing (then cut exactly to the token limit)
OPENHANDS_TAR = ("agent/openhands_swebench_verified/claude-3-5-sonnet-20241022_maxiter_50_N_"
                 "v0.15.0-no-hint-no-condensation-run_1.tar.gz")
# instance groups (indices into the sorted instance list): warm-up, then one group per batch size
AGENT_GROUPS = {"warmup": (0, 4), 1: (4, 8), 8: (8, 16), 32: (16, 30), 64: (30, 50)}


def _tokenizer() -> Any:
    from tokenizers import Tokenizer

    path = require(model_path(TARGET_MODEL) / "tokenizer.json", "target tokenizer")
    return Tokenizer.from_file(str(path))


def _encode(tok: Any, text: str, max_tokens: int) -> list[int]:
    ids = tok.encode(text[-max_tokens * CHARS_PER_TOKEN_MAX:], add_special_tokens=False).ids
    return [BOS_ID] + ids[-(max_tokens - 1):]


def code_sets(tok: Any, max_tokens: int) -> dict[str, list[list[int]]]:
    with gzip.open(require(data_dir() / "human_eval" / "HumanEval.jsonl.gz", "HumanEval"), "rt") as fh:
        humaneval = [json.loads(line)["prompt"] for line in fh.read().split("\n") if line.strip()]
    mbpp_text = require(data_dir() / "mbpp" / "mbpp.jsonl", "MBPP").read_text(encoding="utf-8")
    mbpp = [json.loads(line) for line in mbpp_text.split("\n") if line.strip()]
    sets = {"warmup": [_encode(tok, f'"""{r["text"]}\n{r["test_list"][0]}\n"""\n', max_tokens)
                       for r in mbpp[:WARMUP_PROMPTS]]}
    start = 0
    for b in BATCH_SIZES:
        n = PROMPTS_PER_BATCH[b]
        # The shared target answers a prompt ending in a bare newline with EOS at once: strip the trailing
        # whitespace so the model writes the function body (and the lossless check compares real outputs).
        sets[f"bs{b}"] = [_encode(tok, p.rstrip(), max_tokens) for p in humaneval[start:start + n]]
        start += n
    return sets


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _message(msg: dict) -> str:
    text = _content(msg.get("content"))
    for call in msg.get("tool_calls") or []:
        fn = call.get("function", call)
        text += f"\n<function={fn.get('name', '')}>\n{fn.get('arguments', '')}\n</function>"
    return f"{msg.get('role', '')}: {text}\n"


def _openhands_calls() -> dict[str, list[dict]]:
    """instance id -> its LLM calls (messages only) in timestamp order."""
    calls: dict[str, list[tuple[float, str, list]]] = {}
    with tarfile.open(require(data_dir() / OPENHANDS_TAR, "OpenHands trajectories")) as tf:
        for m in tf:
            parts = m.name.split("/")
            if not m.isfile() or "llm_completions" not in parts or not m.name.endswith(".json"):
                continue
            inst = parts[parts.index("llm_completions") + 1]
            d = json.load(tf.extractfile(m))
            calls.setdefault(inst, []).append((float(d.get("timestamp", 0)), m.name, d["messages"]))
    return {k: [{"messages": c[2]} for c in sorted(v, key=lambda c: (c[0], c[1]))] for k, v in calls.items()}


def agentic_sets(tok: Any, max_tokens: int) -> dict[str, list[list[int]]]:
    calls = _openhands_calls()
    instances = sorted(calls)
    sets = {}
    for key, (lo, hi) in AGENT_GROUPS.items():
        group = instances[lo:hi]
        want = WARMUP_PROMPTS if key == "warmup" else PROMPTS_PER_BATCH[key]
        per = -(-want // len(group))
        picked = []
        for inst in group:
            cs = calls[inst]
            idx = sorted({min(len(cs) - 1, (j + 1) * len(cs) // (per + 1)) for j in range(per)})
            picked += [cs[i] for i in idx]
        text = ["".join(_message(m) for m in c["messages"]) + "assistant: " for c in picked[:want]]
        sets["warmup" if key == "warmup" else f"bs{key}"] = [_encode(tok, t, max_tokens) for t in text]
    return sets


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO_ROOT / "device_inputs" / "prompts.json"))
    ap.add_argument("--max-prompt-tokens", type=int, default=1536, help="agentic prompts keep their last N tokens")
    ap.add_argument("--max-code-tokens", type=int, default=1024)
    args = ap.parse_args(argv)
    tok = _tokenizer()
    out = {
        "policy": "warm-up on a disjoint set (code: MBPP; agentic: other OpenHands instances); each batch size "
                  "measured on its own disjoint prompts (code: HumanEval slices; agentic: disjoint instance groups)",
        "batch_sizes": list(BATCH_SIZES),
        "datasets": {"code": code_sets(tok, args.max_code_tokens),
                     "agentic": agentic_sets(tok, args.max_prompt_tokens)},
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out), encoding="utf-8")
    for name, sets in out["datasets"].items():
        summary = ", ".join(f"{k}: {len(v)} (mean {sum(map(len, v)) // max(len(v), 1)} tok)" for k, v in sets.items())
        print(f"{name}: {summary}")
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
