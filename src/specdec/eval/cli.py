"""``specdec-eval``: measure drafters' acceptance on traces (replay), on live models (live), over settings (sweep).

specdec-eval                                   # built-in workload, suffix + ngram, table + JSON + PNGs
specdec-eval --data ../shared/data             # the same on every shared trace set
specdec-eval replay traces.jsonl --drafter suffix ngram --budget 8 16
specdec-eval sweep --data ../shared/data --drafter suffix --grid suffix.max_depth=16,32,64
specdec-eval live humaneval --limit 80 --drafter model --max-new-tokens 128
specdec-eval curve --data ../shared/data --limit 400  # MAT against drafted tokens per step, suffix vs arctic
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from specdec.config import ConfigError
from specdec.eval.common import EvalError
from specdec.eval.costmodel import DEFAULT_VERIFY_MS, DEFAULT_VERIFY_MS_PER_TOKEN
from specdec.eval.flags import EXIT_USAGE, OneLineParser
from specdec.eval.settings import DEFAULT_BUDGET, DEFAULT_DRAFTERS

DEFAULT_OUT = "specdec-eval-out"
SUBCOMMANDS = ("replay", "sweep", "live", "curve")
logger = logging.getLogger("specdec.eval")


# ------------------------------------------------------------------------------------------- parser
def _add_drafter_args(p: argparse.ArgumentParser, defaults: Sequence[str] = DEFAULT_DRAFTERS) -> None:
    g = p.add_argument_group("drafters")
    g.add_argument(
        "--drafter",
        nargs="+",
        metavar="NAME",
        default=None,
        help="drafters to evaluate, each a name (suffix, ngram, model, arctic, vllm-ngram) or names "
        "joined by '+' for a composition choosing the best draft per step (suffix+model). "
        f"Default: {' '.join(defaults)}"
        + (" (a default one that cannot be imported is skipped with a warning)" if len(defaults) > 1 else ""),
    )
    g.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME.KEY=VALUE",
        help="a drafter option, e.g. suffix.max_depth=32 or model.path=../shared/models/code-draft-7m "
        "(VALUE parsed as YAML; repeatable; unknown keys are rejected by the drafter's config)",
    )
    g.add_argument(
        "--config",
        metavar="YAML",
        help="a YAML preset (path or name in configs/) with drafters/options/budget/tree/grid; flags override it",
    )
    g.add_argument(
        "--budget",
        nargs="+",
        type=int,
        metavar="N",
        default=None,
        help=f"max draft tokens (tree nodes) per request per step; several values = one run each "
        f"(default {DEFAULT_BUDGET})",
    )
    g.add_argument(
        "--tree",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let drafters propose token trees (verified by the longest matching path) instead of "
        "chains (default: chains, as vLLM verifies)",
    )
    g.add_argument(
        "--strict",
        action="store_true",
        help="raise on a drafter failure or budget violation instead of counting it and going on",
    )


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"output folder for results.json, PNG plots and CSVs (default ./{DEFAULT_OUT}); written "
        "only when the run completes",
    )
    g.add_argument(
        "--save-results", metavar="NAME", help="also write the JSON to eval/results/<YYYY-MM-DD>_<device>_<NAME>.json"
    )
    g.add_argument("--json", metavar="PATH", help="write the results JSON here instead of <out>/results.json")
    g.add_argument(
        "--step-csv",
        action="store_true",
        help="write one CSV per dataset x drafter with a row per step (record, step, position, "
        "context_len, drafted, depth, accepted, emitted, draft_us, update_us)",
    )
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--quiet", action="store_true", help="no tables on stdout (files are still written)")


def _add_cost_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cost model (projected speedup = MAT * t(1) / (t(1 + drafted) + t_draft + t_update))")
    g.add_argument(
        "--verify-ms",
        type=float,
        default=DEFAULT_VERIFY_MS,
        metavar="MS",
        help=f"t(1): target decode step in ms (default {DEFAULT_VERIFY_MS}: an 8B-shaped target at "
        "batch 1 on an H100-class GPU)",
    )
    g.add_argument(
        "--verify-ms-per-token",
        type=float,
        default=DEFAULT_VERIFY_MS_PER_TOKEN,
        metavar="MS",
        help=f"extra ms per additional scored token in a verify step (default {DEFAULT_VERIFY_MS_PER_TOKEN})",
    )
    g.add_argument(
        "--verify-table",
        metavar="N:MS,...",
        help="measured verify times, e.g. 1:5.0,9:5.2,17:5.6 (linear interpolation; overrides the two flags above)",
    )


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "sources",
        nargs="*",
        metavar="SOURCE",
        help="trace files or shared set names (alpaca_eval_llama31_8b, code_alpaca, gsm8k_175b, "
        "mt_bench_vicuna7b_t1, openhands_swebench); a folder = every shared set in it (or every "
        "*.jsonl). None: every shared set under --data / $SPECDEC_DATA, else the built-in workload",
    )
    g = p.add_argument_group("traces")
    g.add_argument(
        "--data",
        metavar="DIR",
        default=None,
        help="shared data folder (default $SPECDEC_DATA); with no SOURCE, replays all its trace sets",
    )
    g.add_argument(
        "--tokenizer",
        metavar="PATH",
        default=None,
        help="local Hugging Face tokenizer folder, 'bytes', or 'none' for token-id traces "
        "(prompt_ids/response_ids) of any vocabulary, replayed unchecked (default: ../shared/models/"
        "code-target-53m if present, else UTF-8 bytes)",
    )
    g.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="first N records per set (OpenHands: first N instances, all their calls); default all. "
        "ANCHORS.md used --limit 400",
    )
    g.add_argument(
        "--format",
        choices=("generic", "openhands", "alpaca", "answers", "gsm8k"),
        default=None,
        help="force the trace format instead of detecting it",
    )
    g.add_argument(
        "--all-turns",
        action="store_true",
        help="FastChat answer files: replay every turn (later turns get the conversation as chat "
        "messages); default turn 1 only, like the anchors",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        default=1,
        metavar="N",
        help="replay N records concurrently (one draft_batch call per step over them); default 1",
    )
    g.add_argument(
        "--no-cache",
        action="store_true",
        help="do not read/write the tokenized-trace cache ($SPECDEC_CACHE or ~/.cache/specdec)",
    )


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = OneLineParser(prog="specdec-eval", description=__doc__, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", metavar="{replay,sweep,live,curve}")
    rp = sub.add_parser(
        "replay",
        formatter_class=fmt,
        help="trace replay (default when no subcommand is given)",
        description="Replay recorded responses against drafters with simulated greedy "
        "verification (longest matching draft path + 1 bonus token per step).",
    )
    sw = sub.add_parser(
        "sweep",
        formatter_class=fmt,
        help="trace replay over the Cartesian product of settings",
        description="Like replay, over the Cartesian product of --grid lists.",
    )
    for p in (rp, sw):
        _add_trace_args(p)
        _add_drafter_args(p)
        _add_cost_args(p)
        _add_output_args(p)
    sw.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a swept setting: budget=4,8,16 | tree=false,true | NAME.KEY=V1,V2 (e.g. "
        "suffix.max_depth=16,32,64); repeatable, the product of all is run",
    )
    from specdec.eval.live import add_live_parser

    add_live_parser(sub, fmt, _add_drafter_args, _add_output_args)
    from specdec.eval.run_curve import add_curve_parser

    add_curve_parser(sub, fmt, _add_trace_args, _add_output_args)
    return parser


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """``specdec-eval [replay options]`` = ``specdec-eval replay [options]`` (the main job)."""
    argv = list(argv)
    if argv and (argv[0] in SUBCOMMANDS or argv[0] in ("-h", "--help")):
        return argv
    return ["replay", *argv]


# ------------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    argv = normalize_argv(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a flag error, printed as one line (2): a status, in-process too
        return int(exc.code or 0)
    logging.basicConfig(level=logging.WARNING, format="specdec-eval: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    previous = _stop_on_sigterm()
    try:
        if args.command == "live":
            from specdec.eval.live import run_live

            return run_live(args)
        if args.command == "curve":
            from specdec.eval.run_curve import run_curve

            return run_curve(args)
        from specdec.eval.run_replay import run_replay

        return run_replay(args)
    except KeyboardInterrupt:
        print("specdec-eval: interrupted; nothing written", file=sys.stderr)
        return 130
    except Terminated:
        print("specdec-eval: stopped by SIGTERM; nothing written", file=sys.stderr)
        return 128 + signal.SIGTERM
    except (EvalError, ConfigError, OSError, ValueError, ImportError) as exc:
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        print(f"specdec-eval: error: {error_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(BaseException):
    """SIGTERM arrived: raised in the main thread so that the staging folder is removed as on Ctrl-C."""


def _stop_on_sigterm() -> Any:
    """SIGTERM raises ``Terminated`` (the default handler would end the process with its staging folder left
    behind); returns the handler it replaced (None where signals cannot be set: not the main thread)."""

    def stop(signum: int, frame: Any) -> None:
        raise Terminated

    try:
        return signal.signal(signal.SIGTERM, stop)
    except ValueError:
        return None


def error_line(exc: BaseException) -> str:
    """The one line printed for a user-facing error (multi-line messages are joined, nothing is cut)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, OSError) and exc.filename is not None and str(exc.filename) not in text:
        text = f"{exc.filename}: {text}"
    return text or type(exc).__name__


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
