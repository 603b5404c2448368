"""Engine-step records for the vLLM benchmark: ``StepTrace`` (a record per step: where a step's time goes, by batch
width), fed by ``step_timer.StepTimer`` (drafting time, GPU busy time and idle gaps per cell).

``bench_vllm --trace`` records, for every engine step of a measured cell (V1 model runner; on Model Runner V2, which
no speculation runs on, everything but the GPU's busy and idle times and the CUDA-graph mode):

* ``period_ms``: host time from this step's ``execute_model`` to the next one's (the step's wall period;
  ``None`` for the last step of a ``generate`` call),
* ``reqs`` / ``tokens`` / ``spec``: requests scheduled, tokens scheduled, draft tokens among them,
* ``emitted``: tokens the step emitted (what the scheduler's ``update_from_output`` receives),
* ``draft_ms``: time in the drafting hooks during the period (``StepTimer``),
* ``cg``: the CUDA-graph mode vLLM's dispatcher chose for the forward pass (``F`` full, ``P`` piecewise,
  ``N`` none/eager, ``?`` not seen),
* ``busy_ms`` / ``gap_ms``: GPU time of the step and the GPU's idle gap after it (CUDA events, ``StepTimer``).
* schedule mode with the device wait, the gap split in two: ``held_ms`` = GPU time from the step's end until the
  next step's stream is past its wait for drafts (and the draft copy), ``after_ms`` = from there to the next forward's
  start (vLLM's input work queued behind the wait, the launch); host side, ``sync_ms`` = time the drafting spent
  reading captured tokens (mostly waiting for the GPU to finish the step), ``finish_ms`` = the drafting call (the
  plugin's ``finish`` timing hook, ``specdec.vllm_plugin.observe``; ``sync_ms`` included); ``host_late_share`` = the
  share of steps whose tokens were ready when the drafting began (the host, not the drafting, held the GPU).
* host time of the engine loop's phases in the step's period (engine core thread, wall): ``sched_ms`` = vLLM's
  ``Scheduler.schedule`` (with the plugin's slot re-grant), ``exec_ms`` = ``execute_model`` (input preparation,
  schedule mode's fill and drafting with its wait for the previous step's tokens, the forward's launch),
  ``sample_ms`` = ``sample_tokens`` (sampling and rejection launched, schedule mode's capture), ``update_ms`` =
  ``update_from_output`` of the step whose output arrived; the period's rest is the loop itself (waiting for that
  output, input and output queues).

``--totals`` instead prints each cell's GPU busy and idle seconds in all and its heavy prefill steps against the rest
(``cell_totals``): on the agentic prompts every method does the same prefill work, so busy seconds compare the
verify work and idle seconds what the host added.

``python -m benchmarks.step_trace RESULTS.json [--method M] [--dataset D] [--batch-size B] [--plot P.png]`` prints, per
cell, a table by width bucket (requests in the step): steps, mean period / draft / busy / gap, share of the cell's
wall, share of piecewise or eager steps. A closed batch (all prompts submitted at once) ends with a tail of
stragglers; the table shows how much of the wall that tail takes.

Storage: the traces are ~95% of a results JSON, and every GPU call carries the repository (64 MiB with a bundle part).
``save_step_traces`` moves them out of the JSON into ``<results stem>.traces.json.gz`` beside it
(``summary.traces_file`` names it); ``read_step_traces`` reads them from either place. Renaming a results JSON: rename
its traces file alike.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.step_trace_stats import (
    _fmt,
    cell_totals,
    fit_step_cost,
    format_draft_split,
    format_rows,
    format_totals,
    plot_traces,
    summarise_by_draft,
    summarise_trace,
)

TRACES_SUFFIX = ".traces.json.gz"  # beside RESULTS.json: RESULTS.traces.json.gz
CG_CODES = {"FULL": "F", "PIECEWISE": "P", "NONE": "N"}  # vLLM CUDAGraphMode names -> one-letter codes
FULL_WIDTH_SHARE = 0.75  # --fit: steps at least this share of the cell's widest step
SPLIT_COLS = ("held_ms", "after_ms", "sync_ms", "finish_ms")  # schedule mode's gap split (module docstring)
PHASE_COLS = ("sched_ms", "exec_ms", "sample_ms", "update_ms")  # host time of the engine loop's phases (docstring)
# a step whose drafting waited less than this for its tokens found them ready: the host came late (its own loop,
# not the drafting, then holds the GPU); reading a batch's rows of tokens takes a fraction of this
HOST_LATE_SYNC_MS = 0.3


def _plugin_full_dispatches() -> int:
    """FULL dispatches of the specdec plugin's own graphs so far, over the engines of this process (each live
    proposer's ``graph_stats``)."""
    from specdec.vllm_plugin.proposer import INSTANCES

    return sum(p.graph_stats.full_dispatches() for p in list(INSTANCES))


