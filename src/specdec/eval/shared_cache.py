"""The prize of a suffix cache shared across data-parallel replicas, by trace replay (method: docs/shared-cache.md).

    python -m specdec.eval.shared_cache --data ../shared/data --limit 400 --save-results shared_cache

Records arrive in file order and are dealt to N replicas (conversation-sticky or round-robin); each replica has its own
suffix drafter, whose global trie gets its own finished responses at once and, with a shared cache, the other
replicas' ``--delay`` arrivals after they finished. MAT and acceptance per dataset, N, routing and cache; the net gain
charges a loopback TCP round trip per step (synchronous lookup) or the insertion time (asynchronous replication).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specdec.eval.records import TraceRecord
from specdec.eval.replay import replay

REPLICAS = (1, 2, 4, 8)
ROUTINGS = ("sticky", "round-robin")
DEFAULT_DELAY = 16  # arrivals before another replica's finished response reaches a replica (docs/shared-cache.md)
STEP_MS = 5.0  # verification step the lookup cost is charged against (cost model t(1), 8B shape, batch 1)
BAR_N, BAR_GAIN = 4, 0.05  # build a shared store only for >= 5% net MAT at N = 4 under sticky routing
PING_BYTES, PING_ROUNDS = 64, 2000


def route(i: int, rec: TraceRecord, n: int, routing: str) -> int:
    """The replica of arrival ``i``: by its conversation's SHA-1 (sticky) or ``i mod n`` (round-robin)."""
    if routing == "round-robin":
        return i % n
    key = (rec.group or rec.id).encode("utf-8")
    return int.from_bytes(hashlib.sha1(key).digest()[:8], "big") % n


@dataclass
class Cell:
    """Totals of one simulation (all replicas together)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    update_s: float = 0.0  # extend + stop time of the replicas' own requests
    insert_s: float = 0.0  # inserting other replicas' responses (a shared cache's extra work)

    def row(self) -> dict[str, Any]:
        return {
            "mat": self.emitted / self.steps if self.steps else 0.0,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "drafted_per_step": self.drafted / self.steps if self.steps else 0.0,
            "steps": self.steps,
            "emitted_tokens": self.emitted,
            "update_us_per_token": self.update_s * 1e6 / max(self.emitted, 1),
            "insert_us_per_step": self.insert_s * 1e6 / max(self.steps, 1),
        }


def simulate(
    records: Sequence[TraceRecord],
    make: Callable[[], Any],
    *,
    n: int,
    routing: str,
    delay: int | None,
    budget: int = 16,
) -> Cell:
    """Replay ``records`` on ``n`` replicas; ``delay`` None: one cache per replica, else a shared cache whose other
    replicas' responses arrive ``delay`` arrivals after they finished."""
    drafters = [make() for _ in range(n)]
    pending: deque[tuple[int, int, Sequence[int]]] = deque()  # (visible from arrival, origin replica, response)
    cell = Cell()
    for i, rec in enumerate(records):
        while pending and pending[0][0] <= i:
            _, origin, resp = pending.popleft()
            t0 = time.perf_counter()
            for k, d in enumerate(drafters):
                if k != origin:
                    d.cache_response(resp)
            cell.insert_s += time.perf_counter() - t0
        k = route(i, rec, n, routing)
        res = replay(drafters[k], [rec], budget=budget, tree=False)
        cell.steps += res.steps
        cell.drafted += res.drafted_tokens
        cell.accepted += res.accepted_tokens
        cell.emitted += res.emitted_tokens
        cell.update_s += res.update_seconds
        if delay is not None and n > 1 and rec.response_ids.size:
            pending.append((i + 1 + delay, k, rec.response_ids))
    return cell


