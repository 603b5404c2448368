"""Serving benchmark with vLLM's own client: `vllm serve` (vLLM's default engine arguments plus only
``--speculative-config``) driven by `vllm bench serve` over the completions API, one server per method.

    python -m benchmarks.serve_bench prepare                                   # CPU: device_inputs/serve_prompts.json
    python -m benchmarks.serve_bench find-saturation --datasets code --out-dir $OUT        # GPU: R of no speculation
    python -m benchmarks.serve_bench run --methods nospec,specdec --datasets code,random \\
        --saturation-file sat.json --out-dir $OUT                                           # GPU: the table

Per method: start the server on loopback, wait for /health, warm it up on a slice of its own, then per dataset
and rate run `vllm bench serve` on a slice no earlier rate of that server used (``--fresh-server-per-rate``: a new
server for every rate), scrape /metrics before and after for vLLM's spec-decode counters, and stop the server with
SIGINT to its process group. Rates: ``0.25R,0.5R,0.75R,R,inf`` (``R`` from ``--saturation-rate``,
``--saturation-file`` or ``auto``: found first in the same call, for the datasets the file lacks) or plain numbers.
``--lanes N``: N methods at once, each on its own GPU and share of the cores (``method_lanes``).
``--time-budget-s`` stops starting new work in time to write results inside one device call. Writes
serve_bench-<tag>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import serve_inputs as inputs
from benchmarks.gpu_cores import PCI_ORDER, gpu_lane_cores, span
from benchmarks.serve_bench_client import BenchClient
from benchmarks.serve_bench_runs import (
    SATURATION_LADDER,
    SATURATION_SLICES,
    arrivals_capped,
    bench_once,
    find_saturation,
    parse_rates,
    saturation_rate,
    serving,
)
from benchmarks.serve_common import (
    HEALTH_TIMEOUT_S,
    VLLM_CLI_ENV,
    Budget,
    ServeError,
    Server,
    device_name,
    parse_methods,
    pinned,
    vllm_cli,
)
from benchmarks.serve_report import write_outputs
from specdec.eval.results import installed_versions

# this driver's public names; SATURATION_LADDER, SATURATION_SLICES and saturation_rate are re-exported for the
# tests that read them here
__all__ = [
    "SATURATION_LADDER",
    "SATURATION_SLICES",
    "Budget",
    "bench_once",
    "find_saturation",
    "load_saturation",
    "main",
    "parse_rates",
    "run",
    "run_method",
    "saturation_rate",
    "serving",
]


def _record(doc: dict[str, Any], method: str, dataset: str, label: str, rate: float | str, res: dict[str, Any]) -> None:
    doc["runs"].append({"method": method, "dataset": dataset, "rate_label": label, "rate": rate, **res})


def run_method(
    args: argparse.Namespace,
    method: str,
    doc: dict[str, Any],
    budget: Budget,
    *,
    server: Server | None = None,
) -> None:
    """Every dataset and rate of one method: one server (``server``, already warm, if given), or one per rate with
    --fresh-server-per-rate."""
    cells = []
    for d in args.datasets:
        try:
            rates = parse_rates(args.rates, doc["saturation"], d)
        except ServeError as exc:  # e.g. R not found for this dataset: its cells are left out, the others run
            doc["errors"].append({"method": method, "dataset": d, "error": str(exc)})
            continue
        cells += [(d, i, label, rate) for i, (label, rate) in enumerate(rates)]
    groups = [[c] for c in cells] if args.fresh_server_per_rate else [cells] if cells else []
    for group in groups:
        if budget.left() <= 0:
            doc["skipped"] += [f"{method}/{d}/{label}" for d, _, label, _ in group]
            continue
        with _reused(server) if server else serving(args, method, f"{group[0][0]}-{group[0][1]}") as srv:
            for dataset, i, label, rate in group:
                if budget.left() <= 0:
                    doc["skipped"].append(f"{method}/{dataset}/{label}")
                    continue
                _record(
                    doc,
                    method,
                    dataset,
                    label,
                    rate,
                    bench_once(
                        args,
                        srv,
                        dataset=dataset,
                        slice_index=i + 1,
                        rate=rate,
                        budget=budget,
                        num=arrivals_capped(args, rate),
                    ),
                )


def run(args: argparse.Namespace, *, find_only: bool) -> dict[str, Any]:
    """The saturation search and, unless ``find_only``, every method's runs; with vLLM's own CLI, one in-process
    `vllm bench serve` worker (serve_bench_client) makes the runs (but those of --lanes, each through its pinned
    CLI)."""
    in_process = not (args.vllm_cli or os.environ.get(VLLM_CLI_ENV))
    client = args.bench_client = BenchClient() if in_process else None
    try:
        doc = _run(args, find_only=find_only)
    finally:
        if client is not None:
            client.close()
    doc["settings"]["bench_in_process"] = in_process
    return doc


def _run(args: argparse.Namespace, *, find_only: bool) -> dict[str, Any]:
    budget = Budget(args.time_budget_s)
    doc: dict[str, Any] = {
        "command": sys.argv,
        "device": device_name(),
        "versions": installed_versions(),
        "runs": [],
        "errors": [],
        "skipped": [],
        "saturation": load_saturation(args),
        "settings": {k: v for k, v in vars(args).items() if k not in ("pools", "func", "bench_client")},
    }
    rest = argparse.Namespace(**vars(args))  # the methods still to run after the saturation search
    # auto with --saturation-file: the file's rates stand (an earlier run on the same kind of GPU), the search finds
    # the rest
    known = {} if find_only else {d: v for d, v in doc["saturation"].items() if "rate" in v}
    search = argparse.Namespace(**{**vars(args), "datasets": [d for d in args.datasets if d not in known]})
    if find_only or (args.saturation_rate == "auto" and search.datasets):
        with serving(args, "nospec", "saturation") as server:
            doc["saturation"] = {**known, **find_saturation(search, server, budget)}
            if not find_only and "nospec" in args.methods and not args.fresh_server_per_rate:
                # no speculation's rates on the server that found R (warm; the search used slices no rate uses)
                _run_lane(args, ["nospec"], doc, budget, server=server)
                rest.methods = [m for m in args.methods if m != "nospec"]
    if not find_only and rest.methods:
        lanes = method_lanes(rest)
        parts = [{"runs": [], "errors": [], "skipped": [], "saturation": doc["saturation"]} for _ in lanes]
        threads = [
            threading.Thread(target=_run_lane, args=(lane_args, methods, part, budget))
            for (lane_args, methods), part in zip(lanes, parts)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for part in parts:  # lane by lane: each lane's methods in their order
            for key in ("runs", "errors", "skipped"):
                doc[key] += part[key]
        doc["settings"]["lanes"] = [
            {
                "methods": methods,
                "gpu": (getattr(a, "lane_env", None) or {}).get("CUDA_VISIBLE_DEVICES"),
                "cli": a.vllm_cli,
            }
            for a, methods in lanes
        ]
    return doc


def _run_lane(
    args: argparse.Namespace,
    methods: list[str],
    doc: dict[str, Any],
    budget: Budget,
    *,
    server: Server | None = None,
) -> None:
    for method in methods:
        try:
            run_method(args, method, doc, budget, server=server)
        except ServeError as exc:  # a method that does not start (e.g. the hybrid): recorded, others go on
            doc["errors"].append({"method": method, "error": str(exc)})


@contextlib.contextmanager
def _reused(server: Server) -> Iterator[Server]:
    yield server  # its owner stops it


def method_lanes(args: argparse.Namespace) -> list[tuple[argparse.Namespace, list[str]]]:
    """The methods dealt to ``--lanes`` lanes run at once (lane i takes every n-th method from the i-th): each lane
    its own GPU (``CUDA_VISIBLE_DEVICES`` = i) and its share of this process's cores (``gpu_cores``: the GPU's NUMA
    node's where the host says, else an equal share), its servers and its `vllm bench serve` clients pinned to them
    (taskset). One lane: as before, this process's GPUs and cores."""
    n = max(1, min(int(getattr(args, "lanes", 1) or 1), len(args.methods)))
    if n == 1:
        return [(args, list(args.methods))]
    lanes, how = gpu_lane_cores(n, sorted(os.sched_getaffinity(0)))
    placed = "; ".join(f"GPU {i}: {span(c)}" for i, c in enumerate(lanes))
    print(f"serve_bench: lanes pinned to cores ({how}): {placed}")
    base = shlex.join(vllm_cli(args.vllm_cli))
    out = []
    for i in range(n):
        lane = argparse.Namespace(**vars(args))
        lane.vllm_cli = pinned(base, lanes[i])
        lane.lane_env = {"CUDA_VISIBLE_DEVICES": str(i), **PCI_ORDER}
        lane.bench_client = None  # a lane's runs go through its pinned CLI
        out.append((lane, list(args.methods[i::n])))
    return out


