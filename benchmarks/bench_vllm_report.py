"""Summary and markdown table of a vLLM benchmark run (``benchmarks.bench_vllm``): ratios to no-spec and to the
same run's peers, bf16 mismatch counts, the float32 lossless comparison.

    python -m benchmarks.bench_vllm_report eval/results/RESULTS.json [--write]   # re-render the markdown
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.step_trace import PHASE_COLS, host_late_share, read_step_traces

REFERENCES = ("nospec", "nospec-v1", "nospec-sync")  # no-spec engines, the first one present is the ratio base
PEERS = ("suffix", "ngram", "specdec-sync")  # what specdec methods are compared with in the same run
PEER_LABELS = {"suffix": "suffix", "ngram": "ngram", "specdec-sync": "sync"}
CLOSED, SUSTAINED = "closed", "sustained"  # a cell's load (bench_vllm --load); results without one are closed
SPEED_COLUMNS = "tokens/s (x no-spec) | MAT | draft ms/step | bf16 mismatches vs no-spec"
VARIED_KEY = "varied"  # settings["output_lengths"] of a --output-lengths varied run: {"varied": [lo, hi], "seed": s}


def load_of(row: dict[str, Any]) -> str:
    return row.get("load", CLOSED)


def _key(row: dict[str, Any]) -> tuple[str, int, str]:
    """What ratios pair rows by: dataset, batch size (a sustained cell's concurrency) and load."""
    return row["dataset"], row["batch_size"], load_of(row)


def _mismatches(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b))


def first_diffs(a: list[list[int]], ref: list[list[int]]) -> list[dict[str, int]]:
    """Per mismatched prompt: its index and the first output position that differs (where to look)."""
    out = []
    for i, (x, y) in enumerate(zip(a, ref)):
        if x != y:
            pos = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            out.append({"prompt": i, "position": pos, "tokens": len(x), "reference_tokens": len(y)})
    return out


def trace_key(method: str, dataset: str, cell: dict[str, Any]) -> str:
    """The ``summary.traces`` key of a cell (or its row), as step_trace reads it: "method|dataset|batch size", the
    dataset suffixed ":sustained" for a sustained-load cell."""
    load = load_of(cell)
    return f"{method}|{dataset}{'' if load == CLOSED else ':' + load}|{cell['batch_size']}"


