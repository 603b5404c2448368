"""The GPU gate's command line (``python -m benchmarks.gate``, ``bash scripts/gpu_gate.sh``): its options, their
defaults and the checks run on them before anything starts (one line each, naming the option, the value and the fix).
The serve checks' rate forms (``REQUEST_RATE``, ``CONCURRENCY_PREFIX``) are named here once, for ``gate_serve`` too,
which the command line checks before importing it. Never imports vLLM."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.gate_worker import METHODS, base_method, known_method

DEFAULT_METHODS = ("nospec", "suffix", "specdec", "specdec-before")
SETS = ("agentic", "chat", "code")
DEFAULT_MAX_WALL_S = 540.0  # a device call runs at most ~9.5 minutes
FINISH_MARGIN_S = 40.0  # kept from the budget: the last engine's kill grace, the results, the logs
WORK_DIR = Path("/tmp/specdec_gate")  # worker files and logs (kept while the machine is warm)
BEFORE_PATH = "/tmp/specdec-before"  # where gpu_gate.sh installs the base commit's tree
START_ENV = "GATE_T0"  # epoch seconds the call started (gpu_gate.sh): the budget counts its installs too
SHAPE = "llama-8b"
SERVE_CHECKS = ("tpot-53m", "tpot-8b", "start-8b-tp2")  # gate_serve's (named here: checked before it is imported)
REQUEST_RATE = 20  # the TPOT checks' default rate (the issue's)
CONCURRENCY_PREFIX = "c"  # a --serve-rate of cN: all at once with at most N in flight (`--max-concurrency N`)
# the servers of a TPOT check: nospec and specdec make its verdict; the others are references beside them (no
# speculation on vLLM's V1 model runner, the base commit, specdec in schedule mode whatever the target's size)
SERVE_METHODS = (
    "nospec",
    "specdec",
    "nospec-v1",
    "specdec-before",
    "specdec-schedule",
    "specdec-log",
    "specdec-nodraft",
)  # gate_serve.SERVE_SPECS's keys (tests/test_gate_flow.py holds them equal)


def in_flight(rate: str) -> int | None:
    """N of a ``cN`` rate (at most N requests in flight), None for requests per second or ``inf``; ValueError for a
    ``c`` without a whole number."""
    return int(rate[len(CONCURRENCY_PREFIX) :]) if rate.startswith(CONCURRENCY_PREFIX) else None


def serve_rates(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """``--serve-rate``: positive numbers of requests per second, ``inf`` (all at once), or ``cN`` (all at once with
    at most N in flight: `vllm bench serve --max-concurrency N`, N clients keeping a loaded server busy)."""
    rates = list(dict.fromkeys(r for r in (text or str(REQUEST_RATE)).split(",") if r))
    for r in rates:
        try:
            n = in_flight(r)
            ok = r == "inf" or (n > 0 if n is not None else float(r) > 0)
        except ValueError:
            ok = False
        if not ok:
            ap.error(
                f"--serve-rate: {r!r} is not a rate; give requests per second (> 0), inf or c<clients> like c100, "
                "comma-separated"
            )
    return rates


def parser(description: str = "") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--part",
        default="cells",
        choices=("cells", "serve", "prepare"),
        help="prepare: only build the inflated model (e.g. in the staging call, so the gate's calls keep their time)",
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine (--part cells)")
    ap.add_argument(
        "--methods", default="", help=f"comma-separated, of {', '.join(METHODS)} (default: {','.join(DEFAULT_METHODS)})"
    )
    ap.add_argument("--sets", default="", help=f"comma-separated, of {', '.join(SETS)} (default: the inputs' sets)")
    ap.add_argument("--checks", default="", help="--part serve: comma-separated checks (default: all)")
    ap.add_argument(
        "--serve-methods",
        default="nospec,specdec",
        help=f"--part serve: the servers of a TPOT check, of {', '.join(SERVE_METHODS)} (nospec and specdec always)",
    )
    ap.add_argument(
        "--serve-swap",
        action="store_true",
        help="--part serve: specdec's server on the first GPU and no speculation's on the second (and specdec measured "
        "first): a call each way shows what the placement does to the ratio",
    )
    ap.add_argument(
        "--serve-rate",
        default="",
        help=f"--part serve: the TPOT checks' request rates, req/s, inf or c<N> (all at once, at most N in flight), "
        f"comma-separated (default {REQUEST_RATE}, the issue's): each server runs each in turn; another rate's check "
        "is recorded as <check>@<rate>",
    )
    ap.add_argument(
        "--before-round",
        action="store_true",
        help="--part serve: serve nospec and specdec-before only, the before's round of a before/after whose "
        "candidate round ran in an earlier call (one 8B server pair fits a call, three do not); merge the two "
        "files with gate_report, which joins their servers",
    )
    ap.add_argument("--max-wall-s", type=float, default=DEFAULT_MAX_WALL_S, help="budget of the whole call")
    ap.add_argument("--inputs", default="device_inputs/gate_inputs.json", help="from benchmarks.gate_prompts")
    ap.add_argument("--model", default="", help="source model folder (default: $SPECDEC_MODELS/code-target-53m)")
    ap.add_argument("--shape", default=SHAPE, help="inflate the model to this shape ('' = serve it as it is)")
    ap.add_argument("--before-path", default=BEFORE_PATH, help="the base commit's installed tree")
    ap.add_argument("--reference", default="", help="a gate results JSON whose nospec engine is the reference")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all nvidia-smi lists)")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "eval/results"))
    ap.add_argument("--work-dir", default=str(WORK_DIR), help="worker files and engine logs (kept between calls)")
    ap.add_argument("--fake", action="store_true", help="dry run on the CPU: gate_fake engines, fake servers")
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Unknown methods or sets, or a before engine without its tree: one line, before anything starts."""
    explicit = bool(args.methods)
    args.methods = [m for m in (args.methods or ",".join(DEFAULT_METHODS)).split(",") if m]
    sets_given = bool(args.sets)
    args.sets = [s for s in (args.sets or ",".join(SETS)).split(",") if s]
    for m in args.methods:
        if not known_method(m):
            ap.error(f"--methods: {m!r} is unknown; valid: {', '.join(METHODS)} (a second engine of one: <method>.2)")
    if len(set(args.methods)) < len(args.methods):
        ap.error(f"--methods: {','.join(args.methods)} names an engine twice; a second engine is <method>.2")
    for s in args.sets:
        if s not in SETS:
            ap.error(f"--sets: {s!r} is unknown; valid: {', '.join(SETS)}")
    args.checks = [c for c in (args.checks or ",".join(SERVE_CHECKS)).split(",") if c]
    for c in args.checks:
        if c not in SERVE_CHECKS:
            ap.error(f"--checks: {c!r} is unknown; valid: {', '.join(SERVE_CHECKS)}")
    wanted = [m for m in args.serve_methods.split(",") if m]
    for m in wanted:
        if m not in SERVE_METHODS:
            ap.error(f"--serve-methods: {m!r} is unknown; valid: {', '.join(SERVE_METHODS)}")
    pair = ["specdec", "nospec"] if args.serve_swap else ["nospec", "specdec"]  # the first round, GPU 0 first
    args.serve_methods = list(dict.fromkeys([*pair, *wanted]))  # in the order given after these
    args.serve_rates = serve_rates(ap, args.serve_rate)
    if args.before_round:
        if args.part != "serve" or wanted != ["nospec", "specdec"] or args.serve_swap:
            ap.error(
                "--before-round: for --part serve alone, without --serve-methods or --serve-swap (it serves nospec "
                "and specdec-before)"
            )
        args.serve_methods = ["nospec", "specdec-before"]
    has_before = (Path(args.before_path) / "specdec" / "__init__.py").exists()
    if args.part == "serve" and "specdec-before" in args.serve_methods and not has_before and not args.fake:
        ap.error(f"--serve-methods specdec-before: no base tree at {args.before_path} (gpu_gate.sh installs it)")
    befores = [m for m in args.methods if base_method(m) == "specdec-before"]
    if args.part == "cells" and befores and not has_before:
        if explicit:
            ap.error(
                f"--methods {befores[0]}: no installed base tree at {args.before_path}; export one with "
                "python -m benchmarks.gate_prompts --before-commit SHA (gpu_gate.sh installs it)"
            )
        print(f"gate: no base tree at {args.before_path}: {', '.join(befores)} left out", flush=True)
        args.methods = [m for m in args.methods if m not in befores]
    if args.part == "cells" and not Path(args.inputs).exists():
        ap.error(f"--inputs {args.inputs} not found: run python -m benchmarks.gate_prompts on the CPU first")
    if args.part == "cells":
        have = [s for s in SETS if s in json.loads(Path(args.inputs).read_text()).get("sets", {})]
        args.sets = args.sets if sets_given else have
        missing = [s for s in args.sets if s not in have]
        if missing or not args.sets:
            ap.error(
                f"--sets: {(missing or ['any'])[0]!r} is not in {args.inputs} (its sets: {', '.join(have) or 'none'}); "
                f"pass --sets {','.join(have)} or rebuild it with python -m benchmarks.gate_prompts"
            )
    args.t0 = float(os.environ.get(START_ENV) or time.time())
    args.deadline = args.t0 + args.max_wall_s - FINISH_MARGIN_S