def load_saturation(args: argparse.Namespace) -> dict[str, Any]:
    if args.saturation_file:
        path = Path(args.saturation_file)
        try:
            sat = json.loads(path.read_text())["saturation"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ServeError(
                f"--saturation-file {path}: no saturation rates ({type(exc).__name__}); pass the JSON "
                "`serve_bench find-saturation` wrote"
            ) from None
        return {k: v if isinstance(v, dict) else {"rate": float(v)} for k, v in sat.items()}
    if args.saturation_rate not in ("", "auto"):
        try:
            return {d: {"rate": float(args.saturation_rate)} for d in args.datasets}
        except ValueError:
            raise ServeError(f"--saturation-rate {args.saturation_rate!r}: a number of requests/s or 'auto'") from None
    return {}


# --------------------------------------------------------------------------- CLI
def _common(ap: argparse.ArgumentParser) -> None:
    from specdec.paths import DRAFT_MODEL, TARGET_MODEL, model_path

    ap.add_argument("--prompts", default="device_inputs/serve_prompts.json", help="from `serve_bench prepare`")
    ap.add_argument("--model", default=str(model_path(TARGET_MODEL)))
    ap.add_argument(
        "--inflate",
        default="",
        help="serve the target inflated to this shape (e.g. llama-8b; "
        "specdec.eval.inflate_model: same outputs, an 8B forward pass), built once under /tmp",
    )
    ap.add_argument("--draft-model", default=str(model_path(DRAFT_MODEL)), help="for method 'hybrid'")
    ap.add_argument("--datasets", default="agentic,chat,code,random", type=lambda s: [x for x in s.split(",") if x])
    ap.add_argument(
        "--num-prompts", type=int, default=100, help="requests per rate (8 slices of it fit the 805-prompt chat pool)"
    )
    ap.add_argument(
        "--max-arrival-s", type=float, default=60.0, help="a finite rate sends at most this many seconds of requests"
    )
    ap.add_argument("--warmup-prompts", type=int, default=32, help="all-at-once requests before the first rate")
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="of the pools' requests (random: the server's default)"
    )
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--server-args", default="", type=lambda s: s.split(), help="extra `vllm serve` arguments")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--health-timeout-s", type=float, default=HEALTH_TIMEOUT_S)
    ap.add_argument("--time-budget-s", type=float, default=540.0, help="start no new work past this")
    ap.add_argument("--vllm-cli", default="", help="the vLLM command (default: this Python's vLLM CLI module)")
    ap.add_argument("--out-dir", default="eval/results/serve")
    ap.add_argument("--tag", default="", help="file name suffix (default: the methods)")
    ap.add_argument(
        "--saturation-rate",
        default="",
        help="R in requests/s, or 'auto' (found first, same call; with --saturation-file: for datasets it lacks)",
    )
    ap.add_argument("--saturation-file", default="", help="JSON from `serve_bench find-saturation`")
    ap.add_argument("--saturation-tol", type=float, default=0.05)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="write the prompt pools (CPU side)")
    prep.add_argument("--out", default="device_inputs/serve_prompts.json")
    prep.add_argument("--per-pool", type=int, default=1000)
    prep.add_argument("--max-code-tokens", type=int, default=1024)
    prep.add_argument("--max-agentic-tokens", type=int, default=1024)
    sat = sub.add_parser("find-saturation", help="the saturation rate R of no speculation, per dataset")
    _common(sat)
    run_p = sub.add_parser("run", help="methods x datasets x rates")
    _common(run_p)
    run_p.add_argument("--methods", default="nospec,suffix,specdec")
    run_p.add_argument("--rates", default="0.25R,0.5R,0.75R,R,inf")
    run_p.add_argument("--fresh-server-per-rate", action="store_true")
    run_p.add_argument(
        "--lanes",
        type=int,
        default=1,
        help="methods run at once, each lane on its own GPU and share of the cores (lane i: every n-th method)",
    )
    return ap


