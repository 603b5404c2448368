"""Render the vLLM benchmark's prompts to token ids in a git-ignored folder, to carry to the GPU machine.

    python -m benchmarks.prepare_prompts                 # -> device_inputs/prompts.json

Sets (cache policy: every prompt set is disjoint from every other, so a drafter with a global cache, vLLM suffix
or ours, is never measured on a prompt it has already answered in the same engine):
* ``code``: warm-up on MBPP tasks; measured on HumanEval prompts, a different slice per batch size.
* ``agentic``: OpenHands SWE-bench trajectories (prompt = the conversation so far, messages flattened to
  "role: content\\n", truncated from the left to ``--max-prompt-tokens``); instances are split into disjoint
  groups: warm-up, and one group per batch size.
* ``random``: token ids drawn uniformly from the tokenizer's ordinary ids (seed ``RANDOM_SEED``), ``RANDOM_TOKENS``
  each, as ``vllm bench serve --dataset-name random`` sends: low-acceptance traffic once sampled at temperature 1
  (``bench_vllm --temperature 1``); closed sets ``bs{b}`` and sustained sets ``sus{b}`` for ``RANDOM_BATCHES``.
* sustained sets ``sus{b}`` (``bench_vllm --load sustained``: ``SUSTAINED_FACTOR`` x b prompts, at most b in flight):
  code = MBPP tasks after the warm-up's, a disjoint slice per b; agentic = calls no other set holds, from disjoint
  instance groups (the trajectory tar holds 50 instances, all in the closed groups: a sustained group shares its
  instances with closed sets, which is why bench_vllm measures the sustained cells in an engine of their own).
Token ids start with BOS (<|endoftext|>, id 0), as the shared models were trained.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import tarfile
from pathlib import Path
from typing import Any

from specdec.paths import REPO_ROOT, TARGET_MODEL, data_dir, model_path, require

BATCH_SIZES = (1, 8, 32, 64)
PROMPTS_PER_BATCH = {1: 8, 8: 16, 32: 32, 64: 64}  # measured prompts per batch size
WARMUP_PROMPTS = 16
BOS_ID = 0
CHARS_PER_TOKEN_MAX = 8  # text kept before tokenizing (then cut exactly to the token limit)
OPENHANDS_TAR = (
    "agent/openhands_swebench_verified/claude-3-5-sonnet-20241022_maxiter_50_N_"
    "v0.15.0-no-hint-no-condensation-run_1.tar.gz"
)
# instance groups (indices into the sorted instance list): warm-up, then one group per batch size
AGENT_GROUPS = {"warmup": (0, 4), 1: (4, 8), 8: (8, 16), 32: (16, 30), 64: (30, 50)}
SUSTAINED_BATCHES = (32, 64)  # concurrency caps with a sustained set ``sus{b}``
SUSTAINED_FACTOR = 4  # sustained prompts per unit of concurrency
# sustained agentic instance groups (disjoint from each other and from the warm-up's; see the module docstring)
SUSTAINED_AGENT_GROUPS = {32: (4, 20), 64: (20, 50)}
RANDOM_TOKENS = 256  # a random prompt's length (the serve check's --random-input-len), BOS included
RANDOM_SEED = 0
RANDOM_BATCHES = (1, 8, 16, 32, 64)  # 16: about the requests in flight under the serve check's arrivals (20/s)
# closed random batches past vLLM's 64-request speculative graphs: the serve check at c100 and `vllm bench serve`'s
# `inf` (100 requests at once); drawn after every other set, so that those keep their tokens
RANDOM_LOADED_BATCHES = (100,)
FIRST_ORDINARY_ID = 2  # ids below it are the shared tokenizer's specials (0: <|endoftext|>, BOS and EOS; 1: <|pad|>)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer

    path = require(model_path(TARGET_MODEL) / "tokenizer.json", "target tokenizer")
    return Tokenizer.from_file(str(path))


def _encode(tok: Any, text: str, max_tokens: int) -> list[int]:
    ids = tok.encode(text[-max_tokens * CHARS_PER_TOKEN_MAX :], add_special_tokens=False).ids
    return [BOS_ID] + ids[-(max_tokens - 1) :]


def code_sets(tok: Any, max_tokens: int) -> dict[str, list[list[int]]]:
    with gzip.open(require(data_dir() / "human_eval" / "HumanEval.jsonl.gz", "HumanEval"), "rt") as fh:
        humaneval = [json.loads(line)["prompt"] for line in fh.read().split("\n") if line.strip()]
    mbpp_text = require(data_dir() / "mbpp" / "mbpp.jsonl", "MBPP").read_text(encoding="utf-8")
    mbpp = [json.loads(line) for line in mbpp_text.split("\n") if line.strip()]
    sets = {"warmup": [_encode(tok, _mbpp_prompt(r), max_tokens) for r in mbpp[:WARMUP_PROMPTS]]}
    start = 0
    for b in BATCH_SIZES:
        n = PROMPTS_PER_BATCH[b]
        # The shared target answers a prompt ending in a bare newline with EOS at once: strip the trailing
        # whitespace so the model writes the function body (and the lossless check compares real outputs).
        sets[f"bs{b}"] = [_encode(tok, p.rstrip(), max_tokens) for p in humaneval[start : start + n]]
        start += n
    # MBPP repeats a task (ids 76 and 347): each prompt once, in task order, after the warm-up's
    warm = set(map(_mbpp_prompt, mbpp[:WARMUP_PROMPTS]))
    # measured prompts open the function (``def name(``, from the task's test): the model writes code, not the
    # import lists it answers a bare docstring with
    rest = list(
        dict.fromkeys(_mbpp_prompt(r) + _mbpp_header(r) for r in mbpp[WARMUP_PROMPTS:] if _mbpp_prompt(r) not in warm)
    )
    start = 0
    for b in SUSTAINED_BATCHES:
        n = SUSTAINED_FACTOR * b
        if start + n > len(rest):
            raise SystemExit(
                f"MBPP has {len(rest)} distinct tasks after the warm-up: sustained set sus{b} needs {start + n}"
            )
        sets[f"sus{b}"] = [_encode(tok, p, max_tokens) for p in rest[start : start + n]]
        start += n
    return sets


def _mbpp_prompt(task: dict) -> str:
    return f'"""{task["text"]}\n{task["test_list"][0]}\n"""\n'


def _mbpp_header(task: dict) -> str:
    """``def name(`` of the function the task's first test calls ("" if the test names none)."""
    m = re.match(r"\s*assert\s+(?:not\s+)?\(?\s*(?:set\()?\s*([A-Za-z_]\w*)\s*\(", task["test_list"][0])
    return f"def {m.group(1)}(" if m else ""


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
    """instance id -> its LLM calls (messages, and the recorded response's message) in timestamp order."""
    calls: dict[str, list[tuple[float, str, list, dict]]] = {}
    with tarfile.open(require(data_dir() / OPENHANDS_TAR, "OpenHands trajectories")) as tf:
        for m in tf:
            parts = m.name.split("/")
            if not m.isfile() or "llm_completions" not in parts or not m.name.endswith(".json"):
                continue
            inst = parts[parts.index("llm_completions") + 1]
            d = json.load(tf.extractfile(m))
            reply = ((d.get("response") or {}).get("choices") or [{}])[0].get("message") or {}
            calls.setdefault(inst, []).append((float(d.get("timestamp", 0)), m.name, d["messages"], reply))
    return {
        k: [{"messages": c[2], "response": c[3]} for c in sorted(v, key=lambda c: (c[0], c[1]))]
        for k, v in calls.items()
    }


def _spread(n: int, per: int) -> list[int]:
    """``per`` evenly spaced positions among ``n`` (fewer where they coincide), the trajectory's start left out."""
    return sorted({min(n - 1, (j + 1) * n // (per + 1)) for j in range(per)})


def closed_picks(counts: list[int], want: int) -> list[tuple[int, int]]:
    """(instance, call) pairs of a closed set's group (``counts``: calls per instance): ``_spread`` of the same
    number of calls in every instance, enough for ``want``, the first ``want`` kept."""
    per = -(-want // len(counts))
    return [(i, c) for i, n in enumerate(counts) for c in _spread(n, per)][:want]


def sustained_picks(free: list[int], want: int) -> list[tuple[int, int]]:
    """(instance, position) pairs of a sustained set, ``free[i]`` = how many prompts of instance i no other set holds:
    ``_spread`` of the same number q in every instance (all of an instance that has fewer), q the least that gives
    ``want``, the first ``want`` kept."""
    if sum(free) < want:
        raise SystemExit(
            f"sustained agentic set: {want} prompts wanted, its instances have only {sum(free)} "
            "prompts no other set holds"
        )
    per = next(q for q in range(1, max(free) + 1) if sum(min(q, n) for n in free) >= want)
    return [(i, k) for i, n in enumerate(free) for k in _spread(n, min(per, n))][:want]


def _agentic_text(call: dict) -> str:
    return "".join(_message(m) for m in call["messages"]) + "assistant: "


def _free_prompts(tok: Any, calls: list[dict], seen: set[tuple[int, ...]], max_tokens: int) -> list[list[int]]:
    """An instance's prompts not in ``seen``, in call order, each added to ``seen`` (a prompt is offered once: calls
    repeat, and the first calls of instances of one repository can end in the same ``max_tokens`` tokens)."""
    out = []
    for call in calls:
        ids = _encode(tok, _agentic_text(call), max_tokens)
        if tuple(ids) not in seen:
            seen.add(tuple(ids))
            out.append(ids)
    return out


def agentic_sets(tok: Any, max_tokens: int) -> dict[str, list[list[int]]]:
    calls = _openhands_calls()
    instances = sorted(calls)
    needed = max(hi for _, hi in [*AGENT_GROUPS.values(), *SUSTAINED_AGENT_GROUPS.values()])
    if len(instances) < needed:
        raise SystemExit(
            f"{OPENHANDS_TAR} holds {len(instances)} instances; the agentic groups need {needed} "
            "(AGENT_GROUPS, SUSTAINED_AGENT_GROUPS)"
        )
    sets = {}
    for key, (lo, hi) in AGENT_GROUPS.items():
        group = instances[lo:hi]
        want = WARMUP_PROMPTS if key == "warmup" else PROMPTS_PER_BATCH[key]
        texts = [_agentic_text(calls[group[i]][c]) for i, c in closed_picks([len(calls[g]) for g in group], want)]
        sets["warmup" if key == "warmup" else f"bs{key}"] = [_encode(tok, t, max_tokens) for t in texts]
    seen = {tuple(ids) for prompts in sets.values() for ids in prompts}
    for b, (lo, hi) in SUSTAINED_AGENT_GROUPS.items():
        free = [_free_prompts(tok, calls[inst], seen, max_tokens) for inst in instances[lo:hi]]
        sets[f"sus{b}"] = [free[i][k] for i, k in sustained_picks([len(f) for f in free], SUSTAINED_FACTOR * b)]
    return sets


def random_sets(vocab_size: int, *, tokens: int = RANDOM_TOKENS, seed: int = RANDOM_SEED) -> dict[str, list[list[int]]]:
    """The ``random`` dataset: a warm-up set, ``bs{b}`` (max(b, 8) prompts: batches of one run 8 one after another)
    and ``sus{b}`` (``SUSTAINED_FACTOR`` x b) for each of ``RANDOM_BATCHES``, then ``bs{b}`` for each of
    ``RANDOM_LOADED_BATCHES``; each prompt BOS then ``tokens - 1`` ids drawn uniformly from
    ``[FIRST_ORDINARY_ID, vocab_size)``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    counts = {"warmup": WARMUP_PROMPTS}
    counts |= {f"bs{b}": PROMPTS_PER_BATCH.get(b, max(b, 8)) for b in RANDOM_BATCHES}
    counts |= {f"sus{b}": SUSTAINED_FACTOR * b for b in RANDOM_BATCHES if b >= 16}
    counts |= {f"bs{b}": b for b in RANDOM_LOADED_BATCHES}
    out = {}
    for key, n in counts.items():
        ids = rng.integers(FIRST_ORDINARY_ID, vocab_size, size=(n, tokens - 1))  # [n, tokens - 1]
        out[key] = [[BOS_ID, *map(int, row)] for row in ids]
    return out


def check_disjoint(name: str, sets: dict[str, list[list[int]]]) -> None:
    """Fail if any two prompts of a dataset's sets (within one set or across sets) are the same token ids."""
    seen: dict[tuple[int, ...], str] = {}
    for key, prompts in sets.items():
        for i, ids in enumerate(prompts):
            other = seen.setdefault(tuple(ids), f"{key}[{i}]")
            if other != f"{key}[{i}]":
                raise SystemExit(f"{name}: prompt {key}[{i}] repeats {other} (the sets must be disjoint)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO_ROOT / "device_inputs" / "prompts.json"))
    ap.add_argument("--max-prompt-tokens", type=int, default=1536, help="agentic prompts keep their last N tokens")
    ap.add_argument("--max-code-tokens", type=int, default=1024)
    args = ap.parse_args(argv)
    tok = _tokenizer()
    out = {
        "policy": "warm-up on a disjoint set (code: MBPP; agentic: other OpenHands instances); each batch size "
        "measured on its own disjoint prompts (code: HumanEval slices; agentic: disjoint instance groups); "
        f"sustained load (sus{{b}}: {SUSTAINED_FACTOR} x b prompts, at most b in flight) on prompts no other "
        "set holds (code: MBPP slices after the warm-up's; agentic: unused calls of disjoint instance "
        "groups that closed sets also draw from, measured in an engine of their own); random: uniform token ids, one "
        "seed, every set drawn after the last",
        "batch_sizes": list(BATCH_SIZES),
        "sustained_batches": list(SUSTAINED_BATCHES),
        "datasets": {
            "code": code_sets(tok, args.max_code_tokens),
            "agentic": agentic_sets(tok, args.max_prompt_tokens),
            "random": random_sets(tok.get_vocab_size(with_added_tokens=False)),
        },
    }
    for name, sets in out["datasets"].items():
        check_disjoint(name, sets)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out), encoding="utf-8")
    for name, sets in out["datasets"].items():
        summary = ", ".join(f"{k}: {len(v)} (mean {sum(map(len, v)) // max(len(v), 1)} tok)" for k, v in sets.items())
        print(f"{name}: {summary}")
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
