"""Tables and plots of serving-benchmark runs (serve_bench's JSON), and merging the JSON of several device calls.

python -m benchmarks.serve_report --inputs a.json b.json --out-dir eval/results/serve   # merged .json/.md/.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from benchmarks.serve_common import ServeError, write_json
from benchmarks.serve_goals import goals, goals_markdown
from specdec.eval.report import save_png

INF_X_FACTOR = 1.25  # where "inf" sits on the rate axis, relative to the largest finite rate
COLUMNS = (
    ("TTFT p50", "p50_ttft_ms"),
    ("TTFT p99", "p99_ttft_ms"),
    ("TPOT p50", "p50_tpot_ms"),
    ("TPOT p99", "p99_tpot_ms"),
    ("ITL p50", "p50_itl_ms"),
    ("ITL p99", "p99_itl_ms"),
    ("out tok/s", "output_throughput"),
)


def _fmt(x: Any, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def markdown(doc: dict[str, Any]) -> str:
    """One table per dataset: a row per method and rate (ms for latencies)."""
    runs = doc.get("runs", [])
    lines = [
        f"# Serving benchmark ({doc.get('device', '?')})",
        "",
        (
            f"vLLM {doc.get('versions', {}).get('vllm', '?')}, model {doc.get('settings', {}).get('model', '?')}. "
            "Latencies in ms; acceptance = accepted / drafted tokens; tokens/step = 1 + accepted / drafts "
            "(vLLM's spec-decode counters from /metrics over the rate's window)."
        ),
        "",
    ]
    if doc.get("saturation"):
        sat = ", ".join(f"{k}: {v['rate']:.2f} req/s" for k, v in doc["saturation"].items())
        lines += [f"Saturation rate R of no speculation: {sat}.", ""]
    for dataset in dict.fromkeys(r["dataset"] for r in runs):
        head = ["method", "rate", "req/s", *(c for c, _ in COLUMNS), "acceptance", "tokens/step", "ok/failed"]
        lines += [f"## {dataset}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in (r for r in runs if r["dataset"] == dataset):
            b, s = r.get("bench", {}), r.get("spec", {})
            rate = "inf" if r["rate"] == "inf" else f"{r['rate']:.2f}"
            cells = [
                r["method"],
                r["rate_label"],
                rate,
                *(_fmt(b.get(k), 1 if "tok/s" in c else 2) for c, k in COLUMNS),
                f"{100 * s['acceptance']:.1f}%" if s.get("draft_tokens") else "-",
                _fmt(s.get("emitted_per_step")) if s.get("drafts") else "-",
                f"{b.get('completed', 0)}/{b.get('failed', 0)}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += goals_markdown(goals(doc))
    for err in doc.get("errors", []):
        lines.append(f"- {err['method']}: {err['error']}")
    return "\n".join(lines) + "\n"


def _x(rate: Any, top: float) -> float:
    return top * INF_X_FACTOR if rate == "inf" else float(rate)


def plot(doc: dict[str, Any], path: Path) -> str:
    """TPOT p50 and output tokens/s against request rate, one line per method, a row per dataset; returns the
    path or why no PNG was written (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "PNG skipped: matplotlib missing (run `python -m benchmarks.serve_report` on the CPU side)"
    runs = doc.get("runs", [])
    datasets = list(dict.fromkeys(r["dataset"] for r in runs)) or ["none"]
    fig, axes = plt.subplots(len(datasets), 2, figsize=(11, 3.6 * len(datasets)), squeeze=False)
    for row, dataset in enumerate(datasets):
        mine = [r for r in runs if r["dataset"] == dataset]
        finite = [float(r["rate"]) for r in mine if r["rate"] != "inf"]
        top = max(finite) if finite else 1.0
        for method in dict.fromkeys(r["method"] for r in mine):
            pts = sorted(((_x(r["rate"], top), r["bench"]) for r in mine if r["method"] == method), key=lambda p: p[0])
            xs = [p[0] for p in pts]
            axes[row][0].plot(xs, [p[1].get("p50_tpot_ms", math.nan) for p in pts], marker="o", label=method)
            axes[row][1].plot(xs, [p[1].get("output_throughput", math.nan) for p in pts], marker="o", label=method)
        for col, ylabel in enumerate(("TPOT p50 (ms)", "output tokens/s")):
            ax = axes[row][col]
            ax.set_title(f"{dataset}: {ylabel}")
            ax.set_xlabel(f"request rate (req/s; inf at {INF_X_FACTOR}x the largest)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, path)
    plt.close(fig)
    return str(path)


def write_outputs(doc: dict[str, Any], out_dir: Path, stem: str) -> dict[str, str]:
    """``stem``.json, .md and .png under ``out_dir``."""
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md", "png": out_dir / f"{stem}.png"}
    doc["png"] = plot(doc, paths["png"])
    doc["goals"] = goals(doc)
    write_json(paths["json"], doc)
    paths["md"].write_text(markdown(doc))
    return {k: str(v) for k, v in paths.items()}


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs, errors and saturation rates of several device calls in one document (the first's provenance, every
    call's command kept)."""
    if not docs:
        raise ServeError("no inputs to merge: pass serve_bench JSON files with --inputs")
    out = {**docs[0], "commands": [d.get("command") for d in docs], "runs": [], "errors": [], "saturation": {}}
    for d in docs:
        out["runs"] += d.get("runs", [])
        out["errors"] += d.get("errors", [])
        out["saturation"].update(d.get("saturation") or {})
    return out


def _load(path: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ServeError(
            f"{path}: cannot read a serve_bench result ({type(exc).__name__}): pass the .json a serve_bench run wrote"
        ) from None
    if "runs" not in doc:
        raise ServeError(f"{path}: no 'runs' key: pass the .json a serve_bench run wrote")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", nargs="+", required=True)
    ap.add_argument("--out-dir", default="eval/results/serve")
    ap.add_argument("--stem", default="serve_bench")
    args = ap.parse_args(argv)
    try:
        paths = write_outputs(merge([_load(p) for p in args.inputs]), Path(args.out_dir), args.stem)
    except ServeError as exc:
        print(f"serve_report: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