class StepTrace:
    """Collects one record per engine step (see the module docstring); ``cell()`` returns and clears them."""

    def __init__(self, full_dispatches: Callable[[], int] = _plugin_full_dispatches) -> None:
        """``full_dispatches``: the plugin's FULL dispatches of its own graphs so far (a step during which they grew
        replayed one)."""
        self.full_dispatches = full_dispatches
        self.rows: list[dict[str, Any]] = []
        self._by_output: dict[int, int] = {}  # id(scheduler output) -> its row (this cell)
        self._cg = "?"
        self._draft_at_start = 0.0
        self._ours_at_start = 0  # the plugin's own FULL dispatches (narrow, ragged) before this step

    def install(self) -> None:
        """Wrap vLLM's CUDA-graph dispatcher to note the mode of each forward pass (V1 runner)."""
        try:
            from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
        except ImportError:
            return
        trace, dispatch = self, CudagraphDispatcher.dispatch

        @functools.wraps(dispatch)
        def wrapped(self: Any, *a: Any, **kw: Any) -> Any:
            out = dispatch(self, *a, **kw)
            mode = out[0] if isinstance(out, tuple) else out
            trace._cg = CG_CODES.get(getattr(mode, "name", str(mode)), "?")
            return out

        CudagraphDispatcher.dispatch = wrapped
        try:
            from vllm.v1.core.sched.scheduler import Scheduler
        except ImportError:
            return
        update = Scheduler.update_from_output

        @functools.wraps(update)
        def counted(self: Any, scheduler_output: Any, model_runner_output: Any, *a: Any, **kw: Any) -> Any:
            trace.emitted(getattr(model_runner_output, "sampled_token_ids", None), scheduler_output)
            return update(self, scheduler_output, model_runner_output, *a, **kw)

        Scheduler.update_from_output = counted

    def emitted(self, sampled: Any, scheduler_output: Any = None) -> None:
        """Tokens a step emitted (its rows' sampled lists, as the scheduler receives them), credited to the step
        that ran ``scheduler_output`` (with async scheduling the update comes after the next step started)."""
        if not self.rows or not isinstance(sampled, list):
            return
        row = self._by_output.get(id(scheduler_output), len(self.rows) - 1)
        self.rows[row]["emitted"] = sum(len(s) for s in sampled)

    def step(self, scheduler_output: Any, draft_s_total: float) -> None:
        """Called at ``execute_model`` entry with the engine's running drafting total (seconds)."""
        now = time.perf_counter()
        if self.rows and self.rows[-1]["period_ms"] is None:
            self._close_last(1e3 * (now - self.rows[-1]["t"]), draft_s_total)
        self._draft_at_start, self._cg, self._ours_at_start = draft_s_total, "?", self.full_dispatches()
        self._by_output[id(scheduler_output)] = len(self.rows)
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        per_req = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        self.rows.append(
            {
                "t": now,
                "reqs": len(per_req),
                "period_ms": None,
                "draft_ms": None,
                "cg": "?",
                "tokens": int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0),
                "spec": sum(len(v) for v in spec.values()),
            }
        )

    @property
    def current(self) -> int:
        """Index of the step being executed (for GPU events recorded during it)."""
        return len(self.rows) - 1

    def end_call(
        self,
        draft_s_total: float,
        gpu: dict[int, tuple[float, float | None]],
        split: dict[int, dict[str, float]] | None = None,
    ) -> None:
        """A ``generate`` call finished: close its last step; ``gpu`` = step index -> (busy ms, gap ms after);
        ``split``: step index -> the gap's parts and the host's drafting times (``SPLIT_COLS``), and the host time of
        the engine loop's phases in that step's period (``PHASE_COLS``)."""
        if self.rows and self.rows[-1]["period_ms"] is None:
            self._close_last(-1.0, draft_s_total)  # -1: closed, period unknown (no next step)
        for i, (busy, gap) in gpu.items():
            if 0 <= i < len(self.rows):
                self.rows[i]["busy_ms"], self.rows[i]["gap_ms"] = busy, gap
        for i, parts in (split or {}).items():
            if 0 <= i < len(self.rows):
                self.rows[i].update(parts)

    def _close_last(self, period_ms: float, draft_s_total: float) -> None:
        """The open step ends: its period, the drafting done since it began, its CUDA-graph mode."""
        last = self.rows[-1]
        last["period_ms"] = period_ms
        last["draft_ms"] = 1e3 * (draft_s_total - self._draft_at_start)
        # the plugin's narrow and ragged FULL keys are dispatched by its own wrapper, outside the one noting modes
        ours = self._cg == "?" and self.full_dispatches() > self._ours_at_start
        last["cg"] = "F" if ours else self._cg

    def cell(self) -> dict[str, list[Any]]:
        """The cell's steps as columns (periods of -1 -> None), then cleared."""
        cols = (
            "reqs",
            "tokens",
            "spec",
            "emitted",
            "period_ms",
            "draft_ms",
            "busy_ms",
            "gap_ms",
            *SPLIT_COLS,
            *PHASE_COLS,
        )
        out: dict[str, list[Any]] = {c: [] for c in cols}
        for r in self.rows:
            for c in cols:
                v = r.get(c)
                out[c].append(
                    None if v is None or (c == "period_ms" and v < 0) else (round(v, 4) if isinstance(v, float) else v)
                )
        out["cg"] = "".join(r["cg"] for r in self.rows)  # type: ignore[assignment]
        self.rows, self._by_output = [], {}
        return out