def summarise(runs: dict[str, dict[str, Any]], lossless: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Strip outputs, add ratios to no-spec and bf16 mismatch counts; the fp32 lossless comparison."""
    ref_name = reference_method(runs)
    base = runs.get(ref_name) if ref_name else None
    rows, traces = [], {}
    for method, run in runs.items():
        for ds, cells in run["datasets"].items():
            for b, cell in cells.items():
                row = {k: v for k, v in cell.items() if k not in ("outputs", "trace")}
                if cell.get("trace"):
                    traces[trace_key(method, ds, cell)] = cell["trace"]
                row.update(method=method, dataset=ds)
                if run.get("partial"):  # its engine was cut short (timeout or error) after this cell
                    row["engine_rc"] = run.get("rc")
                ref = base["datasets"].get(ds, {}).get(b) if base else None
                sampled = bool(run.get("temperature"))  # sampled outputs differ by design: no mismatch count
                if ref is not None and "outputs" in cell and "outputs" in ref and not sampled:
                    row["mismatches_vs_nospec"] = _mismatches(cell["outputs"], ref["outputs"])
                rows.append(row)
    add_ratios(rows)
    _waiting(rows)
    out: dict[str, Any] = {"rows": rows}
    ref32, spec32 = lossless.get("nospec"), {k: v for k, v in lossless.items() if k != "nospec"}
    if ref32:
        checks = []
        for method, run in spec32.items():
            for ds, cells in run["datasets"].items():
                for b, cell in cells.items():
                    ref_cell = ref32["datasets"].get(ds, {}).get(b)
                    if ref_cell is None:  # the reference engine was cut short before this cell
                        continue
                    ref = ref_cell["outputs"]
                    checks.append(
                        {
                            "method": method,
                            "dataset": ds,
                            "batch_size": int(b),
                            "compared": len(ref),
                            "identical": len(ref) - _mismatches(cell["outputs"], ref),
                            # a comparison of empty outputs proves nothing: record what was compared
                            "mean_output_tokens": sum(map(len, ref)) / max(len(ref), 1),
                            "first_diffs": first_diffs(cell["outputs"], ref),
                        }
                    )
        out["lossless_fp32"] = checks
    out["startup_s"] = {m: r["startup_s"] for m, r in runs.items()}
    out["engine_config"] = {m: r.get("engine_config") for m, r in runs.items()}
    out["specdec_stats"] = {m: r.get("specdec_stats") for m, r in runs.items() if r.get("specdec_stats")}
    if any("sustained_engine" in r for r in runs.values()):  # --load both: the sustained cells' own engines
        out["sustained_engine"] = {m: r["sustained_engine"] for m, r in runs.items() if "sustained_engine" in r}
    if traces:
        out["traces"] = traces  # per-step records (--trace): python -m benchmarks.step_trace RESULTS.json
    return out


def reference_method(methods: Any) -> str | None:
    """The run's no-spec reference: the first of ``REFERENCES`` among ``methods``."""
    return next((m for m in REFERENCES if m in methods), None)


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Tokens/s ratios from the summary rows: ``speedup_vs_nospec`` (to the run's no-spec reference, named in
    ``reference``) on every row, and ``speedup_vs_peers`` {peer: ratio} on the specdec rows (peers of ``PEERS`` measured
    in the same run, same dataset, batch size and load)."""
    tps = {(r["method"], *_key(r)): r["tokens_per_s"] for r in rows}
    ref = reference_method({r["method"] for r in rows})
    for r in rows:
        key = _key(r)
        base = tps.get((ref, *key))
        if base:
            r["speedup_vs_nospec"], r["reference"] = r["tokens_per_s"] / base, ref
        if r["method"].startswith("specdec") and r["method"] not in PEERS:
            peers = {p: r["tokens_per_s"] / tps[(p, *key)] for p in PEERS if tps.get((p, *key))}
            if peers:
                r["speedup_vs_peers"] = peers


def _waiting(rows: list[dict[str, Any]]) -> None:
    """ "GPU waiting for drafts" per row: its GPU idle gap per step minus no-spec's (``nospec-v1``: same runner),
    and that as a share of the step (busy + gap). With ``nospec-sync`` in the run (no-spec, same runner, vLLM's
    synchronous scheduling) the wait of a speculative method is split in three parts (ms per step, and shares):
    ``sync_scheduling`` = nospec-sync's gap - nospec-v1's (what synchronous scheduling, imposed by vLLM 0.26 on
    every CPU drafter, costs even without speculation), ``drafting`` = the method's drafting time on the engine
    thread (``draft_ms_per_step``), ``speculation`` = the rest (vLLM's own host work for speculative steps)."""
    ref = {_key(r): r.get("gpu_gap_ms_per_step") for r in rows if r["method"] == "nospec-v1"}
    sync_ref = {
        _key(r): r.get("gpu_gap_ms_per_step")
        for r in rows
        if r["method"] == "nospec-sync" and r.get("gpu_gap_ms_per_step") is not None
    }
    for r in rows:
        base = ref.get(_key(r))
        gap, busy = r.get("gpu_gap_ms_per_step"), r.get("gpu_busy_ms_per_step")
        if gap is None or busy is None or base is None:
            continue
        r["gpu_wait_for_drafts_ms"] = gap - base
        r["gpu_wait_for_drafts_share"] = (gap - base) / (gap + busy) if gap + busy > 0 else None
        sync = sync_ref.get(_key(r))
        if sync is not None and not r["method"].startswith("nospec") and gap + busy > 0:
            draft = r.get("draft_ms_per_step") or 0.0
            parts = {"sync_scheduling": sync - base, "speculation": gap - draft - sync, "drafting": draft}
            r["gpu_wait_parts_ms"] = parts
            r["gpu_wait_parts_share"] = {k: v / (gap + busy) for k, v in parts.items()}


def markdown(doc: dict[str, Any]) -> str:
    rows = doc["summary"]["rows"]
    lines = [
        f"# vLLM benchmark {doc['date']} on {doc['device']}",
        "",
        f"Settings: {json.dumps(doc['settings'])}",
        "",
        f"Cache policy: {doc['settings']['cache_policy']}",
        "",
    ]
    batches = doc["settings"]["batch_sizes"]
    closed = [r for r in rows if load_of(r) == CLOSED]
    methods = list(dict.fromkeys(r["method"] for r in closed))  # every closed table lists every method
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        mine = [r for r in closed if r["dataset"] == ds]
        if mine:
            lines += [f"## {ds}: {SPEED_COLUMNS}", ""]
            lines += _speed_table(mine, methods, batches, [f"bs {b}" for b in batches])
            lines += _peer_table(mine, ds, batches) + _gap_table(mine, ds, batches)
        lines += _sustained_tables(
            [r for r in rows if r["dataset"] == ds and load_of(r) == SUSTAINED],
            ds,
            lengths=_lengths_note(doc["settings"]),
        )
    if doc["summary"].get("lossless_fp32"):
        lines += [
            "## Greedy lossless check, float32 (EOS respected)",
            "",
            "| method | dataset | bs | identical | mean output tokens |",
            "| --- | --- | --- | --- | --- |",
        ]
        for c in doc["summary"]["lossless_fp32"]:
            lines.append(
                f"| {c['method']} | {c['dataset']} | {c['batch_size']} | {c['identical']}/{c['compared']} "
                f"| {c.get('mean_output_tokens', float('nan')):.1f} |"
            )
    return "\n".join(lines) + "\n"


def _lengths_note(settings: dict[str, Any]) -> str:
    """What the sustained tables' titles add for the run's output lengths: ", output lengths lo-hi" where the
    settings say varied (``bench_vllm --output-lengths varied``), "" for fixed lengths or results without the key."""
    lengths = settings.get("output_lengths")
    if not isinstance(lengths, dict) or VARIED_KEY not in lengths:
        return ""
    lo, hi = lengths[VARIED_KEY]
    return f", output lengths {lo}-{hi}"


def _sustained_tables(rows: list[dict[str, Any]], ds: str, *, lengths: str = "") -> list[str]:
    """A dataset's sustained-load cells (``bench_vllm --load sustained``): the closed tables' columns and ratios,
    one column per concurrency cap b, headed with its prompt count N ([] if the run has none); ``lengths``: appended
    to the tables' titles (``_lengths_note``)."""
    if not rows:
        return []
    batches = sorted({r["batch_size"] for r in rows})
    prompts = {r["batch_size"]: r["prompts"] for r in rows}
    heads = [f"b {b}, N {prompts[b]}" for b in batches]
    name = f"{ds}, sustained load{lengths}"
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = [f"## {name}: N prompts, at most b in flight: {SPEED_COLUMNS}", ""]
    lines += _speed_table(rows, methods, batches, heads)
    return lines + _peer_table(rows, name, batches, heads) + _gap_table(rows, name, batches, heads)


def _speed_table(rows: list[dict[str, Any]], methods: list[str], batches: list[int], heads: list[str]) -> list[str]:
    """Tokens/s (x no-spec), MAT, drafting ms per step and bf16 mismatches per method and batch size."""

    def text(r: dict[str, Any]) -> str:
        sp = f" ({r['speedup_vs_nospec']:.2f}x)" if "speedup_vs_nospec" in r else ""
        mm = (
            f", {r['mismatches_vs_nospec']}/{r['prompts']} mm"
            if r["method"] != "nospec" and "mismatches_vs_nospec" in r
            else ""
        )
        draft = "-" if r.get("draft_ms_per_step") is None else f"{r['draft_ms_per_step']:.2f}"
        return f"{r['tokens_per_s']:,.0f}{sp}; MAT {r['mat']:.2f}; {draft} ms{mm}"

    return _grid(rows, batches, heads, text, methods) + [""]


def _grid(
    rows: list[dict[str, Any]],
    batches: list[int],
    heads: list[str] | None,
    text: Callable[[dict[str, Any]], str],
    methods: list[str] | None = None,
) -> list[str]:
    """A method x batch-size markdown table: header (``heads``, default "bs b"), then one line per method
    (``methods``, default in row order) with ``text(row)`` per batch size, "-" where the method has no row."""
    lines = [
        "| method | " + " | ".join(heads or [f"bs {b}" for b in batches]) + " |",
        "| --- |" + " --- |" * len(batches),
    ]
    for method in methods or dict.fromkeys(r["method"] for r in rows):
        cells = {r["batch_size"]: r for r in rows if r["method"] == method}
        lines.append(f"| {method} | " + " | ".join(text(cells[b]) if b in cells else "-" for b in batches) + " |")
    return lines


def _gap_table(rows: list[dict[str, Any]], name: str, batches: list[int], heads: list[str] | None = None) -> list[str]:
    """GPU idle gap per step (ms), busy per step (ms) and waiting-for-drafts share, where measured (``rows``: one
    dataset and load; ``name`` titles the table, ``heads`` the batch-size columns, default "bs b")."""
    mine = [r for r in rows if r.get("gpu_gap_ms_per_step") is not None]
    if not mine:
        return []

    def text(r: dict[str, Any]) -> str:
        share = r.get("gpu_wait_for_drafts_share")
        return f"{r['gpu_gap_ms_per_step']:.3f} / {r['gpu_busy_ms_per_step']:.3f}" + (
            f"; wait {100 * share:.1f}%" if share is not None else ""
        )

    lines = [
        f"### {name}: GPU idle gap / busy per step (ms) | waiting for drafts (gap - nospec-v1 gap) share of step",
        "",
        *_grid(mine, batches, heads, text),
    ]
    return (
        lines
        + [""]
        + _parts_table(mine, name, batches, heads)
        + _split_table(mine, name, batches, heads)
        + _phase_table(mine, name, batches, heads)
    )


def _phase_table(
    mine: list[dict[str, Any]], name: str, batches: list[int], heads: list[str] | None = None
) -> list[str]:
    """The engine thread's host time per step period by phase (``bench_vllm --trace``; ``step_trace.PHASE_COLS``),
    where measured: a step whose phases fill its period is paced by the host, not the GPU. The drafting hooks' time
    (capture in sample, fill and drafting in execute, the drafting's wait for the step's tokens included) is part of
    those phases, shown beside them."""

    def cell(r: dict[str, Any]) -> str:
        c = r["host_phase_ms"]
        parts = [c.get(col, 0.0) for col in PHASE_COLS]
        hooks = r.get("draft_ms_per_step")
        return (
            " + ".join(f"{v:.2f}" for v in parts)
            + f" = {sum(parts):.2f} of {c['period_ms']:.2f}"
            + (f"; drafting hooks {hooks:.2f}" if hooks else "")
        )

    timed = [r for r in mine if r.get("host_phase_ms")]
    if not timed:
        return []
    title = (
        f"### {name}: host ms per step period (engine thread): schedule + execute + sample + update = sum of the "
        "period; the drafting hooks within them"
    )
    return [title, "", *_grid(timed, batches, heads, cell), ""]


def _split_table(
    mine: list[dict[str, Any]], name: str, batches: list[int], heads: list[str] | None = None
) -> list[str]:
    """Schedule mode's gap split (``bench_vllm --trace``; ``step_trace.SPLIT_COLS``), where measured: the drafting's
    own time also as a share of the step (busy + gap), the part of the GPU's wait that the drafting itself causes
    (the rest of the wait: the host reaching the drafting late)."""

    def cell(r: dict[str, Any]) -> str:
        c = r["gap_split_ms"]
        late, drafting = c.get("host_late_share"), c.get("finish_ms", 0.0) - c.get("sync_ms", 0.0)
        step = (r.get("gpu_busy_ms_per_step") or 0.0) + (r.get("gpu_gap_ms_per_step") or 0.0)
        return (
            f"{c['held_ms']:.2f} + {c['after_ms']:.2f}; drafting {drafting:.2f}"
            + (f" ({100 * drafting / step:.1f}% of step)" if step > 0 else "")
            + (f"; host late {100 * late:.0f}%" if late is not None else "")
        )

    split = [r for r in mine if "held_ms" in (r.get("gap_split_ms") or {})]
    if not split:
        return []
    return [
        f"### {name}: GPU gap (ms) = held for drafts + after the wait; host drafting once the tokens arrived (ms, "
        "share of the step); host late = steps whose tokens were ready before the drafting began",
        "",
        *_grid(split, batches, heads, cell),
        "",
    ]


def _peer_table(rows: list[dict[str, Any]], name: str, batches: list[int], heads: list[str] | None = None) -> list[str]:
    """Tokens/s of each specdec method over the same run's peers (``add_ratios``), where any was measured."""
    return _method_table(
        rows,
        "speedup_vs_peers",
        batches,
        f"{name}: specdec tokens/s over the same run's peers",
        lambda c: ", ".join(f"{v:.2f}x {PEER_LABELS[p]}" for p, v in c.items()),
        heads,
    )


def _parts_table(
    mine: list[dict[str, Any]], name: str, batches: list[int], heads: list[str] | None = None
) -> list[str]:
    """The wait split by ``_waiting`` (shares of the step), where nospec-sync was measured."""
    return _method_table(
        mine,
        "gpu_wait_parts_share",
        batches,
        f"{name}: waiting split, share of step: synchronous scheduling + speculation (vLLM) + drafting",
        lambda c: f"{100 * c['sync_scheduling']:.1f}% + {100 * c['speculation']:.1f}% + {100 * c['drafting']:.1f}%",
        heads,
    )


def _method_table(
    rows: list[dict[str, Any]],
    key: str,
    batches: list[int],
    title: str,
    cell: Callable[[Any], str],
    heads: list[str] | None = None,
) -> list[str]:
    """A method x batch-size table of ``cell(row[key])`` over the rows that have ``key`` ([] if none has)."""
    mine = [r for r in rows if r.get(key)]
    if not mine:
        return []
    return [f"### {title}", "", *_grid(mine, batches, heads, lambda r: cell(r[key])), ""]


def rerender(path: Path) -> str:
    """The markdown of a results JSON, its ratios recomputed from the summary rows (results written before a ratio
    existed, or with ``nospec-v1`` as the only no-spec engine, get them)."""
    doc = json.loads(path.read_text())
    traces = read_step_traces(path, doc)  # inline or in the traces file beside it
    if traces:
        doc["summary"]["traces"] = traces
    add_ratios(doc["summary"]["rows"])
    _fill_late_shares(doc["summary"])
    return markdown(doc)


def _fill_late_shares(summary: dict[str, Any]) -> None:
    """Rows with a gap split but no ``host_late_share`` (results written before it existed) get it from their trace."""
    traces = summary.get("traces") or {}
    for r in summary["rows"]:
        split = r.get("gap_split_ms")
        if not split or "host_late_share" in split:
            continue
        key = trace_key(r["method"], r["dataset"], r)
        if key in traces:
            split["host_late_share"] = host_late_share(traces[key])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="benchmark results JSON files (bench_vllm's)")
    ap.add_argument("--write", action="store_true", help="write each markdown beside its JSON (same name, .md)")
    args = ap.parse_args(argv)
    for path in args.results:
        md = rerender(path)
        if args.write:
            path.with_suffix(".md").write_text(md)
        else:
            print(md)


if __name__ == "__main__":
    main()
