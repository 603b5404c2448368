"""CPU cost of starting a request in the native suffix core (building its trie over the prompt).

In vLLM a request's first decode step starts it from its whole context on the engine thread, so on long agentic
prompts the prefill steps spend most of their drafting time here (9-19 ms per step at batch 64 on an H200 host).
Starts ``--requests`` prompts (the last ``--context`` tokens of each) into a fresh engine, ``--repeats`` times,
and reports the median ms per start and the per-request trie size. Usage::

    python -m benchmarks.bench_suffix_start openhands_swebench --context 1536 --requests 40 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time

DEFAULT_DEPTH = 64  # the suffix drafter's default max_depth
GLOBAL_REQUESTS, GLOBAL_TOKENS = 10_000, 1 << 22  # global-cache bounds of the engine (unused by starts)


def time_starts(prompts: list[list[int]], *, depth: int, repeats: int) -> dict[str, float]:
    """Median / min ms per ``Engine.start`` over ``repeats`` fresh engines, and the median local trie size."""
    from specdec.drafters._suffix_native import Engine

    per_start = []
    engine = None
    for _ in range(repeats):
        engine = Engine(depth, GLOBAL_REQUESTS, GLOBAL_TOKENS)
        t0 = time.perf_counter()
        for rid, prompt in enumerate(prompts):
            engine.start(rid, prompt)
        per_start.append(1e3 * (time.perf_counter() - t0) / len(prompts))
    assert engine is not None
    return {
        "ms_per_start_median": statistics.median(per_start),
        "ms_per_start_min": min(per_start),
        "runs_ms": per_start,
        "local_nodes_median": statistics.median(engine.local_nodes(r) for r in range(len(prompts))),
    }


def main(argv: list[str] | None = None) -> int:
    from specdec.eval.loaders import load_traces
    from specdec.eval.results import results_path, write_results

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", nargs="?", default="openhands_swebench")
    ap.add_argument("--context", type=int, default=1536, help="tokens per prompt (its last ones; shorter skipped)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--depth", type=int, default=DEFAULT_DEPTH)
    ap.add_argument("--name", default="bench_suffix_start")
    args = ap.parse_args(argv)
    name, records = load_traces(args.source, limit=args.requests * 4)
    prompts = [list(r.prompt_ids)[-args.context :] for r in records if len(r.prompt_ids) >= args.context]
    prompts = prompts[: args.requests]
    if not prompts:
        raise SystemExit(f"{name}: no prompt has --context {args.context} tokens; use a smaller --context")
    res = {
        "dataset": name,
        "prompts": len(prompts),
        "context": args.context,
        "depth": args.depth,
        **time_starts(prompts, depth=args.depth, repeats=args.repeats),
    }
    print(
        f"{name}: {res['ms_per_start_median']:.3f} ms per start of a {args.context}-token context "
        f"(min {res['ms_per_start_min']:.3f}; {res['local_nodes_median']:.0f} trie nodes)"
    )
    path = write_results(results_path(args.name), vars(args), [res])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
