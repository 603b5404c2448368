"""Memory of the suffix drafter's global tree over a whole trace replay, and that eviction bounds it.

Replays a trace set (default: all of OpenHands) with ``SuffixDrafter`` under several global-cache bounds
(``max_cached_tokens``), sampling the global tree (live nodes, bytes, cached responses/tokens) after every
request; reports the final and peak values, and the MAT (eviction costs acceptance). Arctic's global
tree size (its own ``estimate_memory``) after the same replay is added when it is installed. Usage::

    python -m benchmarks.bench_suffix_memory openhands_swebench --limit 400 --bounds 0,20000,100000
"""

from __future__ import annotations

import argparse
from typing import Any

from specdec.drafters.suffix import SuffixDrafter

UNBOUNDED = 0  # --bounds value meaning "the default bound" (10M tokens)


class SampledSuffix(SuffixDrafter):
    """SuffixDrafter that samples its global-tree stats after every finished request."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.peak = {"nodes": 0, "bytes": 0, "cached_tokens": 0, "cached_requests": 0}

    def stop(self, request_id: str) -> None:
        super().stop(request_id)
        for k, v in self.global_stats().items():
            self.peak[k] = max(self.peak[k], v)


def main(argv: list[str] | None = None) -> int:
    from specdec.eval.loaders import load_traces
    from specdec.eval.replay import replay
    from specdec.eval.results import results_path, write_results

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", nargs="?", default="openhands_swebench")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument(
        "--bounds",
        default="0,20000,100000",
        help="comma-separated max_cached_tokens values (0: the default 10M, i.e. unbounded here)",
    )
    ap.add_argument("--arctic", action="store_true", help="also replay Arctic (depth 24) and size its tree")
    ap.add_argument("--save-results", default="suffix_memory")
    args = ap.parse_args(argv)
    name, records = load_traces(args.source, limit=args.limit)
    rows = []
    for bound in [int(b) for b in args.bounds.split(",")]:
        kw = {"max_cached_tokens": bound} if bound != UNBOUNDED else {}
        d = SampledSuffix(**kw)
        res = replay(d, records, budget=args.budget, tree=False)
        row = {
            "dataset": name,
            "drafter": "suffix",
            "max_cached_tokens": d.config.max_cached_tokens,
            "mat": res.mat,
            "final": d.global_stats(),
            "peak": dict(d.peak),
            "bytes_per_cached_token": d.global_stats()["bytes"] / max(d.global_stats()["cached_tokens"], 1),
        }
        rows.append(row)
        print(
            f"{name} suffix max_cached_tokens={row['max_cached_tokens']:>10,}: MAT {res.mat:.3f}  final "
            f"{row['final']}  peak {row['peak']}",
            flush=True,
        )
    if args.arctic:
        from specdec.eval.peers import ArcticDrafter

        a = ArcticDrafter()
        res = replay(a, records, budget=args.budget, tree=False)
        rows.append(
            {
                "dataset": name,
                "drafter": "arctic",
                "mat": res.mat,
                "final": {"bytes": a.memory_bytes(), "cached_requests": len(a.cache.cached_requests)},
            }
        )
        print(f"{name} arctic: MAT {res.mat:.3f}  global tree {rows[-1]['final']}", flush=True)
    path = results_path(args.save_results)
    write_results(path, vars(args), rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
