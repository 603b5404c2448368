"""Engine-step records for the vLLM benchmark: ``StepTrace`` (a record per step: where a step's time goes, by batch
width), fed by ``step_timer.StepTimer`` (drafting time, GPU busy time and idle gaps per cell).

``bench_vllm --trace`` records, for every engine step of a measured cell (V1 model runner, engine in-process):

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
  reading captured tokens (mostly waiting for the GPU to finish the step), ``finish_ms`` = the drafting call
  (``ScheduledDrafting._finish_job``, ``sync_ms`` included); ``host_late_share`` = the share of steps whose tokens
  were ready when the drafting began (the host, not the drafting, held the GPU).
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
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdec.vllm_plugin.patches.async_sched import PREFILL_HEAVY_TOKENS

TRACES_SUFFIX = ".traces.json.gz"  # beside RESULTS.json: RESULTS.traces.json.gz
CG_CODES = {"FULL": "F", "PIECEWISE": "P", "NONE": "N"}  # vLLM CUDAGraphMode names -> one-letter codes
WIDTH_EDGES = (1, 2, 4, 8, 16, 32, 48, 64, 128, 256)  # bucket upper bounds (requests per step)
MIN_FIT_STEPS = 8  # fit_step_cost needs at least this many steps
FULL_WIDTH_SHARE = 0.75  # --fit: steps at least this share of the cell's widest step
SPLIT_COLS = ("held_ms", "after_ms", "sync_ms", "finish_ms")  # schedule mode's gap split (module docstring)
PHASE_COLS = ("sched_ms", "exec_ms", "sample_ms", "update_ms")  # host time of the engine loop's phases (docstring)
# a step whose drafting waited less than this for its tokens found them ready: the host came late (its own loop,
# not the drafting, then holds the GPU); reading 64 rows of tokens takes ~0.1 ms
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


def _bucket(width: int) -> str:
    lo = 0
    for hi in WIDTH_EDGES:
        if width <= hi:
            return f"{lo + 1}-{hi}" if hi > lo + 1 else str(hi)
        lo = hi
    return f">{WIDTH_EDGES[-1]}"


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarise_trace(trace: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Rows per width bucket: steps, mean period/draft/busy/gap (ms), share of traced wall, non-full share."""
    n = len(trace["reqs"])
    total = sum(p for p in trace["period_ms"] if p is not None) or 1.0
    groups: dict[str, list[int]] = {}
    for i in range(n):
        groups.setdefault(_bucket(trace["reqs"][i]), []).append(i)
    names = ("period_ms", "draft_ms", "busy_ms", "gap_ms", "tokens", "spec", "emitted")
    columns = {c: trace.get(c) or [None] * n for c in names}  # older traces lack "emitted"
    rows = []
    for name, idx in sorted(groups.items(), key=lambda kv: -min(trace["reqs"][i] for i in kv[1])):
        col = {c: [columns[c][i] for i in idx] for c in names}
        cg = [trace["cg"][i] for i in idx]
        rows.append(
            {
                "width": name,
                "steps": len(idx),
                "wall_share": sum(p for p in col["period_ms"] if p is not None) / total,
                **{f"{c}_mean": _mean(col[c]) for c in names},
                "not_full_share": sum(c in "PN" for c in cg) / len(cg),
            }
        )
    return rows


