"""Pick where serve_features' long prompt ends, on the CPU: the target must continue the copy it ends in.

    python -m benchmarks.long_prompt            # writes benchmarks/long_prompt.json (the copy offset)

The long prompt (``serve_features.long_prompt_ids``) repeats the code pool's first prompt up to max_model_len and
ends part-way through a copy, so the suffix drafter proposes the rest of that copy. The shared 53M target follows
a copy only inside its training length (1,024-token sequences; at 2,040 tokens no offset of the first prompt is
followed for more than 2 tokens), which is why the feature servers' max_model_len is 1,024; even there it does
not follow every offset. Per candidate offset (every OFFSET_STEP-th token of the copy), one float32 greedy generation of
NEW_TOKENS tokens on the prompt of the feature's drafting case (max_model_len - 8 tokens) counts how many output
tokens follow the copy; the first offset where at least MIN_FOLLOW do is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NEW_TOKENS = 7  # the feature's drafting case: max_model_len - 8 prompt tokens, 7 new ones
MIN_FOLLOW = 5  # output tokens that must continue the copy (drafts of 1-4 tokens accepted after the first)
OFFSET_STEP = 3
OUT = Path(__file__).with_name("long_prompt.json")


def following(out: list[int], unit: list[int], offset: int) -> int:
    """How many leading tokens of ``out`` continue the copy of ``unit`` from ``offset`` (cyclically)."""
    n = 0
    for i, t in enumerate(out):
        if t != unit[(offset + i) % len(unit)]:
            break
        n += 1
    return n


def scan(model: Any, unit: list[int], ids_at: Any) -> list[dict[str, Any]]:
    """(offset, following) per candidate offset, in order, until one reaches MIN_FOLLOW."""
    import torch

    from benchmarks.serve_feature_checks import MAX_MODEL_LEN

    rows = []
    for offset in range(0, len(unit), OFFSET_STEP):
        ids = ids_at(offset)[-(MAX_MODEL_LEN - NEW_TOKENS - 1) :]
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        out = gen[0, len(ids) :].tolist()  # [NEW_TOKENS]
        rows.append({"offset": offset, "following": following(out, unit, offset), "output": out})
        print(f"offset {offset}: {rows[-1]['following']} of {NEW_TOKENS} output tokens continue the copy", flush=True)
        if rows[-1]["following"] >= MIN_FOLLOW:
            break
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.sampling_prompts import picker, write_pick
    from benchmarks.serve_features import copy_unit, long_prompt_ids

    args, path, model, prompts = picker(argv, doc=__doc__, out=OUT)
    model_dir = str(path)
    rows = scan(model, copy_unit(model_dir, prompts), lambda offset: long_prompt_ids(model_dir, prompts, offset=offset))
    if rows[-1]["following"] < MIN_FOLLOW:
        print(f"no offset has {MIN_FOLLOW} output tokens continuing the copy; nothing written")
        return 1
    write_pick(args, "python -m benchmarks.long_prompt", {"offset": rows[-1]["offset"], "scanned": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
