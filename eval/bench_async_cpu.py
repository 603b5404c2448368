"""CPU simulation of the asynchronous drafting pipeline on recorded traces: sync vs ``AsyncDrafter``.

Replays trace records (greedy verification against the recorded response, as eval/replay.py) in batches
of ``B`` concurrent requests, with the engine's step simulated as vLLM's synchronous custom-proposer
path runs it:

    [critical: start/extend/draft_batch]  ->  [engine CPU work, holds the GIL: output processing,
    scheduling, input prep; ``--engine-cpu-ms``]  ->  [GPU forward + sync: sleeps ``gpu_ms(B)``, which
    releases the GIL like the CUDA sync does]  ->  outcome  ->  next step

Measured per mode: the critical path (what the GPU would wait for, per batched step), MAT, the hedge
hit rate, background drafting time, and the inflation of the engine's CPU work by background threads
(GIL contention). ``gpu_ms`` defaults to the no-spec step times of the shared 53M target on an H200
(batch / tok/s from issue 5's peer table). JSON to eval/results/<date>_<device>_bench_async_cpu.json.

    python -m specdec.eval.bench_async_cpu --datasets code_alpaca,openhands_swebench --limit 30
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from specdec.drafters.base import Drafter, DraftRequest
from specdec.drafters.registry import build_drafter
from specdec.eval.records import TraceRecord
from specdec.pipeline import AsyncConfig, AsyncDrafter

# no-spec step time (ms) of the shared target on an H200 = batch / measured tok/s (issue 5 peer table)
DEFAULT_GPU_MS = {1: 1 / 501 * 1e3, 8: 8 / 3582 * 1e3, 32: 32 / 10_700 * 1e3, 64: 64 / 16_802 * 1e3}
SPIN_CALIBRATION_ITERS = 200_000


@dataclass
class BenchResult:
    dataset: str
    mode: str  # "sync" | "async"
    batch_size: int
    budget: int
    gpu_ms: float
    records: int = 0
    steps: int = 0  # batched engine steps
    request_steps: int = 0
    emitted_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    critical_seconds: float = 0.0
    engine_cpu_seconds: float = 0.0
    engine_cpu_nominal_seconds: float = 0.0
    wall_seconds: float = 0.0
    pipeline: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        steps = max(self.steps, 1)
        d.update(
            mat=self.emitted_tokens / max(self.request_steps, 1),
            acceptance_rate=self.accepted_tokens / max(self.drafted_tokens, 1),
            critical_us_per_step=self.critical_seconds / steps * 1e6,
            critical_us_per_token=self.critical_seconds / max(self.emitted_tokens, 1) * 1e6,
            critical_share_of_step=self.critical_seconds / (self.critical_seconds + steps * self.gpu_ms * 1e-3),
            engine_cpu_inflation=self.engine_cpu_seconds / max(self.engine_cpu_nominal_seconds, 1e-12),
        )
        return d


def _spin(iters: int) -> None:
    x = 0
    for i in range(iters):
        x += i


def calibrate_spin(ms: float) -> int:
    """Iterations of ``_spin`` that take ``ms`` on this machine (best of 3, no background threads)."""
    best = min(_timed(lambda: _spin(SPIN_CALIBRATION_ITERS)) for _ in range(3))
    return max(0, int(SPIN_CALIBRATION_ITERS * ms * 1e-3 / best))


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _accepted(tree, truth: Sequence[int], pos: int) -> int:  # type: ignore[no-untyped-def]
    return len(tree.match_length(truth[pos:pos + tree.max_depth + 1])) if len(tree) else 0


def run(drafter: Drafter, records: Sequence[TraceRecord], *, res: BenchResult, spin_iters: int,
        engine_ms: float) -> BenchResult:
    """Batched replay with the simulated engine step (see the module docstring)."""
    queue = list(reversed(records))
    active: list[tuple[str, list[int], list[int]]] = []  # (request id, truth, [pos])
    gpu_s = res.gpu_ms * 1e-3
    t_wall = time.perf_counter()
    while queue or active:
        t0 = time.perf_counter()
        while queue and len(active) < res.batch_size:
            rec = queue.pop()
            if not rec.response_ids.size:
                continue
            rid = f"{rec.id}#{res.records}"
            drafter.start(rid, rec.prompt_list())
            active.append((rid, rec.response_list(), [0]))
            res.records += 1
        trees = drafter.draft_batch([DraftRequest(rid, res.budget, False) for rid, _, _ in active])
        res.critical_seconds += time.perf_counter() - t0
        res.engine_cpu_seconds += _timed(lambda: _spin(spin_iters))
        res.engine_cpu_nominal_seconds += engine_ms * 1e-3
        time.sleep(gpu_s)
        t0 = time.perf_counter()
        still = []
        for (rid, truth, pos), tree in zip(active, trees):
            acc = _accepted(tree, truth, pos[0])
            emitted = truth[pos[0]:pos[0] + acc + 1]
            pos[0] += len(emitted)
            res.request_steps += 1
            res.drafted_tokens += len(tree)
            res.accepted_tokens += acc
            res.emitted_tokens += len(emitted)
            drafter.extend(rid, emitted)
            if pos[0] >= len(truth):
                drafter.stop(rid)
            else:
                still.append((rid, truth, pos))
        active = still
        res.steps += 1
        res.critical_seconds += time.perf_counter() - t0
    res.wall_seconds = time.perf_counter() - t_wall
    if isinstance(drafter, AsyncDrafter):
        res.pipeline = drafter.stats.as_dict()
    return res


def parse_gpu_ms(text: str) -> dict[int, float]:
    out = dict(DEFAULT_GPU_MS)
    for part in filter(None, text.split(",")):
        b, ms = part.split(":")
        out[int(b)] = float(ms)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from specdec.eval.loaders import load_traces
    from specdec.eval.results import results_path, write_results

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", default="code_alpaca,openhands_swebench")
    ap.add_argument("--limit", type=int, default=30, help="records per dataset (OpenHands: instances)")
    ap.add_argument("--drafter", default="suffix", help="drafter name or JSON spec")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--gpu-ms", default="", help="override step times, e.g. '1:5.0,64:7.4'")
    ap.add_argument("--engine-cpu-ms", type=float, default=0.5)
    ap.add_argument("--async-config", default="{}", help="JSON of AsyncConfig keys")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    spec = json.loads(args.drafter) if args.drafter.startswith(("{", "[")) else args.drafter
    acfg = AsyncConfig.from_dict(json.loads(args.async_config), where="--async-config: ")
    gpu_ms = parse_gpu_ms(args.gpu_ms)
    spin_iters = calibrate_spin(args.engine_cpu_ms)
    results = []
    for ds in filter(None, args.datasets.split(",")):
        name, records = load_traces(ds, limit=args.limit)
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            for mode in args.modes.split(","):
                inner = build_drafter(spec)
                d: Drafter = AsyncDrafter(inner, acfg) if mode == "async" else inner
                res = BenchResult(name, mode, bs, args.budget, gpu_ms.get(bs, gpu_ms[max(gpu_ms)]))
                try:
                    run(d, records, res=res, spin_iters=spin_iters, engine_ms=args.engine_cpu_ms)
                finally:
                    d.close()
                row = res.as_dict()
                results.append(row)
                print(f"{name:24s} B={bs:3d} {mode:5s} MAT={row['mat']:.3f} crit/step={row['critical_us_per_step']:8.1f}us "
                      f"share={row['critical_share_of_step']:.3f} hit={row['pipeline'].get('hit_rate', float('nan')):.3f} "
                      f"engine_infl={row['engine_cpu_inflation']:.2f}", flush=True)
    settings = {**vars(args), "gpu_ms_table": gpu_ms, "spin_iters": spin_iters, "async_config": acfg.to_dict()}
    path = args.out or results_path("bench_async_cpu", device="cpu")
    print(write_results(path, settings, results, device="cpu"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