def fit_step_cost(traces: list[dict[str, list[Any]]], *, min_width: int) -> dict[str, float] | None:
    """Least-squares fit over decode steps at least ``min_width`` requests wide (prefill steps left out):
    period = a + b x emitted tokens, and drafting = c + d x emitted. Returns a / c in ms, b / d in µs per token,
    R² of the period fit, the steps used and their throughput (emitted tokens / wall: the rate while the batch is
    full, which a closed batch's total hides); None without emitted counts or with fewer than MIN_FIT_STEPS steps."""
    import numpy as np

    rows = []
    for t in traces:
        emitted_col = t.get("emitted") or [None] * len(t["reqs"])  # older traces lack it
        for i, width in enumerate(t["reqs"]):
            period, emitted = t["period_ms"][i], emitted_col[i]
            prefill = t["tokens"][i] - t["spec"][i] != width
            if period is None or emitted is None or prefill or width < min_width:
                continue
            rows.append((emitted, period, t["draft_ms"][i] or 0.0, t["spec"][i]))
    if len(rows) < MIN_FIT_STEPS:
        return None
    data = np.array(rows, dtype=float)  # [steps, 4]: emitted, period ms, drafting ms, draft tokens
    tokens_per_s = 1e3 * float(data[:, 0].sum() / data[:, 1].sum())  # while the batch is (nearly) full
    if not data[:, 3].any():  # no step verified a draft (no speculation): no slope to fit
        return {
            "period_ms": float(data[:, 1].mean()),
            "period_us_per_token": None,
            "draft_ms": float(data[:, 2].mean()),
            "draft_us_per_token": None,
            "r2": None,
            "steps": len(data),
            "tokens_per_s": tokens_per_s,
        }
    design = np.stack([np.ones(len(data)), data[:, 0]], axis=1)  # [steps, 2]
    (a, b), *_ = np.linalg.lstsq(design, data[:, 1], rcond=None)
    (c, d), *_ = np.linalg.lstsq(design, data[:, 2], rcond=None)
    resid = data[:, 1] - design @ np.array([a, b])
    spread = ((data[:, 1] - data[:, 1].mean()) ** 2).sum()
    return {
        "period_ms": float(a),
        "period_us_per_token": 1e3 * float(b),
        "draft_ms": float(c),
        "draft_us_per_token": 1e3 * float(d),
        "r2": float(1 - (resid**2).sum() / spread) if spread else 1.0,
        "steps": len(data),
        "tokens_per_s": tokens_per_s,
    }


def cell_totals(trace: dict[str, list[Any]], *, heavy_tokens: int = PREFILL_HEAVY_TOKENS) -> dict[str, Any]:
    """A cell's GPU time in total: busy and idle seconds over all its steps, and the split between heavy prefill
    steps (prompt tokens ~ scheduled tokens - requests - draft tokens >= ``heavy_tokens``, the plugin's threshold
    by default) and the rest: their
    share of the steps, mean emitted tokens and GPU busy ms per step. Where every method does the same prefill
    work, ``busy_s`` says how much GPU work speculation saved and ``gap_s`` what the host added."""
    n = len(trace["reqs"])

    def col(name: str) -> list[float]:
        return [float(v) if v is not None else float("nan") for v in trace.get(name) or [None] * n]

    reqs, tokens, spec, emitted, busy, gap = (
        col(c) for c in ("reqs", "tokens", "spec", "emitted", "busy_ms", "gap_ms")
    )
    heavy = [t - r - s >= heavy_tokens for t, r, s in zip(tokens, reqs, spec)]

    def part(values: list[float], want: bool) -> float | None:
        return _mean([v for v, h in zip(values, heavy) if h == want and not math.isnan(v)])

    def total(ms: list[float]) -> float:  # seconds; NaN (not timed) skipped
        return sum(x for x in ms if not math.isnan(x)) / 1e3

    return {
        "steps": n,
        "busy_s": total(busy),
        "gap_s": total(gap),
        "gpu_s": total(busy) + total(gap),
        "emitted": int(sum(e for e in emitted if not math.isnan(e))),
        "heavy_share": sum(heavy) / n if n else None,
        "heavy_emitted": part(emitted, True),
        "light_emitted": part(emitted, False),
        "heavy_spec": part(spec, True),
        "heavy_busy_ms": part(busy, True),
        "light_busy_ms": part(busy, False),
    }


