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

    python -m benchmarks.bench_async_cpu --datasets code_alpaca,openhands_swebench --limit 30
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from specdec.drafters.base import Drafter, DraftRequest
from specdec.drafters.registry import build_drafter
from specdec.eval.records import TraceRecord
from specdec.pipeline import AsyncConfig, AsyncDrafter

# no-spec step time (ms) of the shared target on an H200 = batch / measured tok/s (issue 5 peer table)
DEFAULT_GPU_MS = {1: 1 / 501 * 1e3, 8: 8 / 3582 * 1e3, 32: 32 / 10_700 * 1e3, 64: 64 / 16_802 * 1e3}
SPIN_CALIBRATION_ITERS = 200_000
# AsyncConfig overrides per mode; "-gate" modes wait for open_gate(), which run() calls after the engine CPU work
MODES = {"sync": {}, "async": {}, "async-empty": {"on_miss": "empty"}, "async-budget": {"on_miss": "budget"},
         "async-gate": {"gate_ms": 20.0}, "async-budget-gate": {"on_miss": "budget", "gate_ms": 20.0}}


@dataclass
class BenchResult:
    dataset: str
    mode: str  # a MODES key
    batch_size: int
    budget: int
    gpu_ms: float
    records: int = 0
    steps: int = 0  # batched engine steps
    request_steps: int = 0
    emitted_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    critical_seconds: float = 0.0  # start + extend + draft_batch + stop, all on the engine thread
    start_seconds: float = 0.0  # part of it in start() (prompt ingestion; vLLM pays it at prefill)
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
            step_critical_us_per_step=(self.critical_seconds - self.start_seconds) / steps * 1e6,
            step_critical_share=(self.critical_seconds - self.start_seconds)
            / (self.critical_seconds - self.start_seconds + steps * self.gpu_ms * 1e-3),
            # model estimate: emitted / (engine-thread drafting time + steps x no-spec GPU step time)
            est_tokens_per_s=self.emitted_tokens
            / (self.critical_seconds - self.start_seconds + steps * self.gpu_ms * 1e-3),
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
    """Iterations of ``_spin`` that take ``ms`` on this machine (median of 5 at the target size, twice refined)."""
    iters = SPIN_CALIBRATION_ITERS
    for _ in range(3):
        took = sorted(_timed(lambda: _spin(iters)) for _ in range(5))[2]
        iters = max(1, int(iters * ms * 1e-3 / max(took, 1e-9)))
    return iters


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
            t_start = time.perf_counter()
            drafter.start(rid, rec.prompt_list())
            res.start_seconds += time.perf_counter() - t_start
            active.append((rid, rec.response_list(), [0]))
            res.records += 1
        trees = drafter.draft_batch([DraftRequest(rid, res.budget, False) for rid, _, _ in active])
        res.critical_seconds += time.perf_counter() - t0
        res.engine_cpu_seconds += _timed(lambda: _spin(spin_iters))
        res.engine_cpu_nominal_seconds += engine_ms * 1e-3
        if isinstance(drafter, AsyncDrafter):
            drafter.open_gate()  # the GPU step is launched (as the vLLM runner patch would signal)
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


