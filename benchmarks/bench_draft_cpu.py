"""CPU benchmark of the draft model: decode-step latency per backend vs eager Hugging Face, same run.

    python -m benchmarks.bench_draft_cpu --threads 2 --batches 1,8,32
    python -m benchmarks.bench_draft_cpu --threads 8 --affinity 0-7 --backends torch,onnx   # Xeon, half the cores

Per backend and batch size: ``batch`` requests each hold a ``--prompt-len`` context (random tokens), then
``--steps`` timed decode steps feed one token per request and read its logits (a chain draft's inner step).
``eager-hf`` is the baseline: Hugging Face's own forward with one batched ``DynamicCache``. Also measured:
``draft8`` = one ``ModelDrafter.draft_batch`` of an 8-token chain per request (catch-up of the bonus token + 8
forwards, the drafter's real per-step cost), and the top-1 agreement of every backend with fp32 eager HF on the
shared model's own greedy continuations of HumanEval prompts (teacher-forced, decode path), so quantized or
bf16 backends show whether acceptance can suffer. Missing backends (no onnxruntime, compile failure...)
are reported as unavailable and skipped. JSON goes to eval/results/<date>_<device>_draft_cpu.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.drafters.cpu_info import detect_cpu, ipex_status
from specdec.drafters.model_backends import BACKEND_NAMES, DraftBackend, StepInput, load_hf_model, make_backend
from specdec.drafters.model_calibrate import time_decode_step
from specdec.paths import DRAFT_MODEL, data_dir, model_path

logger = logging.getLogger("benchmarks.bench_draft_cpu")
BASELINE = "eager-hf"
DRAFT_BUDGET = 8
AGREE_TOKENS = 32  # greedy tokens per prompt for the agreement check


def parse_cpus(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def hf_decode_times(model: torch.nn.Module, *, batch: int, prompt_len: int, steps: int, warmup: int) -> list[float]:
    """Eager HF decode steps with one batched DynamicCache (the baseline)."""
    from transformers import DynamicCache

    rng = np.random.default_rng(0)
    cache = DynamicCache(config=model.config)
    ids = torch.as_tensor(rng.integers(2, 1000, size=(batch, prompt_len)))  # [B, P]
    times = []
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        for i in range(warmup + steps):
            tok = torch.as_tensor(rng.integers(2, 1000, size=(batch, 1)))  # [B, 1]
            t0 = time.perf_counter()
            model(input_ids=tok, past_key_values=cache, use_cache=True)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return times


def draft_times(backend: DraftBackend, *, batch: int, prompt_len: int, rounds: int) -> list[float]:
    """Seconds per ``ModelDrafter.draft_batch`` of ``DRAFT_BUDGET``-token chains for ``batch`` requests."""
    from specdec.drafters.base import DraftRequest
    from specdec.drafters.model import ModelDrafter

    drafter = ModelDrafter.from_backend(backend)  # reuse the built backend (no second load/calibration)
    rng = np.random.default_rng(1)
    reqs = [DraftRequest(f"r{i}", DRAFT_BUDGET) for i in range(batch)]
    for r in reqs:
        drafter.start(r.request_id, rng.integers(2, 1000, size=prompt_len).tolist())
    times = []
    for i in range(rounds + 1):
        t0 = time.perf_counter()
        trees = drafter.draft_batch(reqs)
        if i:
            times.append(time.perf_counter() - t0)
        for r, t in zip(reqs, trees):  # accept half the draft, then a bonus token
            drafter.extend(r.request_id, t.tokens[: DRAFT_BUDGET // 2].tolist() + [int(rng.integers(2, 1000))])
    drafter.close()
    return times


def agreement_sequences(model: torch.nn.Module, prompts: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy continuation) pairs from fp32 eager HF (the reference the backends are checked against)."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.as_tensor([p])
            gen = model.generate(ids, max_new_tokens=AGREE_TOKENS, do_sample=False, pad_token_id=0)
            out.append((p, gen[0, len(p) :].tolist()))
    return out


def top1_agreement(backend: DraftBackend, seqs: list[tuple[list[int], list[int]]]) -> float:
    """Fraction of positions where the backend's argmax equals the fp32 greedy token (decode path)."""
    hits = total = 0
    for prompt, cont in seqs:
        st = backend.new_state()
        logits = backend.forward([StepInput(st, prompt, list(range(len(prompt))), [len(prompt) - 1])])[0]
        for i, tok in enumerate(cont):
            hits += int(int(logits[0].argmax()) == tok)
            total += 1
            logits = backend.forward([StepInput(st, [tok], [len(prompt) + i], [0])])[0]
        backend.release(st)
    return hits / max(total, 1)


def load_code_prompts(n: int, model_dir: Path) -> list[list[int]]:
    """Token ids of the first ``n`` HumanEval prompts (random tokens when the shared data is absent)."""
    path = data_dir() / "human_eval" / "HumanEval.jsonl.gz"
    tok_file = model_dir / "tokenizer.json"
    if not path.exists() or not tok_file.exists():
        rng = np.random.default_rng(2)
        return [rng.integers(2, 1000, size=64).tolist() for _ in range(n)]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh.read().split("\n") if line.strip()][:n]
    return [tok.encode(r["prompt"]).ids for r in rows]


