"""Pick the prompts of serve_features' sampling check on the CPU: code prompts cut where the target's next token is
near-certain (the first output token, never drafted) and the one after is uncertain but predicted by the prompt
itself, so a suffix drafter proposes it and about half the samples accept a draft there.

    python -m benchmarks.sampling_prompts            # writes benchmarks/sampling_prompts.json (token ids)

For every cut i of the first SCAN_PROMPTS code prompts (one float32 forward pass of the shared 53M target per
prompt): t1 = the prompt's own token i must be the target's mode with probability >= MIN_FIRST; the draft d = the
token after the latest earlier occurrence of the longest suffix (MIN_MATCH to MAX_MATCH tokens) of prompt[:i] + t1;
d must be the mode at position 2 with probability in SECOND_RANGE. Expected acceptance at position 2 (a one-token
draft accepted with the target's probability) = p(t1) x p(d). The PROMPTS best by that, from distinct prompts, are
written with their measured probabilities.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SCAN_PROMPTS = 200
MAX_PROMPT_TOKENS = 400
MIN_CUT = 20
MIN_FIRST = 0.98
SECOND_RANGE = (0.45, 0.65)  # p(mode) at position 2: uncertain enough that a 3% bias moves it, likely enough to accept
MIN_MATCH, MAX_MATCH = 4, 16
PROMPTS = 2
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


def scan(model: Any, tok: Any, prompts: list[str]) -> list[dict[str, Any]]:
    import torch

    found = []
    for index, text in enumerate(prompts[:SCAN_PROMPTS]):
        ids = tok.encode(text, add_special_tokens=False).ids
        if len(ids) > MAX_PROMPT_TOKENS:
            continue
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([ids])).logits[0].float(), -1)  # [T, V]
        for i in range(MIN_CUT, len(ids) - 1):
            t1 = ids[i]
            p1 = float(probs[i - 1, t1])
            if int(probs[i - 1].argmax()) != t1 or p1 < MIN_FIRST:
                continue
            d, match = prompt_draft(ids[: i + 1])
            if d is None or int(probs[i].argmax()) != d:
                continue
            p2 = float(probs[i, d])
            if SECOND_RANGE[0] <= p2 <= SECOND_RANGE[1]:
                found.append(
                    {"source": index, "cut": i, "ids": ids[:i], "first": t1, "p_first": p1, "draft": d,
                     "p_draft": p2, "match": match, "expected_acceptance": p1 * p2}
                )  # fmt: skip
    return found


def main(argv: list[str] | None = None) -> int:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from benchmarks.serve_features import load_prompts
    from specdec.paths import TARGET_MODEL, model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="device_inputs/serve_prompts.json", help="from `serve_bench prepare`")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    path = model_path(TARGET_MODEL)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    found = sorted(scan(model, tok, load_prompts(Path(args.prompts))), key=lambda r: -r["expected_acceptance"])
    chosen: list[dict[str, Any]] = []
    for row in found:
        if row["source"] not in {c["source"] for c in chosen}:
            chosen.append(row)
        if len(chosen) == PROMPTS:
            break
    doc = {"command": "python -m benchmarks.sampling_prompts", "model": TARGET_MODEL, "dtype": "float32",
           "pool": "code", "prompts": chosen}  # fmt: skip
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for c in chosen:
        print(f"code prompt {c['source']} cut at {c['cut']}: p(first) {c['p_first']:.3f}, p(draft) {c['p_draft']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
