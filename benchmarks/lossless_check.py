"""Lossless check on the shared pair: speculative greedy == plain greedy, token for token, plus MAT.

    python -m benchmarks.lossless_check --prompts 20 --max-new-tokens 64 --batch-sizes 1 4 \
        --modes chain tree --drafters model

Target ``code-target-53m`` (float32) is verified by the reference verifier (``specdec.verifiers.reference``);
prompts are the first N HumanEval prompts, ``[BOS] + tokenizer(prompt.rstrip("\n"))`` (with the final newline
the target ends the document at once; without it, it writes the function body); EOS (id 0) ends a response.
The baseline is plain greedy decoding (drafter=None) one prompt at a time; every (drafter, chain/tree,
batch size) run must reproduce it exactly. Writes ``eval/results/<date>_<device>_lossless.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from specdec.drafters.base import Drafter
from specdec.generation import SpecGenerator, SpecStats, load_target
from specdec.paths import TARGET_MODEL, data_dir, model_path, require

HUMAN_EVAL = "human_eval/HumanEval.jsonl.gz"
DEFAULT_PROMPTS = 20
DEFAULT_MAX_NEW = 64
DEFAULT_BUDGET = 8


def load_pair_target(device: str = "cpu") -> tuple[torch.nn.Module, Any]:
    """The shared target in float32 and its tokenizer."""
    from transformers import AutoTokenizer

    path = require(model_path(TARGET_MODEL), "shared target model")
    return load_target(str(path), device=device), AutoTokenizer.from_pretrained(str(path))


def humaneval_prompts(tokenizer: Any, limit: int) -> list[list[int]]:
    """The first ``limit`` HumanEval prompts as ``[BOS] + ids(prompt without its final newline)``."""
    path = require(data_dir() / HUMAN_EVAL, "HumanEval data")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        texts = [json.loads(line)["prompt"] for line in fh if line.strip()][:limit]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + tokenizer(t.rstrip("\n"), add_special_tokens=False)["input_ids"] for t in texts]


def plain_greedy(
    target: torch.nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_token_id: int | None
) -> tuple[list[list[int]], SpecStats]:
    """The baseline: plain greedy decoding, one prompt at a time."""
    gen = SpecGenerator(target)
    tokens, stats = [], SpecStats()
    for p in prompts:
        res = gen.generate([p], max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        tokens += res.tokens
        stats = stats.merge(res.stats)
    return tokens, stats


def run_one(
    target: torch.nn.Module,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int]],
    *,
    tree: bool,
    batch_size: int,
    budget: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    progress: bool = False,
) -> tuple[list[list[int]], SpecStats]:
    """Speculative greedy generation of ``prompts`` in batches of ``batch_size``; (tokens, summed stats)."""
    gen = SpecGenerator(target, drafter, budget=budget, tree=tree)
    tokens, stats = [], SpecStats()
    for lo in range(0, len(prompts), batch_size):
        res = gen.generate(
            list(prompts[lo : lo + batch_size]),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            progress=progress,
        )
        tokens += res.tokens
        stats = stats.merge(res.stats)
    return tokens, stats


def make_drafter(name: str, *, model_backend: str) -> Drafter:
    from specdec.drafters.registry import build_drafter

    return build_drafter({"name": "model", "backend": model_backend} if name == "model" else name)


def compare(tokens: list[list[int]], baseline: list[list[int]]) -> list[dict[str, Any]]:
    """Per prompt: equal or not, and where the first difference is."""
    out = []
    for i, (a, b) in enumerate(zip(tokens, baseline)):
        diff = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        out.append({"prompt": i, "equal": diff is None, "first_diff": diff, "tokens": len(a)})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from specdec.eval.results import results_path, write_results

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tok = load_pair_target("cpu")
    prompts = humaneval_prompts(tok, args.prompts)
    eos = None if args.no_eos else tok.eos_token_id
    t0 = time.perf_counter()
    baseline, base_stats = plain_greedy(target, prompts, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
    base_s = time.perf_counter() - t0
    results: list[dict[str, Any]] = [
        {
            "drafter": "none",
            "mode": "plain",
            "batch_size": 1,
            "all_equal": True,
            "tokens_per_second": base_stats.emitted_tokens / base_s,
            **base_stats.as_dict(),
        }
    ]
    results += _checked_runs(args, target, prompts, baseline=baseline, eos=eos)
    path = write_results(args.out or results_path("lossless"), _settings(args, eos), results)
    _print_table(results)
    print(f"wrote {path}")
    return 0 if all(r["all_equal"] for r in results) else 1


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="first N HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW)
    ap.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help="draft tokens per request per step")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--modes", nargs="+", choices=("chain", "tree"), default=["chain", "tree"])
    ap.add_argument("--drafters", nargs="+", default=["model"], help="drafter names (model, suffix, ngram)")
    ap.add_argument("--model-backend", default="eager", help="ModelDrafter backend (eager, torch, onnx, auto...)")
    ap.add_argument("--no-eos", action="store_true", help="ignore EOS: always generate --max-new-tokens")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave the default)")
    ap.add_argument(
        "--out", default=None, help="results JSON path (default eval/results/<date>_<device>_lossless.json)"
    )
    ap.add_argument("--progress", action="store_true")
    return ap


def _checked_runs(
    args: argparse.Namespace,
    target: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    baseline: list[list[int]],
    eos: int | None,
) -> list[dict[str, Any]]:
    """Plain greedy at the batch sizes past 1, then every (drafter, mode, batch size), each compared with
    ``baseline`` prompt by prompt."""
    results: list[dict[str, Any]] = []
    runs = [(None, "plain", b) for b in args.batch_sizes if b > 1]
    runs += [(d, m, b) for d in args.drafters for m in args.modes for b in args.batch_sizes]
    for name, mode, bs in runs:
        drafter = make_drafter(name, model_backend=args.model_backend) if name else None
        t0 = time.perf_counter()
        tokens, stats = run_one(
            target,
            drafter,
            prompts,
            tree=mode == "tree",
            batch_size=bs,
            budget=args.budget,
            max_new_tokens=args.max_new_tokens,
            eos_token_id=eos,
            progress=args.progress,
        )
        wall = time.perf_counter() - t0
        per_prompt = compare(tokens, baseline)
        results.append(
            {
                "drafter": name or "none",
                "mode": mode,
                "batch_size": bs,
                "all_equal": all(p["equal"] for p in per_prompt),
                "tokens_per_second": stats.emitted_tokens / wall,
                **stats.as_dict(),
                "per_prompt": per_prompt,
            }
        )
        if drafter is not None:
            drafter.close()
    return results


def _settings(args: argparse.Namespace, eos: int | None) -> dict[str, Any]:
    """The results file's settings: target, prompts, lengths, budget, backend, threads, verifier."""
    return {
        "target": TARGET_MODEL,
        "dtype": "float32",
        "device": "cpu",
        "prompts": args.prompts,
        "prompt_source": HUMAN_EVAL,
        "prompt_format": "[BOS] + tokenizer(prompt.rstrip('\\n'))",
        "max_new_tokens": args.max_new_tokens,
        "eos_token_id": eos,
        "budget": args.budget,
        "model_backend": args.model_backend,
        "torch_threads": torch.get_num_threads(),
        "verifier": "specdec.verifiers.reference (greedy)",
    }


def _print_table(results: list[dict[str, Any]]) -> None:
    head = f"{'drafter':<8} {'mode':<6} {'bs':>3} {'equal':>6} {'MAT':>6} {'acc.rate':>8} {'steps':>6} {'tok/s':>7}"
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r['drafter']:<8} {r['mode']:<6} {r['batch_size']:>3} {str(r['all_equal']):>6} {r['mat']:>6.2f} "
            f"{r['acceptance_rate']:>8.3f} {r['steps']:>6} {r['tokens_per_second']:>7.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
