"""Verify-step cost against draft tokens per request: which draft budgets are *free* (docs/trees.md, Method).

    python -m specdec.eval.inflate_model --model $SPECDEC_MODELS/code-target-53m --shape llama-8b --out /tmp/m8b
    python -m benchmarks.step_cost_curve --model /tmp/m8b --out-dir /tmp/curve      # one GPU, ~1-2 minutes

For batch b in {1, 8} and draft tokens per request k in {0, 1, 2, 4, 8, 16, 32, 64}: one forward pass of the target
(transformers' LlamaForCausalLM, bf16, SDPA attention) over b x (k + 1) new tokens after a KV cache of ``--context``
tokens per request (k = 0: a plain decode step, no speculation). Two timings per cell, medians of ``--repeats``:

* ``event_ms``: CUDA events around the forward (eager PyTorch: includes the GPU idling while Python launches
  kernels, which flattens the curve at small token counts);
* ``busy_ms``: the sum of the GPU kernels' durations in one forward (torch.profiler), the step time without launch
  gaps, as under CUDA graphs (vLLM runs verify steps as FULL CUDA graphs). The free-budget rule reads this one.

Gap to vLLM: vLLM fuses RMSNorm, rotary, SiLU-and-mul and the residual adds, and attends with FlashAttention or
Triton over a paged cache; transformers runs those as separate, unfused kernels. The weight GEMMs, which set where
the curve bends (b x (k + 1) tokens moving from memory- to compute-bound), are the same cuBLAS GEMMs in both, so the
knee is where vLLM's is; the unfused elementwise kernels add a few percent that grows with the token count.
transformers' DynamicCache appends by concatenation (a copy of the cache per layer and step, ~0.3 ms at batch 8,
nearly the same for every k), where vLLM writes new entries in place: this lifts every k alike, which makes ratios
to k = 1 slightly smaller (more budgets look free) at batch 8; the JSON keeps absolute times to correct for it.

A budget k >= 1 is free at batch b when ``busy_ms(b, k) <= FREE_RATIO * busy_ms(b, 1)``. Writes
``step_cost_curve.{json,md,png}`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specdec.eval.report import save_png

FREE_RATIO = 1.1  # a budget is free when its step takes at most this multiple of the one-token step
KS = (0, 1, 2, 4, 8, 16, 32, 64)
BATCHES = (1, 8)
CONTEXT = 1024  # KV-cache tokens per request before the verify step
WARMUP = 3
REPEATS = 10
PROFILED = 3  # forwards per cell under the profiler (median of their kernel sums)
SEED = 0


# ----------------------------------------------------------------------------- pure logic
def free_budgets(curve: dict[int, float], *, ratio: float = FREE_RATIO) -> list[int]:
    """Budgets k >= 1 whose step time is at most ``ratio`` x the k = 1 step (``curve``: k -> ms)."""
    if 1 not in curve:
        raise ValueError(f"the curve needs k = 1 (the one-token step) to judge budgets; it has k = {sorted(curve)}")
    base = curve[1]
    return sorted(k for k, ms in curve.items() if k >= 1 and ms <= ratio * base)


def largest_free(curve: dict[int, float], *, ratio: float = FREE_RATIO) -> int:
    """The largest free budget (1 is always free)."""
    return max(free_budgets(curve, ratio=ratio))


# ----------------------------------------------------------------------------- measurement
def load_model(path: str, *, device: str, dtype: torch.dtype) -> Any:
    import transformers
    from transformers import LlamaForCausalLM

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # older releases read torch_dtype only
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa", **{key: dtype})
    return model.to(device=device, dtype=dtype).eval()


@torch.inference_mode()
def prefill(model: Any, *, batch: int, context: int, device: str) -> Any:
    """A KV cache of ``context`` random tokens per request (the cache content does not change the cost)."""
    from transformers import DynamicCache

    gen = torch.Generator(device="cpu").manual_seed(SEED)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=gen).to(device)  # [b, context]
    cache = DynamicCache()
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


@torch.inference_mode()
def verify_forward(model: Any, cache: Any, ids: torch.Tensor, context: int) -> torch.Tensor:
    """One verify step: ``ids`` [b, k + 1] after the cache; the cache is cut back to ``context`` afterwards."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True).logits  # [b, k + 1, vocab]
    added = cache.get_seq_length() - context
    if added > 0:  # a negative crop removes that many tokens, in old and new transformers alike
        cache.crop(-added)
    return out