def suffix_with_lookahead(spec: Any) -> Drafter:
    """Benchmark-only stand-in: the suffix drafter on its python reference backend plus a read-only
    ``draft_after`` (match fronts advanced over the extra tokens, nothing inserted), to measure what hedging
    gains once ``drafters/suffix.py`` provides ``draft_after`` natively. Same drafts as the native backend."""
    from specdec.drafters.suffix import SuffixDrafter
    from specdec.drafters.suffix_ref import _empty, best_draft
    from specdec.tree import TokenTree

    opts = dict(spec) if isinstance(spec, dict) else {}
    opts.pop("name", None)
    opts["backend"] = "python"

    class Lookahead(SuffixDrafter):
        def draft_after(self, request_id, extra_tokens, budget, *, tree=False):  # type: ignore[no-untyped-def]
            rid = self._ids.get(request_id)
            eng = self.engine
            r = eng.requests.get(rid) if rid is not None else None
            if r is None or budget <= 0:
                return TokenTree.empty()
            c = self.config
            lf = r.local_front
            eng._refresh(r)
            gf = r.global_front
            for t in extra_tokens:
                lf = r.local.step_match(lf, int(t))
                gf = eng.global_trie.step_match(gf, int(t))
            params = (budget, bool(tree), c.max_spec_factor, c.max_spec_offset, c.min_token_prob)
            best = _empty()
            if c.use_local:
                best = best_draft(r.local, lf, params, 0, best)
            if c.use_global:
                best = best_draft(eng.global_trie, gf, params, 1, best)
            if not best["tokens"]:
                return TokenTree.empty()
            return TokenTree(np.asarray(best["tokens"], np.int64), np.asarray(best["parents"], np.int32),
                             np.asarray(best["probs"], np.float32))

    return Lookahead(SuffixDrafter.Config.from_dict(opts))


# ---------------------------------------------------------------------- micro-benchmarks (threads vs process)
def _busy(stop: Any, unit_us: float, yield_between: bool) -> None:
    while not stop.is_set():
        end = time.perf_counter() + unit_us * 1e-6
        while time.perf_counter() < end:
            pass
        if yield_between:
            time.sleep(0)


def _echo(conn: Any) -> None:
    while (msg := conn.recv()) is not None:
        conn.send(msg)


def micro(n: int = 300) -> dict[str, float]:
    """GIL hand-back delay to a thread waking from a 2 ms wait (a GPU sync) while a worker thread is busy,
    and the round trip of 8 drafts x 16 tokens through a thread queue vs a process pipe (median us)."""
    import multiprocessing as mp
    import queue
    import sys
    import threading

    def wake_delay(interval: float, unit_us: float, yield_between: bool) -> float:
        sys.setswitchinterval(interval)
        stop = threading.Event()
        th = threading.Thread(target=_busy, args=(stop, unit_us, yield_between), daemon=True)
        if unit_us:
            th.start()
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            time.sleep(0.002)
            lat.append(time.perf_counter() - t0 - 0.002)
        stop.set()
        if unit_us:
            th.join()
        sys.setswitchinterval(0.005)
        return float(np.median(lat) * 1e6)

    out = {"wake_delay_us_no_worker": wake_delay(0.005, 0, False),
           "wake_delay_us_busy_worker_5ms_interval": wake_delay(0.005, 10_000, False),
           "wake_delay_us_yielding_worker_0.2ms_interval": wake_delay(0.0002, 100, True)}
    msg = [(f"r{i}", list(range(16))) for i in range(8)]
    a, b = mp.Pipe()
    proc = mp.Process(target=_echo, args=(b,), daemon=True)
    proc.start()
    out["process_pipe_roundtrip_us"] = _roundtrip_us(a.send, a.recv, msg, reps=n * 5)
    a.send(None)
    proc.join()
    q_in: Any = queue.Queue()
    q_out: Any = queue.Queue()
    th = threading.Thread(target=lambda: [q_out.put(m) for m in iter(q_in.get, None)], daemon=True)
    th.start()
    out["thread_queue_roundtrip_us"] = _roundtrip_us(q_in.put, q_out.get, msg, reps=n * 5)
    q_in.put(None)
    th.join()
    return out