def host_late_share(trace: dict[str, list[Any]]) -> float | None:
    """Share of a schedule-mode cell's steps whose drafting found the step's tokens ready (``sync_ms`` under
    ``HOST_LATE_SYNC_MS``): the host reached the drafting after the GPU had finished, so the GPU's wait is the host's
    own loop (vLLM's scheduling and bookkeeping, ours) running past the step, not the drafting. None without
    ``sync_ms``."""
    sync = [v for v in trace.get("sync_ms") or () if v is not None]
    return sum(v < HOST_LATE_SYNC_MS for v in sync) / len(sync) if sync else None


def save_step_traces(doc: dict[str, Any], json_path: Path) -> None:
    """Move ``doc["summary"]["traces"]`` into ``<json_path stem>.traces.json.gz`` (gzip, compact JSON) and record
    its name as ``summary.traces_file``. No traces: nothing written, ``doc`` unchanged."""
    summary = doc.get("summary", {})
    traces = summary.get("traces")
    if not traces:
        return
    path = traces_path(json_path)
    path.write_bytes(gzip.compress(json.dumps(traces, separators=(",", ":")).encode(), mtime=0))
    del summary["traces"]
    summary["traces_file"] = path.name


def traces_path(json_path: Path) -> Path:
    """The traces file beside a results JSON."""
    return json_path.with_name(json_path.name.removesuffix(".json") + TRACES_SUFFIX)


