"""Pick the prompts of serve_features' sampling check on the CPU: code prompts cut where the target's next
tokens are near-certain (the output before the tested position) and the one at the tested position is uncertain but
predicted by the prompt itself, so a suffix drafter proposes it and about half the samples accept a draft there.

    python -m benchmarks.sampling_prompts            # writes benchmarks/sampling_prompts.json (token ids)

Per tested output position P in POSITIONS (serve_sampling.TESTED_POSITION: 2 in thread mode, 3 in schedule mode,
where the samples' first decoding steps mostly meet prefill steps without draft slots), for every cut i of the first
SCAN_PROMPTS code prompts (one float32 forward pass of the shared 53M target per prompt): the output tokens before P
= the prompt's own tokens i .. i+P-2, each the target's mode with probability >= MIN_PREFIX; the draft d = the token
after the latest earlier occurrence of the longest suffix (MIN_MATCH to MAX_MATCH tokens) of prompt[:i] + those
tokens; d must be the mode at position P with probability in SECOND_RANGE. Expected acceptance at P (a one-token
draft accepted with the target's probability) = p(prefix) x p(d). Per position the PROMPTS best by that, from
distinct prompts, are written with their measured probabilities.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

SCAN_PROMPTS = 200
MAX_PROMPT_TOKENS = 400
MIN_CUT = 20
MIN_PREFIX = 0.98
SECOND_RANGE = (0.45, 0.65)  # p(mode) at position 2: uncertain enough that a 3% bias moves it, likely enough to accept
MIN_MATCH, MAX_MATCH = 4, 16
PROMPTS = 2
POSITIONS = (2, 3)  # serve_sampling.TESTED_POSITION's values
OUT = Path(__file__).with_name("sampling_prompts.json")


def prompt_draft(ids: list[int]) -> tuple[int | None, int]:
    """(the token after the latest earlier occurrence of the longest suffix of ``ids``, that suffix's length)."""
    n = len(ids)
    for length in range(min(MAX_MATCH, n - 1), MIN_MATCH - 1, -1):
        pat = ids[n - length :]
        for s in range(n - length - 1, -1, -1):
            if ids[s : s + length] == pat:
                return ids[s + length], length
    return None, 0


def scan(model: Any, tok: Any, prompts: list[str], *, position: int) -> list[dict[str, Any]]:
    import torch

    found = []
    before = position - 1  # output tokens before the tested one, taken from the prompt itself
    for index, text in enumerate(prompts[:SCAN_PROMPTS]):
        ids = tok.encode(text, add_special_tokens=False).ids
        if len(ids) > MAX_PROMPT_TOKENS:
            continue
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([ids])).logits[0].float(), -1)  # [T, V]
        for i in range(MIN_CUT, len(ids) - before):
            prefix = ids[i : i + before]
            p_prefix = [float(probs[i - 1 + j, t]) for j, t in enumerate(prefix)]
            modes = [int(probs[i - 1 + j].argmax()) for j in range(before)]
            if modes != prefix or min(p_prefix) < MIN_PREFIX:
                continue
            d, match = prompt_draft(ids[: i + before])
            last = i + before - 1  # the row of probs that predicts the tested position
            if d is None or int(probs[last].argmax()) != d:
                continue
            p2 = float(probs[last, d])
            if SECOND_RANGE[0] <= p2 <= SECOND_RANGE[1]:
                found.append(
                    {"source": index, "cut": i, "position": position, "ids": ids[:i], "prefix": prefix,
                     "p_prefix": p_prefix, "draft": d, "p_draft": p2, "match": match,
                     "expected_acceptance": float(np.prod(p_prefix)) * p2}
                )  # fmt: skip
    return found


def best(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The PROMPTS rows best by expected acceptance, from distinct prompts."""
    chosen: list[dict[str, Any]] = []
    for row in sorted(found, key=lambda r: -r["expected_acceptance"]):
        if row["source"] not in {c["source"] for c in chosen}:
            chosen.append(row)
        if len(chosen) == PROMPTS:
            break
    return chosen


def picker(argv: list[str] | None, *, doc: str | None, out: Path) -> tuple[argparse.Namespace, Path, Any, list[str]]:
    """What a CPU picker of serve_features' inputs starts from (this module's and ``long_prompt``'s): its
    arguments (``--prompts``, ``--out``), the shared target's folder, the target in float32, the code pool."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.serve_features import load_prompts
    from specdec.paths import TARGET_MODEL, model_path

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="device_inputs/serve_prompts.json", help="from `serve_bench prepare`")
    ap.add_argument("--out", default=str(out))
    args = ap.parse_args(argv)
    path = model_path(TARGET_MODEL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return args, path, model, load_prompts(Path(args.prompts))


def write_pick(args: argparse.Namespace, command: str, fields: dict[str, Any]) -> None:
    """A picker's JSON at ``--out``: its command, the model and dtype, then ``fields``."""
    from specdec.paths import TARGET_MODEL

    doc = {"command": command, "model": TARGET_MODEL, "dtype": "float32", **fields}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    from tokenizers import Tokenizer

    args, path, model, pool = picker(argv, doc=__doc__, out=OUT)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    chosen = [row for position in POSITIONS for row in best(scan(model, tok, pool, position=position))]
    write_pick(args, "python -m benchmarks.sampling_prompts", {"pool": "code", "prompts": chosen})
    for c in chosen:
        print(
            f"position {c['position']}: code prompt {c['source']} cut at {c['cut']}: "
            f"p(prefix) {min(c['p_prefix']):.3f}, p(draft) {c['p_draft']:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
