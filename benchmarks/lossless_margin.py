"""Why a float32 lossless check differs: the reference's top-2 log-probability margin at each first difference.

A greedy speculative engine is lossless when its output equals plain greedy decoding token for token. In float32 a
difference can still come from arithmetic: a verify batch runs other GEMM shapes than one-token decoding, which
round differently, and where plain decoding's two best tokens are nearly tied the argmax can flip. This tool
replays the engine sequence of ``bench_vllm --lossless-only`` (per dataset: the warm-up, then the closed batches in
order, so the suffix drafter's global cache holds what it held there) for no-spec, asking for the top-2
log-probabilities of every generated token, and for one method; for every prompt whose outputs differ it reports
the first differing position, no-spec's margin there (log-probability of its token minus the runner-up's) and
whether the method took the runner-up. A margin near float32 rounding (``--tie-margin``) with the runner-up taken
is an arithmetic near-tie; anything else is a bug to chase.

    python -m benchmarks.lossless_margin --prompts device_inputs/prompts.json --method w4 \
        --variants '{"w4": {"base": "specdec", "spec": {"narrow_slots": 4}}}' --graphs --out margins.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_vllm_methods import LOSSLESS_MAX_TOKENS, _spec_config
from specdec.paths import TARGET_MODEL, model_path

REFERENCE = "nospec"
TOP_LOGPROBS = 2  # the reference's token and its runner-up
TIE_MARGIN = 1e-3  # nats: below this a float32 rounding difference can flip the argmax (the report's "near tie")


def _engine(args: argparse.Namespace, method: str) -> Any:
    from vllm import LLM

    spec = (
        None
        if method == REFERENCE
        else _spec_config(method, json.loads(args.specdec_config or "{}"), json.loads(args.variants or "{}"))
    )
    return LLM(
        model=args.model,
        dtype="float32",
        speculative_config=spec,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_mem,
        max_num_seqs=max(args.batch_sizes),
        seed=0,
        enforce_eager=not args.graphs,
    )


def worker(args: argparse.Namespace) -> None:
    """One engine (``--worker``): the sequence of the lossless check; every output's tokens (and, for the reference,
    each token's top-2 log-probabilities) of the measured batches, by dataset and batch size."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import SamplingParams

    reference = args.worker == REFERENCE
    llm = _engine(args, args.worker)
    sp = SamplingParams(
        temperature=0.0, max_tokens=LOSSLESS_MAX_TOKENS, detokenize=False, logprobs=TOP_LOGPROBS if reference else None
    )
    prompts = json.loads(Path(args.prompts).read_text())["datasets"]
    out: dict[str, Any] = {}
    for name in args.datasets:
        sets = prompts[name]
        llm.generate([{"prompt_token_ids": p} for p in sets["warmup"]], sp, use_tqdm=False)
        for b in args.batch_sizes:
            cell = out.setdefault(f"{name}|{b}", {"tokens": [], "margins": []})
            for i in range(0, len(sets[f"bs{b}"]), b):
                chunk = [{"prompt_token_ids": p} for p in sets[f"bs{b}"][i : i + b]]
                for res in llm.generate(chunk, sp, use_tqdm=False):
                    seq = res.outputs[0]
                    cell["tokens"].append(list(seq.token_ids))
                    if reference:
                        cell["margins"].append([_margin(tok, lp) for tok, lp in zip(seq.token_ids, seq.logprobs)])
    Path(args.worker_out).write_text(json.dumps(out))


def _margin(token: int, logprobs: dict[int, Any]) -> float | None:
    """Log-probability of ``token`` minus the best other one's (None: no runner-up reported)."""
    mine = logprobs[token].logprob
    others = [lp.logprob for t, lp in logprobs.items() if t != token]
    return mine - max(others) if others else None


def compare(ref: dict[str, Any], got: dict[str, Any], *, tie_margin: float) -> list[dict[str, Any]]:
    """Every first difference: cell, prompt index, position, the reference's margin there, a near-tie verdict."""
    rows = []
    for cell, r in ref.items():
        for i, (want, have) in enumerate(zip(r["tokens"], got[cell]["tokens"])):
            if want == have:
                continue
            pos = next((j for j, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
            margin = r["margins"][i][pos] if pos < len(r["margins"][i]) else None
            rows.append(
                {
                    "cell": cell,
                    "prompt": i,
                    "position": pos,
                    "reference_token": want[pos] if pos < len(want) else None,
                    "method_token": have[pos] if pos < len(have) else None,
                    "margin": margin,
                    "near_tie": margin is not None and margin < tie_margin,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="prepare_prompts' JSON (device_inputs/prompts.json)")
    ap.add_argument("--model", default=str(model_path(TARGET_MODEL)))
    ap.add_argument("--method", default="specdec", help="a bench_vllm method or a --variants name")
    ap.add_argument("--variants", default="", help="bench_vllm's --variants JSON")
    ap.add_argument("--specdec-config", default="", help="JSON merged into the specdec methods' config")
    ap.add_argument("--datasets", default="code,agentic", type=lambda s: s.split(","))
    ap.add_argument("--batch-sizes", default="8,32,64", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs (bench_vllm --lossless-graphs)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--tie-margin", type=float, default=TIE_MARGIN, help="nats; below it a difference is a near tie")
    ap.add_argument("--out", default="", help="write the report here (JSON)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for which in (REFERENCE, args.method):
            path = Path(tmp) / f"{which}.json"
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.lossless_margin",
                *(argv if argv is not None else sys.argv[1:]),
                "--worker",
                which,
                "--worker-out",
                str(path),
            ]
            subprocess.check_call(cmd)
            results[which] = json.loads(path.read_text())
    rows = compare(results[REFERENCE], results[args.method], tie_margin=args.tie_margin)
    print("| cell | prompt | position | no-spec token | method token | no-spec margin (nats) | near tie |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        m = "n/a" if r["margin"] is None else f"{r['margin']:.2e}"
        print(
            f"| {r['cell']} | {r['prompt']} | {r['position']} | {r['reference_token']} | {r['method_token']} | {m} "
            f"| {'yes' if r['near_tie'] else 'NO'} |"
        )
    compared = {c: len(v["tokens"]) for c, v in results[REFERENCE].items()}
    print(f"compared: {compared}; differences: {len(rows)}, near ties: {sum(r['near_tie'] for r in rows)}")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "method": args.method,
                    "variants": args.variants,
                    "specdec_config": args.specdec_config,
                    "graphs": args.graphs,
                    "tie_margin": args.tie_margin,
                    "compared": compared,
                    "differences": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