def read_step_traces(json_path: Path, doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """A results JSON's per-step traces: inline (older files), else the traces file beside it (same stem), else the
    one ``summary.traces_file`` names; {} if none."""
    doc = doc if doc is not None else json.loads(Path(json_path).read_text())
    summary = doc.get("summary", {})
    if summary.get("traces"):
        return summary["traces"]
    for path in (traces_path(Path(json_path)), Path(json_path).with_name(summary.get("traces_file") or "-")):
        if path.is_file():
            return json.loads(gzip.decompress(path.read_bytes()))
    return {}


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    traces = read_step_traces(Path(args.results))
    if not traces:
        raise SystemExit(f"{args.results}: no traces (run bench_vllm with --trace)")
    chosen = _chosen(args, traces)
    if args.totals:
        print(format_totals({key.replace("|", " "): cell_totals(t) for key, t in chosen.items()}))
    if args.fit:
        _print_fits(chosen)
    if args.by_draft:
        for key, trace in chosen.items():
            print(f"\n{key.replace('|', ' ')}: decode steps, plain against drafted (ms means)")
            print(format_draft_split(summarise_by_draft(trace)))
    if args.plot and chosen:
        plot_traces(chosen, Path(args.plot))
        print(f"\nplot: {args.plot}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a bench_vllm results JSON written with --trace")
    ap.add_argument("--method", default="", help="only this method")
    ap.add_argument("--dataset", default="", help="only this dataset")
    ap.add_argument("--batch-size", type=int, default=0, help="only this batch size")
    ap.add_argument(
        "--totals",
        action="store_true",
        help="only the cells' GPU totals: busy and idle seconds, heavy prefill steps against the rest (cell_totals)",
    )
    ap.add_argument(
        "--by-draft",
        action="store_true",
        help="per selected cell, decode steps that verified a draft against plain ones: period, GPU busy and idle, "
        "the gap's split and the engine loop's phases (summarise_by_draft)",
    )
    ap.add_argument("--plot", default="", help="also write a PNG: one panel per selected cell (per-step ms, width)")
    ap.add_argument(
        "--fit",
        action="store_true",
        help="per method, fit period and drafting = a + b x emitted "
        "tokens over near-full-width decode steps of the selected cells (traces with emitted counts)",
    )
    return ap


def _chosen(args: argparse.Namespace, traces: dict[str, Any]) -> dict[str, Any]:
    """The cells the flags select (key "method|dataset|batch size" -> trace), each one's width table printed unless
    ``--totals``."""
    chosen = {}
    for key, trace in traces.items():
        method, dataset, bs = key.split("|")
        if (
            (args.method and method != args.method)
            or (args.dataset and dataset != args.dataset)
            or (args.batch_size and int(bs) != args.batch_size)
            or not trace["reqs"]
        ):
            continue
        chosen[key] = trace
        if not args.totals:
            print(f"\n{method} {dataset} bs {bs}: {len(trace['reqs'])} steps")
            print(format_rows(summarise_trace(trace)))
    return chosen


def _print_fits(chosen: dict[str, Any]) -> None:
    """``--fit``: per method, the step-cost fit over the near-full-width decode steps of its selected cells."""
    by_method: dict[str, list[dict[str, list[Any]]]] = {}
    for key, trace in chosen.items():
        by_method.setdefault(key.split("|")[0], []).append(trace)
    print(
        "\n| method | steps | tok/s at full width | period ms | + µs per emitted token | R² | drafting ms | "
        "+ µs per token |"
    )
    print("| --- " * 8 + "|")
    for method, group in by_method.items():
        width = int(FULL_WIDTH_SHARE * max(max(t["reqs"]) for t in group))
        fit = fit_step_cost(group, min_width=width)
        if fit is not None:
            f = _fmt
            print(
                f"| {method} | {fit['steps']} | {fit['tokens_per_s']:,.0f} | {f(fit['period_ms'])} | "
                f"{f(fit['period_us_per_token'], 1)} | "
                f"{f(fit['r2'], 2)} | {f(fit['draft_ms'], 2)} | {f(fit['draft_us_per_token'], 1)} |"
            )


if __name__ == "__main__":
    main()
