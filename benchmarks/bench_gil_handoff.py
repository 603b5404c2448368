"""How long a thread waits for the GIL after a GIL-releasing wait ends, while another Python thread is busy.

The engine thread's critical-path waits (schedule mode: the step's sampled tokens, ``Event.synchronize``; thread
mode: ``lane_collect``) release the GIL. vLLM's process has other Python threads (the engine core's output thread
serialising outputs); if one of them runs when the wait ends, CPython returns the GIL only after its switch
interval. This benchmark isolates that: the main thread sleeps ``--wait-ms`` (a GIL-releasing wait that ends at a
known time) and measures how late it resumes, with no other thread, with a busy Python thread, and with a busy
thread while ``core.gil.quick_reacquire`` lowers the switch interval around the wait.

    python -m benchmarks.bench_gil_handoff --steps 300
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from typing import Any

from specdec.eval.results import results_path, write_results
from specdec.vllm_plugin.core.gil import QUICK_SWITCH_S, quick_reacquire

CONFIGS = ("alone", "busy_thread", "busy_thread_quick")
BUSY_CHUNK = 200  # additions per inner loop of the busy thread (pure Python: it holds the GIL while it runs)


def busy(stop: threading.Event) -> None:
    """A Python thread that never blocks (stands for vLLM's output thread at work)."""
    x = 0
    while not stop.is_set():
        for i in range(BUSY_CHUNK):
            x += i


def run(config: str, *, steps: int, wait_ms: float) -> dict[str, Any]:
    """``steps`` waits of ``wait_ms``; per wait, how late (ms) the thread holds the GIL again."""
    stop = threading.Event()
    other = threading.Thread(target=busy, args=(stop,), daemon=True) if config != "alone" else None
    if other is not None:
        other.start()
    quick = quick_reacquire if config == "busy_thread_quick" else contextlib.nullcontext
    late: list[float] = []
    try:
        for _ in range(steps):
            due = time.perf_counter() + wait_ms / 1e3
            with quick():
                time.sleep(wait_ms / 1e3)
            late.append(1e3 * (time.perf_counter() - due))
    finally:
        stop.set()
        if other is not None:
            other.join()
    late.sort()
    return {
        "config": config,
        "steps": steps,
        "wait_ms": wait_ms,
        "late_p50_ms": statistics.median(late),
        "late_p99_ms": late[int(0.99 * (len(late) - 1))],
        "late_mean_ms": statistics.fmean(late),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--wait-ms", type=float, default=2.0, help="the GIL-releasing wait (the GPU's remaining step)")
    ap.add_argument("--name", default="bench_gil_handoff")
    args = ap.parse_args(argv)
    rows = [run(c, steps=args.steps, wait_ms=args.wait_ms) for c in CONFIGS]
    print(f"| config | late p50 ms | late p99 ms | mean ms |  (quick switch interval {QUICK_SWITCH_S * 1e3} ms)")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['config']} | {r['late_p50_ms']:.3f} | {r['late_p99_ms']:.3f} | {r['late_mean_ms']:.3f} |")
    print("wrote", write_results(results_path(args.name, device="cpu"), vars(args), rows, device="cpu"))


if __name__ == "__main__":
    main()
