"""The fake `vllm bench serve` (``python -m benchmarks.serve_fake bench serve ...``, which runs this): reads the flags
the drivers pass to `vllm bench serve`, sends the dataset's requests (streaming) to a fake server
(``benchmarks.serve_fake``) and writes a result JSON with the keys vLLM 0.26's `vllm bench serve` writes."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

BENCH_THREADS = 8
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "\n", "sigma", "tau")  # the fake's vocabulary (its server's too)


def _dataset(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.dataset_name == "custom":
        rows = [json.loads(line) for line in Path(args.dataset_path).read_text().splitlines() if line.strip()]
        return rows[: args.num_prompts]
    rng = random.Random(args.seed)
    return [
        {
            "prompt": " ".join(rng.choice(WORDS) for _ in range(args.random_input_len)),
            "output_tokens": args.random_output_len,
        }
        for _ in range(args.num_prompts)
    ]


def _one(url: str, model: str, row: dict[str, Any], temperature: float | None) -> dict[str, Any]:
    body = {"model": model, "prompt": row["prompt"], "max_tokens": int(row["output_tokens"]), "stream": True}
    if temperature is not None:
        body["temperature"] = temperature
    t0 = time.perf_counter()
    stamps = []
    try:
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    stamps.append(time.perf_counter())
    except OSError as exc:
        return {"ok": False, "error": repr(exc)}
    ttft = stamps[0] - t0 if stamps else 0.0
    itl = list(np.diff(stamps)) if len(stamps) > 1 else []
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return {"ok": True, "ttft": ttft, "itl": itl, "tpot": tpot, "tokens": len(stamps)}


def _spec(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("vllm:spec")}


def _bench_parser() -> argparse.ArgumentParser:
    """The `vllm bench serve` flags the fake reads (others are ignored, as ``parse_known_args`` leaves them)."""
    ap = argparse.ArgumentParser(prog="serve_fake bench serve")
    for flag, kw in (
        ("--host", {"default": "127.0.0.1"}),
        ("--port", {"type": int, "default": 8000}),
        ("--model", {}),
        ("--dataset-name", {"default": "random"}),
        ("--dataset-path", {}),
        ("--num-prompts", {"type": int, "default": 1000}),
        ("--request-rate", {"default": "inf"}),
        ("--max-concurrency", {"type": int}),
        ("--random-input-len", {"type": int, "default": 16}),
        ("--seed", {"type": int, "default": 0}),
        ("--random-output-len", {"type": int, "default": 16}),
        ("--temperature", {"type": float}),
        ("--result-dir", {"default": "."}),
        ("--result-filename", {"default": "result.json"}),
    ):
        ap.add_argument(flag, **kw)
    ap.add_argument("--save-detailed", action="store_true")
    return ap


def bench(argv: list[str]) -> int:
    args, _ = _bench_parser().parse_known_args(argv)
    base = f"http://{args.host}:{args.port}"
    rows = _dataset(args)
    before = _spec(f"{base}/metrics")
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(min(BENCH_THREADS, args.max_concurrency or BENCH_THREADS)) as pool:
        outs = list(pool.map(lambda r: _one(f"{base}/v1/completions", args.model, r, args.temperature), rows))
    duration = time.perf_counter() - t0
    after = _spec(f"{base}/metrics")
    result = _summary(args.request_rate, outs, duration)
    result["max_concurrency"] = args.max_concurrency
    if before:
        d = {k: after[k] - before.get(k, 0.0) for k in after}
        drafts, drafted = d["vllm:spec_decode_num_drafts_total"], d["vllm:spec_decode_num_draft_tokens_total"]
        accepted = d["vllm:spec_decode_num_accepted_tokens_total"]
        result.update(
            spec_decode_acceptance_rate=100 * accepted / max(drafted, 1),
            spec_decode_acceptance_length=1 + accepted / max(drafts, 1),
        )
    if args.save_detailed:  # per request, in the order sent, as vLLM's (seconds)
        result["output_lens"] = [o.get("tokens", 0) for o in outs]
        result["ttfts"] = [o.get("ttft", 0.0) for o in outs]
        result["itls"] = [[float(x) for x in o.get("itl", [])] for o in outs]
        result["errors"] = [o.get("error", "") for o in outs]
    out = Path(args.result_dir) / args.result_filename
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result))
    print(f"fake bench: {sum(o['ok'] for o in outs)}/{len(outs)} completed")
    return 0


def _summary(rate: str, outs: list[dict[str, Any]], duration: float) -> dict[str, Any]:
    """`vllm bench serve`'s totals and its mean / median / p50 / p99 TTFT, TPOT and ITL (ms) over the requests that
    completed."""
    ok = [o for o in outs if o["ok"]]
    tokens = sum(o["tokens"] for o in ok)
    result: dict[str, Any] = {
        "request_rate": rate,
        "num_prompts": len(outs),
        "duration": duration,
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "total_output_tokens": tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": tokens / duration,
    }
    series = {
        "ttft": [o["ttft"] for o in ok],
        "tpot": [o["tpot"] for o in ok],
        "itl": [x for o in ok for x in o["itl"]],
    }
    for name, xs in series.items():
        xs = xs or [0.0]
        result[f"mean_{name}_ms"] = float(np.mean(xs)) * 1e3
        result[f"median_{name}_ms"] = float(np.median(xs)) * 1e3
        for p in (50, 99):
            result[f"p{p}_{name}_ms"] = float(np.percentile(xs, p)) * 1e3
    return result