def format_totals(rows: dict[str, dict[str, Any]]) -> str:
    """``cell_totals`` of several cells (label -> totals) as a markdown table."""
    head = (
        "| cell | steps | GPU busy s | GPU idle s | sum s | heavy prefill steps | emitted / step heavy, rest | "
        "draft tokens / heavy step | busy ms / step heavy, rest |"
    )
    lines = [head, "| --- " * 9 + "|"]
    for label, t in rows.items():
        lines.append(
            f"| {label} | {t['steps']} | {_fmt(t['busy_s'])} | {_fmt(t['gap_s'])} | {_fmt(t['gpu_s'])} | "
            f"{_fmt(t['heavy_share'])} | {_fmt(t['heavy_emitted'], 1)}, {_fmt(t['light_emitted'], 1)} | "
            f"{_fmt(t['heavy_spec'], 0)} | {_fmt(t['heavy_busy_ms'], 1)}, {_fmt(t['light_busy_ms'], 1)} |"
        )
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 2) -> str:
    """A table cell: ``-`` for a missing value."""
    return "-" if value is None else f"{value:.{digits}f}"


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = (
        "| width | steps | wall share | period ms | draft ms | busy ms | gap ms | tokens | draft tokens | "
        "emitted | not full |"
    )
    lines = [head, "| --- " * 11 + "|"]
    f = _fmt
    for r in rows:
        lines.append(
            f"| {r['width']} | {r['steps']} | {f(r['wall_share'])} | {f(r['period_ms_mean'])} | "
            f"{f(r['draft_ms_mean'])} | {f(r['busy_ms_mean'])} | {f(r['gap_ms_mean'])} | "
            f"{f(r['tokens_mean'], 0)} | {f(r['spec_mean'], 0)} | {f(r['emitted_mean'], 0)} | "
            f"{f(r['not_full_share'])} |"
        )
    return "\n".join(lines)


def plot_traces(traces: dict[str, dict[str, list[Any]]], path: Path) -> None:
    """One panel per cell: per-step GPU busy, drafting and the rest of the host gap (stacked, ms) and the batch
    width (right axis), so the tail of stragglers and vLLM's own per-step host work are visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 2.4 * len(traces)), squeeze=False, sharex=True)
    for ax, (key, t) in zip(axes[:, 0], traces.items()):
        n = len(t["reqs"])
        busy = [b or 0.0 for b in t["busy_ms"]]
        draft = [d or 0.0 for d in t["draft_ms"]]
        other = [max(0.0, (g or 0.0) - d) for g, d in zip(t["gap_ms"], draft)]
        xs = range(n)
        ax.bar(xs, busy, width=1.0, color="tab:green", label="GPU busy")
        ax.bar(xs, draft, width=1.0, bottom=busy, color="tab:red", label="drafting")
        ax.bar(
            xs,
            other,
            width=1.0,
            bottom=[b + d for b, d in zip(busy, draft)],
            color="tab:gray",
            label="other host work (GPU idle)",
        )
        ax.set_ylabel("ms per step")
        method, dataset, bs = key.split("|")
        ax.set_title(f"{method} / {dataset} / batch {bs}", fontsize=9, loc="left")
        width_ax = ax.twinx()
        width_ax.plot(xs, t["reqs"], color="black", linewidth=1.0)
        width_ax.set_ylabel("requests")
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("engine step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    ap.add_argument("--plot", default="", help="also write a PNG: one panel per selected cell (per-step ms, width)")
    ap.add_argument(
        "--fit",
        action="store_true",
        help="per method, fit period and drafting = a + b x emitted "
        "tokens over near-full-width decode steps of the selected cells (traces with emitted counts)",
    )
    args = ap.parse_args(argv)
    traces = read_step_traces(Path(args.results))
    if not traces:
        raise SystemExit(f"{args.results}: no traces (run bench_vllm with --trace)")
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
    if args.totals:
        print(format_totals({key.replace("|", " "): cell_totals(t) for key, t in chosen.items()}))
    if args.fit:
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
    if args.plot and chosen:
        plot_traces(chosen, Path(args.plot))
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
