"""Record a target model's own greedy outputs on a benchmark prompt set, as traces for ``specdec-eval replay``.

The vLLM benchmark (``bench_vllm``) measures drafters on what the served target generates, not on the recorded
LLM responses of the shared data. This tool makes that workload available offline: it runs the target (Hugging
Face, float32, CPU by default) greedily on one prompt set of ``device_inputs/prompts.json`` (``prepare_prompts``)
with the benchmark's rules (``--max-tokens`` tokens, EOS ignored, as ``ignore_eos``) and writes generic JSONL
(``prompt_ids`` / ``response_ids``) that the eval tool replays like any trace set::

    python -m benchmarks.target_outputs --dataset agentic --set sus64 --limit 32 --out /tmp/agentic_sus64.jsonl
    specdec-eval sweep /tmp/agentic_sus64.jsonl --drafter suffix --grid suffix.max_spec_factor=1,8 --batch-size 32

The 8B-sized target of the GPU runs (``--inflate llama-8b``) computes the same function as the shared 53M target,
so the 53M model's outputs here are the inflated target's (up to bf16 vs float32 numerics).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.paths import TARGET_MODEL, model_path

DEFAULT_MAX_TOKENS = 256  # bench_vllm's --max-tokens
DEFAULT_BATCH = 8  # prompts per generate call (left-padded)
PAD_ID = 0  # left padding (masked out; never generated: EOS is ignored and generation is greedy)


def load_prompt_set(path: str | Path, dataset: str, name: str, limit: int | None = None) -> list[list[int]]:
    """Token-id prompts of ``datasets[dataset][name]`` in a ``prepare_prompts`` file (the first ``limit``)."""
    data = json.loads(Path(path).read_text())
    sets = data.get("datasets", {})
    if dataset not in sets:
        raise SystemExit(f"{path}: no dataset {dataset!r} (has {sorted(sets)}); run benchmarks.prepare_prompts")
    if name not in sets[dataset]:
        raise SystemExit(f"{path}: dataset {dataset!r} has no set {name!r} (has {sorted(sets[dataset])})")
    prompts = [list(map(int, p)) for p in sets[dataset][name]]
    return prompts[:limit] if limit else prompts


def greedy_outputs(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    batch: int,
    progress: bool = True,
    eos: int | None = None,
) -> list[list[int]]:
    """Each prompt's greedy continuation of exactly ``max_tokens`` tokens (EOS ignored), ``batch`` at a time; with
    ``eos``, of at most ``max_tokens``, up to and including the first ``eos`` (EOS respected, as vLLM's outputs)."""
    import torch
    from tqdm import tqdm

    out: list[list[int]] = []
    starts = range(0, len(prompts), batch)
    for i in tqdm(starts, desc="target outputs", unit="batch", disable=not progress):
        chunk = prompts[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), PAD_ID, dtype=torch.long)  # [b, width], prompts right-aligned
        mask = torch.zeros_like(ids)
        for row, p in enumerate(chunk):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens if eos is None else 0,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=PAD_ID,
            )
        out.extend(_until(gen[row, width:].tolist(), eos) for row in range(len(chunk)))
    return out


def _until(tokens: list[int], eos: int | None) -> list[int]:
    """``tokens`` up to and including the first ``eos`` (all of them without one)."""
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def write_jsonl(
    path: str | Path, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, prefix: str
) -> None:
    """Generic trace JSONL: one ``{"id", "prompt_ids", "response_ids"}`` object per line."""
    with open(path, "w") as f:
        for i, (p, r) in enumerate(zip(prompts, responses)):
            f.write(json.dumps({"id": f"{prefix}-{i}", "prompt_ids": list(p), "response_ids": list(r)}) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="device_inputs/prompts.json", help="from benchmarks.prepare_prompts")
    ap.add_argument("--dataset", default="agentic", help="code | agentic")
    ap.add_argument("--set", default="sus64", help="prompt set of the dataset (bs1, bs8, ..., sus32, sus64)")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts only")
    ap.add_argument("--model", default=str(model_path(TARGET_MODEL)), help="Hugging Face model folder")
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    ap.add_argument("--batch-size", type=int, default=DEFAULT_BATCH, help="prompts per generate call")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", required=True, help="JSONL to write")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.max_tokens < 1 or args.batch_size < 1:
        raise SystemExit(f"--max-tokens {args.max_tokens} and --batch-size {args.batch_size} must be >= 1")

    import torch
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = load_prompt_set(args.prompts, args.dataset, args.set, args.limit)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    responses = greedy_outputs(
        model, prompts, max_tokens=args.max_tokens, batch=args.batch_size, progress=not args.no_progress
    )
    write_jsonl(args.out, prompts, responses, prefix=f"{args.dataset}-{args.set}")
    print(f"{len(prompts)} prompts x {args.max_tokens} tokens -> {args.out}")


if __name__ == "__main__":
    main()