def time_events(fn: Any, *, warmup: int, repeats: int) -> float:
    """Median ms of ``fn()`` between CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_busy(fn: Any, *, runs: int) -> float:
    """Median over ``runs`` forwards of the summed CUDA kernel time (ms) of one forward."""
    from torch.profiler import ProfilerActivity, profile

    sums = []
    for _ in range(runs):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        total_us = sum(
            _kernel_us(evt)
            for evt in prof.events()
            if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA
        )
        if total_us <= 0.0:  # profilers that attach kernels to their CPU ops only: the per-op device totals
            total_us = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages())
        if total_us <= 0.0:
            raise RuntimeError("torch.profiler recorded no CUDA kernel time; is the forward running on the GPU?")
        sums.append(total_us / 1000.0)
    return statistics.median(sums)


def _kernel_us(evt: Any) -> float:
    return float(evt.device_time if hasattr(evt, "device_time") else evt.cuda_time)


def measure(
    model: Any,
    *,
    batches: Sequence[int],
    ks: Sequence[int],
    context: int,
    device: str,
    warmup: int,
    repeats: int,
    profiled: int,
) -> list[dict[str, Any]]:
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(SEED + 1)
    for b in batches:
        cache = prefill(model, batch=b, context=context, device=device)
        for k in ks:
            ids = torch.randint(0, model.config.vocab_size, (b, k + 1), generator=gen).to(device)  # [b, k + 1]

            def fn(ids: torch.Tensor = ids, cache: Any = cache) -> torch.Tensor:
                return verify_forward(model, cache, ids, context)

            ev = time_events(fn, warmup=warmup, repeats=repeats)
            busy = time_busy(fn, runs=profiled) if device.startswith("cuda") else ev
            rows.append(
                {"batch": b, "k": k, "tokens": b * (k + 1), "event_ms": round(ev, 4), "busy_ms": round(busy, 4)}
            )
            print(f"b={b} k={k}: event {ev:.3f} ms, busy {busy:.3f} ms", flush=True)
        del cache
    return rows


# ----------------------------------------------------------------------------- report
def summarize(rows: Sequence[dict[str, Any]], *, key: str = "busy_ms") -> dict[str, Any]:
    """Per batch: the curve relative to k = 1 and the free budgets (by ``key``)."""
    out: dict[str, Any] = {}
    for b in sorted({r["batch"] for r in rows}):
        curve = {r["k"]: r[key] for r in rows if r["batch"] == b}
        base = curve[1]
        out[str(b)] = {
            "free_budgets": free_budgets(curve),
            "largest_free": largest_free(curve),
            "ratio_to_k1": {str(k): round(v / base, 4) for k, v in sorted(curve.items())},
        }
    return out


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# Verify-step cost vs draft tokens per request (8B shape)",
        "",
        (
            f"Command: `{doc['command']}`; device: {doc['device']}; torch {doc['versions']['torch']}, "
            f"transformers {doc['versions']['transformers']}; context {doc['context']} tokens per request; "
            f"free = busy_ms <= {FREE_RATIO} x busy_ms(k=1)."
        ),
        "",
        "| batch | k | tokens | event ms | busy ms | busy / k=1 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["rows"]:
        ratio = doc["summary"][str(r["batch"])]["ratio_to_k1"][str(r["k"])]
        lines.append(
            f"| {r['batch']} | {r['k']} | {r['tokens']} | {r['event_ms']:.3f} | {r['busy_ms']:.3f} | {ratio:.3f} |"
        )
    lines.append("")
    for b, s in doc["summary"].items():
        lines.append(
            f"- batch {b}: free budgets {s['free_budgets']} (largest {s['largest_free']}); by CUDA events "
            f"(eager): {doc['summary_events'][b]['free_budgets']}"
        )
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for b, s in doc["summary"].items():
        ks = [int(k) for k in s["ratio_to_k1"] if int(k) >= 1]
        ax.plot(ks, [s["ratio_to_k1"][str(k)] for k in ks], marker="o", label=f"batch {b}")
    ax.axhline(FREE_RATIO, color="grey", linestyle="--", label=f"{FREE_RATIO}x (free)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft tokens per request k")
    ax.set_ylabel("verify step / step with k = 1 (GPU busy)")
    ax.set_title(f"8B-shaped target, {doc['device']}")
    ax.legend()
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/tmp/m8b", help="the inflated 8B-shaped checkpoint folder")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("--ks", nargs="+", type=int, default=list(KS))
    ap.add_argument("--context", type=int, default=CONTEXT)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    if 1 not in args.ks or any(k < 0 for k in args.ks):
        raise SystemExit(f"--ks {args.ks}: must hold 1 (the one-token step) and no negative k")
    if not (Path(args.model) / "config.json").exists():
        raise SystemExit(
            f"--model {args.model}: no config.json; build it with python -m specdec.eval.inflate_model "
            "--model $SPECDEC_MODELS/code-target-53m --shape llama-8b --out /tmp/m8b"
        )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; run this on the GPU machine")
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = load_model(args.model, device=args.device, dtype=dtype)
    load_s = time.perf_counter() - t0
    rows = measure(
        model,
        batches=args.batches,
        ks=args.ks,
        context=args.context,
        device=args.device,
        warmup=WARMUP,
        repeats=args.repeats,
        profiled=PROFILED,
    )
    doc = document(args, rows, load_s=load_s, total_s=time.perf_counter() - t0)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_cost_curve.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    (out / "step_cost_curve.md").write_text(markdown(doc), encoding="utf-8")
    plot(doc, out / "step_cost_curve.png")
    print(markdown(doc))
    return 0


def document(args: argparse.Namespace, rows: list[dict[str, Any]], *, load_s: float, total_s: float) -> dict[str, Any]:
    import transformers

    dev = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or "cpu"
    vers = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import vllm

        vers["vllm"] = vllm.__version__
    except ImportError:  # vLLM is not needed here; its version is recorded when present
        vers["vllm"] = None
    return {
        "command": "python -m benchmarks.step_cost_curve " + " ".join(sys.argv[1:]),
        "device": dev,
        "versions": vers,
        "model": args.model,
        "context": args.context,
        "free_ratio": FREE_RATIO,
        "rows": rows,
        "summary": summarize(rows),
        "summary_events": summarize(rows, key="event_ms"),
        "load_s": round(load_s, 1),
        "total_s": round(total_s, 1),
    }


if __name__ == "__main__":
    sys.exit(main())