def stats_ms(times: list[float]) -> dict[str, float]:
    a = np.asarray(times) * 1e3
    return {
        "median_ms": float(np.median(a)),
        "p10_ms": float(np.percentile(a, 10)),
        "p90_ms": float(np.percentile(a, 90)),
        "mean_ms": float(a.mean()),
        "n": int(a.size),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(model_path(DRAFT_MODEL)), help="HF draft model folder")
    ap.add_argument(
        "--backends",
        default=",".join((BASELINE,) + BACKEND_NAMES),
        help=f"comma list of {BASELINE} and {', '.join(BACKEND_NAMES)}",
    )
    ap.add_argument("--batches", default="1,8,32", help="comma list of batch sizes")
    ap.add_argument("--threads", type=int, default=0, help="torch/ORT intra-op threads (0 = torch default)")
    ap.add_argument("--affinity", default="", help="CPU ids to pin to, e.g. 0-7 (default: leave)")
    ap.add_argument("--prompt-len", type=int, default=256, help="context tokens before the timed steps")
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps per backend and batch")
    ap.add_argument("--warmup", type=int, default=5, help="untimed decode steps first")
    ap.add_argument("--draft-rounds", type=int, default=10, help="timed draft_batch calls (0 = skip draft8)")
    ap.add_argument("--agree-prompts", type=int, default=6, help="HumanEval prompts for top-1 agreement (0 = skip)")
    ap.add_argument(
        "--onnx-spin",
        type=int,
        default=0,
        choices=(0, 1),
        help="ONNX Runtime threads spin between ops (1) or sleep (0)",
    )
    ap.add_argument("--device-name", default="", help="device label in the file name (default cpu-<N>core)")
    ap.add_argument("--note", default="", help="free text stored in settings (e.g. 'contended')")
    ap.add_argument("--out", default="", help="output JSON (default eval/results/<date>_<device>_draft_cpu.json)")
    return ap.parse_args(argv)


def build(name: str, model_dir: Path, hf_model: Any, spin: int) -> Any:
    return hf_model if name == BASELINE else make_backend(name, model_dir, onnx_spin=bool(spin))


def measure(
    name: str, obj: Any, args: argparse.Namespace, batches: list[int], seqs: list[tuple[list[int], list[int]]]
) -> list[dict[str, Any]]:
    rows = []
    agree = None
    if seqs and name != BASELINE:
        agree = top1_agreement(obj, seqs)
    for b in batches:
        if name == BASELINE:
            t = hf_decode_times(obj, batch=b, prompt_len=args.prompt_len, steps=args.steps, warmup=args.warmup)
            d = None
        else:
            t = time_decode_step(obj, batch=b, prompt_len=args.prompt_len, steps=args.steps, warmup=args.warmup)
            d = (
                draft_times(obj, batch=b, prompt_len=args.prompt_len, rounds=args.draft_rounds)
                if args.draft_rounds
                else None
            )
        row = {"backend": name, "batch": b, "step": stats_ms(t), "top1_agreement_vs_fp32": agree}
        if d:
            row["draft8"] = stats_ms(d)
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    base = {r["batch"]: r["step"]["median_ms"] for r in rows if r["backend"] == BASELINE}
    print(f"{'backend':<12}{'batch':>6}{'step ms':>10}{'p10':>8}{'p90':>8}{'vs eager':>10}{'draft8 ms':>11}{'top1':>7}")
    for r in rows:
        s = r["step"]
        ratio = base.get(r["batch"], float("nan")) / s["median_ms"]
        d8 = f"{r['draft8']['median_ms']:.2f}" if r.get("draft8") else "-"
        agree = f"{r['top1_agreement_vs_fp32']:.3f}" if r["top1_agreement_vs_fp32"] is not None else "-"
        print(
            f"{r['backend']:<12}{r['batch']:>6}{s['median_ms']:>10.3f}{s['p10_ms']:>8.3f}{s['p90_ms']:>8.3f}"
            f"{ratio:>9.2f}x{d8:>11}{agree:>7}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("root", "torch", "onnxruntime"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.affinity:
        os.sched_setaffinity(0, set(parse_cpus(args.affinity)))
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = detect_cpu()
    print(f"CPU: {cpu.summary()}\ntorch {torch.__version__}, threads {torch.get_num_threads()}; {ipex_status()}")
    model_dir = Path(args.model)
    names = [n for n in args.backends.split(",") if n]
    bad = [n for n in names if n != BASELINE and n not in BACKEND_NAMES]
    if bad:
        raise SystemExit(f"--backends: unknown {bad}; valid: {BASELINE}, {', '.join(BACKEND_NAMES)}")
    batches = [int(b) for b in args.batches.split(",") if b]
    hf_model = load_hf_model(model_dir)
    seqs = agreement_sequences(hf_model, load_code_prompts(args.agree_prompts, model_dir)) if args.agree_prompts else []
    rows: list[dict[str, Any]] = []
    unavailable: dict[str, str] = {}
    from tqdm import tqdm

    for name in tqdm(names, desc="backends", file=sys.stderr):
        t0 = time.perf_counter()
        try:
            obj = build(name, model_dir, hf_model, args.onnx_spin)
            setup = time.perf_counter() - t0
            got = measure(name, obj, args, batches, seqs)
        except Exception as exc:  # noqa: BLE001 - a missing/broken backend is reported, not fatal
            unavailable[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"{name}: unavailable ({unavailable[name]})", file=sys.stderr)
            continue
        for r in got:
            r["setup_s"] = round(setup, 2)
        rows.extend(got)
    print_table(rows)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings.update(
        {
            "threads_effective": torch.get_num_threads(),
            "cpu_features": cpu.features,
            "ipex": ipex_status(),
            "unavailable": unavailable,
            "draft_budget": DRAFT_BUDGET,
        }
    )
    write(args, settings, rows)
    return 0


def write(args: argparse.Namespace, settings: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    with contextlib.suppress(ImportError):
        import onnxruntime  # noqa: F401 - recorded in versions when present
    from specdec.eval.results import results_path, write_results

    path = Path(args.out) if args.out else results_path("draft_cpu", device=args.device_name or None)
    write_results(path, settings, rows, device=args.device_name or None)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