def loopback_round_trip_us(rounds: int = PING_ROUNDS) -> float:
    """Median round trip of a PING_BYTES request and reply over a loopback TCP connection (a floor for any store)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(PING_BYTES):
                conn.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    times = []
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = b"x" * PING_BYTES
        for _ in range(rounds):
            t0 = time.perf_counter()
            c.sendall(payload)
            got = 0
            while got < PING_BYTES:
                got += len(c.recv(PING_BYTES))
            times.append(time.perf_counter() - t0)
    thread.join(timeout=5)
    server.close()
    return statistics.median(times) * 1e6


def dataset_rows(name: str, records: Sequence[TraceRecord], make: Callable[[], Any], delay: int) -> list[dict]:
    """Every cell of one dataset: N = 1 once, then per N > 1 and routing: own caches, shared (delay), shared (0)."""
    rows = [
        {
            "dataset": name,
            "n": 1,
            "routing": "-",
            "cache": "own",
            **simulate(records, make, n=1, routing="sticky", delay=None).row(),
        }
    ]
    for n in REPLICAS[1:]:
        for routing in ROUTINGS:
            for cache, d in (("own", None), (f"shared D={delay}", delay), ("shared D=0", 0)):
                cell = simulate(records, make, n=n, routing=routing, delay=d)
                rows.append({"dataset": name, "n": n, "routing": routing, "cache": cache, **cell.row()})
                print(f"[{name}] N={n} {routing} {cache}: MAT {rows[-1]['mat']:.3f}", file=sys.stderr, flush=True)
    return rows


def add_gains(rows: list[dict], rtt_us: float) -> None:
    """Each shared cell: its MAT over the same N and routing's own caches, and that gain net of the lookup costs."""
    own = {(r["dataset"], r["n"], r["routing"]): r["mat"] for r in rows if r["cache"] == "own"}
    t_us = STEP_MS * 1e3
    for r in rows:
        base = own[(r["dataset"], r["n"], r["routing"])]
        r["gain"] = r["mat"] / base - 1.0
        r["net_gain_sync"] = r["mat"] / base * t_us / (t_us + rtt_us) - 1.0 if r["cache"] != "own" else 0.0
        r["net_gain_async"] = (
            r["mat"] / base * t_us / (t_us + r["insert_us_per_step"]) - 1.0 if r["cache"] != "own" else 0.0
        )


def table(rows: Sequence[dict]) -> str:
    """Markdown: one line per cell."""
    head = (
        "| dataset | N | routing | cache | MAT | acceptance | drafted/step | gain | net (sync lookup) | net (async) |"
    )
    out = [head, "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        shared = r["cache"] != "own"
        gains = [f"{100 * r[k]:+.1f}%" if shared else "-" for k in ("gain", "net_gain_sync", "net_gain_async")]
        out.append(
            f"| {r['dataset']} | {r['n']} | {r['routing']} | {r['cache']} | {r['mat']:.3f} | "
            f"{r['acceptance_rate']:.3f} | {r['drafted_per_step']:.2f} | " + " | ".join(gains) + " |"
        )
    return "\n".join(out)


def verdict(rows: Sequence[dict], delay: int) -> dict[str, Any]:
    """Per dataset: the net gain at N = BAR_N, sticky, shared with the stated delay (the better of the two designs)."""
    cells = [r for r in rows if r["n"] == BAR_N and r["routing"] == "sticky" and r["cache"] == f"shared D={delay}"]
    per = {r["dataset"]: max(r["net_gain_sync"], r["net_gain_async"]) for r in cells}
    best = max(per.values(), default=0.0)
    return {
        "bar": f">= {BAR_GAIN:.0%} net MAT at N = {BAR_N}, sticky routing",
        "net_gain": per,
        "build": best >= BAR_GAIN,
    }


def main(argv: Sequence[str] | None = None) -> int:
    from specdec.drafters import build_drafter
    from specdec.eval.loaders import SHARED_TRACE_SETS, load_traces
    from specdec.eval.results import atomic_write_text, build_document, results_path

    p = argparse.ArgumentParser(prog="python -m specdec.eval.shared_cache", description=__doc__)
    p.add_argument("sets", nargs="*", help=f"trace sets (default: {' '.join(SHARED_TRACE_SETS)})")
    p.add_argument("--data", default=None, help="shared data folder")
    p.add_argument("--limit", type=int, default=400, help="first N records per set (default 400)")
    p.add_argument("--delay", type=int, default=DEFAULT_DELAY, help="arrivals before a response reaches other replicas")
    p.add_argument("--save-results", metavar="NAME", help="write eval/results/<date>_<device>_<NAME>.{json,md}")
    args = p.parse_args(argv)
    rtt = loopback_round_trip_us()
    rows: list[dict] = []
    for name in args.sets or list(SHARED_TRACE_SETS):
        _, records = load_traces(name, tokenizer=None, limit=args.limit, data=args.data)
        rows += dataset_rows(name, records, lambda: build_drafter("suffix"), args.delay)
    add_gains(rows, rtt)
    result = verdict(rows, args.delay)
    md = f"{table(rows)}\n\nloopback TCP round trip (median of {PING_ROUNDS}): {rtt:.1f} us; verdict: {result}\n"
    print(md)
    if args.save_results:
        path = results_path(args.save_results)
        settings = {"args": vars(args), "step_ms": STEP_MS, "loopback_rtt_us": rtt, "method": "docs/shared-cache.md"}
        doc = build_document(settings, rows, extra={"verdict": result})
        atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
        atomic_write_text(path.with_suffix(".md"), md)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