def _prepare(args: argparse.Namespace) -> int:
    settings = {
        "per_pool": args.per_pool,
        "max_code_tokens": args.max_code_tokens,
        "max_agentic_tokens": args.max_agentic_tokens,
        "output_tokens": f"recorded responses, within [{inputs.MIN_OUTPUT_TOKENS}, {inputs.MAX_OUTPUT_TOKENS}]",
    }
    pools = inputs.build_pools(
        per_pool=args.per_pool, max_code_tokens=args.max_code_tokens, max_agentic_tokens=args.max_agentic_tokens
    )
    size = inputs.write_pools(Path(args.out), pools, settings)
    print(", ".join(f"{k}: {len(v)}" for k, v in pools.items()) + f"; wrote {args.out} ({size / 1e6:.2f} MB)")
    return 0


def _validate(args: argparse.Namespace) -> None:
    """Every input checked before a server starts."""
    args.methods = parse_methods(args.methods) if hasattr(args, "methods") else []
    if "hybrid" in args.methods and not Path(args.draft_model).is_dir():
        raise ServeError(f"--draft-model {args.draft_model}: no such folder (method 'hybrid' needs the draft model)")
    needs_pools = [d for d in args.datasets if d != inputs.RANDOM_DATASET]
    args.pools = inputs.load_pools(Path(args.prompts)) if needs_pools else None
    inputs.check_datasets(args.datasets, args.pools, Path(args.prompts))
    if args.cmd == "run" and not (args.saturation_rate or args.saturation_file) and "R" in args.rates:
        raise ServeError(
            f"--rates {args.rates} are relative to R: pass --saturation-rate R, --saturation-rate auto "
            "or --saturation-file"
        )
    load_saturation(args)
    if args.cmd == "run":  # the syntax of every rate, R taken as 1 until it is known
        for d in args.datasets:
            parse_rates(args.rates, {d: {"rate": 1.0}}, d)
    real_cli = not (args.vllm_cli or os.environ.get(VLLM_CLI_ENV))
    if needs_pools and real_cli and importlib.util.find_spec("pandas") is None:
        raise ServeError(
            f"datasets {needs_pools} need pandas (vLLM's custom dataset reads JSONL with it): build the "
            "bundle with --extra-req benchmarks/requirements-serve.txt, or use --datasets random"
        )


def _inflate(args: argparse.Namespace) -> None:
    if args.inflate:
        from specdec.eval.inflate_model import inflate_in_subprocess  # (imports torch: only when asked)

        args.model = inflate_in_subprocess(args.model, args.inflate)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "prepare":
            return _prepare(args)
        _validate(args)
        _inflate(args)
        doc = run(args, find_only=args.cmd == "find-saturation")
    except ServeError as exc:
        print(f"serve_bench: {exc}", file=sys.stderr)
        return 2
    stem = "saturation" if args.cmd == "find-saturation" else f"serve_bench-{args.tag or '-'.join(args.methods)}"
    paths = write_outputs(doc, Path(args.out_dir), stem)
    print(
        json.dumps(
            {
                "outputs": paths,
                "runs": len(doc["runs"]),
                "errors": doc["errors"],
                "skipped": doc["skipped"],
                "saturation": doc["saturation"],
            },
            indent=1,
        )
    )
    failed = sum(r["bench"].get("failed", 0) for r in doc["runs"])
    return 1 if doc["errors"] or failed else 0


if __name__ == "__main__":
    sys.exit(main())