def _roundtrip_us(send: Callable[[Any], Any], recv: Callable[[], Any], msg: Any, *, reps: int) -> float:
    """Median µs of ``send(msg)`` followed by ``recv()`` to an echoing peer."""
    rt = []
    for _ in range(reps):
        t0 = time.perf_counter()
        send(msg)
        recv()
        rt.append(time.perf_counter() - t0)
    return float(np.median(rt) * 1e6)


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
    ap.add_argument("--modes", default="sync,async,async-budget,async-empty")
    ap.add_argument("--lookahead-ref", action="store_true",
                    help="suffix on its python backend + a read-only draft_after (hit-rate study; slower drafting)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per (batch, mode); modes interleaved")
    ap.add_argument("--name", default="bench_async_cpu", help="results file name part")
    ap.add_argument("--out", default=None, help="explicit results path (default eval/results/<date>_<device>_<name>.json)")
    ap.add_argument("--micro", action="store_true", help="only the thread/process micro-benchmarks")
    args = ap.parse_args(argv)
    if args.micro:
        res = micro()
        for k, v in res.items():
            print(f"{k:48s} {v:10.1f}")
        print(write_results(args.out or results_path(args.name + "_micro", device="cpu"), vars(args), [res],
                            device="cpu"))
        return 0
    spec = json.loads(args.drafter) if args.drafter.startswith(("{", "[")) else args.drafter
    acfg = AsyncConfig.from_dict(json.loads(args.async_config), where="--async-config: ")
    gpu_ms = parse_gpu_ms(args.gpu_ms)
    spin_iters = calibrate_spin(args.engine_cpu_ms)
    results = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"--modes: {mode!r} is unknown; valid: {', '.join(MODES)}")
    for ds in filter(None, args.datasets.split(",")):
        name, records = load_traces(ds, limit=args.limit)
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            for rep in range(args.repeats):  # modes interleaved, so machine noise hits them alike
                for mode in args.modes.split(","):
                    row = _one(spec, records, name, mode, bs, args, acfg, gpu_ms, spin_iters)
                    row["repeat"] = rep
                    results.append(row)
                    print(f"{name:20s} B={bs:3d} {mode:11s} MAT={row['mat']:.3f} "
                          f"crit/step={row['step_critical_us_per_step']:8.1f}us share={row['step_critical_share']:.3f} "
                          f"tok/s~{row['est_tokens_per_s']:.0f} hit={row['pipeline'].get('hit_rate', float('nan')):.3f} "
                          f"engine_infl={row['engine_cpu_inflation']:.2f}", flush=True)
    summary = summarize(results)
    for line in summary:
        print(line)
    settings = {**vars(args), "gpu_ms_table": gpu_ms, "spin_iters": spin_iters, "async_config": acfg.to_dict()}
    path = args.out or results_path(args.name, device="cpu")
    print(write_results(path, settings, results, device="cpu", extra={"summary": summary}))
    return 0


def _one(spec: Any, records: Sequence[TraceRecord], name: str, mode: str, bs: int, args: Any,
         acfg: AsyncConfig, gpu_ms: dict[int, float], spin_iters: int) -> dict[str, Any]:
    inner = suffix_with_lookahead(spec) if args.lookahead_ref else build_drafter(spec)
    d: Drafter = inner if mode == "sync" else AsyncDrafter(inner, acfg.replace(**MODES[mode]))
    res = BenchResult(name, mode, bs, args.budget, gpu_ms.get(bs, gpu_ms[max(gpu_ms)]))
    try:
        run(d, records, res=res, spin_iters=spin_iters, engine_ms=args.engine_cpu_ms)
    finally:
        d.close()
    return res.as_dict()


def summarize(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Median over repeats per (dataset, batch, mode), with ratios to sync: one line each."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["batch_size"], r["mode"]), []).append(r)
    med = {k: {f: float(np.median([r[f] for r in v])) for f in
               ("mat", "step_critical_us_per_step", "step_critical_share", "est_tokens_per_s", "engine_cpu_inflation")}
           | {"hit_rate": float(np.median([r["pipeline"].get("hit_rate", np.nan) for r in v]))}
           for k, v in groups.items()}
    lines = ["dataset              B   mode         MAT    crit_us/step  share   est_tok/s (x sync)  hit"]
    for (ds, bs, mode), m in med.items():
        base = med.get((ds, bs, "sync"))
        ratio = m["est_tokens_per_s"] / base["est_tokens_per_s"] if base else float("nan")
        lines.append(f"{ds:20s} {bs:3d} {mode:11s} {m['mat']:.3f}  {m['step_critical_us_per_step']:10.1f}  "
                     f"{m['step_critical_share']:.3f}  {m['est_tokens_per_s']:8.0f} ({ratio:.2f}x)  {m['hit_rate']:.3f}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
