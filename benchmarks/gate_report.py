"""The GPU gate's report: verdicts from the raw numbers (``gate_rules``), one terminal table (<= 120 columns), the
results JSON + markdown, and the merge of several calls' results files (the two GPUs' halves, TP=1 + TP=2, serve).

    python -m benchmarks.gate_report A.json [B.json ...] [--out eval/results/merged.json]

A results document: ``{"kind": "specdec-gate", "gates": {"tp1": {"engines": {method: worker result}, ...}},
"serve": {check: result}, "sources": [{command, device, versions, ...}], ...}``. Verdicts are computed when the
table is drawn, so a merge judges every cell against the no-speculation engine it now has.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks import gate_rules as rules
from benchmarks.gate_compare import BEFORE, CANDIDATE, REFERENCE, compare, render_compare
from benchmarks.gate_metrics import cell_speeds, mean_speed, mismatches, speed
from benchmarks.gate_serve_report import join_servers, render_serve, serve_rows
from benchmarks.gate_tables import fmt as _f
from benchmarks.gate_tables import render_plugin, render_walls
from benchmarks.gate_worker import base_method

KIND = "specdec-gate"
PEER = "suffix"  # vLLM's own suffix method: the ×suffix column
WIDTH = 120


def cell_row(key: str, engines: dict[str, Any]) -> dict[str, Any]:
    """Everything the table shows of one cell, verdicts included."""
    nos = engines.get(REFERENCE, {}).get("cells", {}).get(key)
    ref = mean_speed(nos)  # no speculation's speed: the mean of its repeats
    row: dict[str, Any] = {"key": key, "nospec_tps": ref, "repeat4": (nos or {}).get("repeat4")}
    runs = cell_speeds(nos)
    row["repeat_diff"] = rules.repeat_diff(*runs[:2]) if len(runs) >= 2 else None
    row["void"] = len(runs) >= 2 and rules.repeats_void(*runs[:2])
    for m, eng in engines.items():
        cell = eng.get("cells", {}).get(key)
        if m == REFERENCE or not cell:
            continue
        first = cell["runs"][0]
        rerun = cell.get("rerun")
        temperature = cell.get("temperature", 0.0)
        greedy = not temperature
        row[m] = {
            "tps": speed(first, temperature),
            "x_nospec": rules.ratio(speed(first, temperature), ref),
            "x_rerun": rules.ratio(speed(rerun, temperature) if rerun else None, ref),
            "rerun_steps": (engine_steps(first), engine_steps(rerun)) if rerun else None,
            "emit": first.get("emitted_per_step"),
            "mismatch": mismatches(nos.get("digests", []), cell.get("digests", [])) if nos and greedy else None,
            "repeat4": cell.get("repeat4"),  # its own outputs' (gate_compare: does the cell count)
            # what the engine did (gate_compare's same-work cells: the run's noise between two engines)
            "digests": cell.get("digests") if greedy else None,
            "drafted": first.get("draft_tokens"),
            "accepted": first.get("accepted_tokens"),
        }
    for m in (CANDIDATE, BEFORE):
        if m in row:
            row[m]["vs_nospec"] = rules.vs_nospec(row[m]["x_nospec"], row[m]["x_rerun"], row[m]["rerun_steps"])
    if CANDIDATE in row and PEER in row:
        row[CANDIDATE]["x_suffix"] = rules.ratio(row[CANDIDATE]["tps"], row[PEER]["tps"])
        row[CANDIDATE]["vs_suffix"] = rules.vs_suffix(row[CANDIDATE]["x_suffix"])
    return row


def engine_steps(run: dict[str, Any]) -> float:
    """The engine steps of a run as the plugin counted them (its drafting rank's stats; 0 when it has none)."""
    return float(next((p["steps"] for p in run.get("plugin") or [] if "steps" in p), 0.0))


def engine_rows(engines: dict[str, Any]) -> list[dict[str, Any]]:
    """Per engine: start seconds and KV-cache tokens, each against no speculation's, with verdicts."""
    nos = engines.get(REFERENCE, {})
    out = []
    for m, eng in ordered(engines):
        row = {
            "method": m,
            "gpus": eng.get("gpus", ""),
            "start_s": eng.get("start_s"),
            "compile_s": eng.get("log", {}).get("compile_s"),
            "compile_cached": eng.get("log", {}).get("compile_cached"),
            "graph_gib": eng.get("log", {}).get("graph_mem_gib"),
            "kv_tokens": eng.get("kv_tokens"),
            "x_start": rules.ratio(eng.get("start_s"), nos.get("start_s")),
            "x_kv": rules.ratio(eng.get("kv_tokens"), nos.get("kv_tokens")),
        }
        if m != REFERENCE:
            row["start"] = rules.start_verdict(eng.get("start_s"), nos.get("start_s"))
            row["kv"] = rules.kv_verdict(eng.get("kv_tokens"), nos.get("kv_tokens"))
        out.append(row)
    return out


def ordered(engines: dict[str, Any]) -> list[tuple[str, Any]]:
    """Engines in the gate's method order (nospec, suffix, specdec, specdec-before), others after."""
    rank = {m: i for i, m in enumerate((REFERENCE, PEER, CANDIDATE, BEFORE))}
    return sorted(engines.items(), key=lambda kv: rank.get(kv[0], len(rank)))


def cell_keys(engines: dict[str, Any]) -> list[str]:
    """Every cell any engine measured, no speculation's order first."""
    keys: dict[str, None] = {}
    for m in [REFERENCE, *engines]:
        keys.update(dict.fromkeys(engines.get(m, {}).get("cells", {})))
    return list(keys)


def gate_verdicts(gate: dict[str, Any]) -> dict[str, Any]:
    """One TP's verdicts: per cell and engine (the candidate's), whether the run is void, and the overall one."""
    engines = gate.get("engines", {})
    rows = [cell_row(k, engines) for k in cell_keys(engines)]
    eng = engine_rows(engines)
    found = [v for r in rows if CANDIDATE in r for v in (r[CANDIDATE].get("vs_nospec", ("-",))[0],)]
    found += [r[CANDIDATE]["vs_suffix"] for r in rows if "vs_suffix" in r.get(CANDIDATE, {})]
    found += [e[k] for e in eng if e["method"] == CANDIDATE for k in ("start", "kv")]
    void = any(r["void"] for r in rows)
    return {"cells": rows, "engines": eng, "void": void, "overall": rules.VOID if void else rules.overall(found)}


def _vn(m: dict[str, Any] | None) -> str:
    if not m or "vs_nospec" not in m:
        return "-"
    verdict, _ = m["vs_nospec"]
    if m.get("x_rerun") is None:
        return verdict
    return f"{verdict} r{m['x_rerun']:.2f}{'' if rules.rerun_counts(m.get('rerun_steps')) else '*'}"


def render_cells(rows: list[dict[str, Any]]) -> list[str]:
    head = (
        f"{'cell':<11}{'nospec':>8}{'Δrep':>6}{'rep4':>6} | {'specdec':>7}{'×suf':>6}{'emit':>6}{'mism':>5} | "
        f"{'before':>6}{'emit':>6} | {'suffix':>6}{'emit':>6} | {'vs nospec':<13}{'vs suffix':<9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        c, b, s = r.get(CANDIDATE, {}), r.get(BEFORE, {}), r.get(PEER, {})
        lines.append(
            f"{r['key'].replace('/', ' '):<11}{_f(r['nospec_tps'], '.0f', 8)}{_f(_pct(r['repeat_diff']), '.1f', 5)}%"
            f"{_f(r['repeat4'], '.2f', 6)} | {_f(c.get('x_nospec'), '.2f', 7)}{_f(c.get('x_suffix'), '.2f', 6)}"
            f"{_f(c.get('emit'), '.2f', 6)}{_f(c.get('mismatch'), 'd', 5)} | {_f(b.get('x_nospec'), '.2f', 6)}"
            f"{_f(b.get('emit'), '.2f', 6)} | {_f(s.get('x_nospec'), '.2f', 6)}{_f(s.get('emit'), '.2f', 6)} | "
            f"{_vn(c):<13}{c.get('vs_suffix', '-'):<9}" + (" VOID" if r["void"] else "")
        )
    return lines


def render_references(rows: list[dict[str, Any]]) -> list[str]:
    """The other engines of the run (nospec-v1, ngram, specdec-sync: references, no verdict), x nospec and emit per
    cell; nothing when there are none."""
    named = {REFERENCE, CANDIDATE, BEFORE, PEER}
    refs = sorted({m for r in rows for m in r if isinstance(r[m], dict) and m not in named})
    if not refs:
        return []
    head = f"{'cell':<11}" + "".join(f"{m + ' ×nospec':>22}{'emit':>6}" for m in refs)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = "".join(
            f"{_f(r.get(m, {}).get('x_nospec'), '.2f', 22)}{_f(r.get(m, {}).get('emit'), '.2f', 6)}" for m in refs
        )
        lines.append(f"{r['key'].replace('/', ' '):<11}{cells}")
    return [*lines, ""]


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x


def render_engines(rows: list[dict[str, Any]]) -> list[str]:
    head = f"{'engine':<16}{'GPU':>5}{'start s':>9}{'×nospec':>9}{'compile s':>11}{'graphs GiB':>11}"
    head += f"{'KV tokens':>12}{'×nospec':>9}"
    head += "  start  KV"
    lines = [head, "-" * len(head)]
    for r in rows:
        comp = "cache" if r["compile_cached"] else _f(r["compile_s"], ".0f", 0)
        lines.append(
            f"{r['method']:<16}{r['gpus'] or '-':>5}{_f(r['start_s'], '.0f', 9)}{_f(r['x_start'], '.2f', 9)}"
            f"{comp:>11}{_f(r.get('graph_gib'), '.2f', 11)}{_f(r['kv_tokens'], ',d', 12)}{_f(r['x_kv'], '.3f', 9)}  "
            f"{r.get('start', '-'):<6} {r.get('kv', '-')}"
        )
    return lines


RULES_LINE = (
    f"rules: ×nospec >= {rules.NOSPEC_PASS} PASS (under it: re-run once, PASS if the mean >= {rules.RERUN_MEAN_PASS}); "
    f"×suffix >= {rules.SUFFIX_PASS} PASS, {rules.SUFFIX_WARN}-{rules.SUFFIX_PASS} WARN, < {rules.SUFFIX_WARN} FAIL; "
    f"start <= {rules.START_MAX}x, KV >= {rules.KV_MIN:.0%} of nospec; serve TPOT <= {rules.TPOT_MAX}x; "
    f"VOID if nospec's repeats differ > {rules.REPEAT_MAX_DIFF:.0%}"
)
LEGEND = (
    "nospec: output tok/s (mean of 2 repeats); Δrep: their difference; rep4: share of repeated 4-grams in nospec's "
    "outputs; specdec/before/suffix: × nospec (r: the re-run's ratio; r*: not counted, it took fewer engine steps: "
    "the cache helped); ×suf: specdec ÷ suffix; emit: emitted tokens per drafted step (vLLM counters); mism: bf16 "
    "outputs differing from nospec (greedy cells); sampled cells (s8): nospec and the ratios are the requests' own "
    "decode rate (their tokens over first to last token), not output tokens over the wall; serve 'drafting': the "
    "plugin's totals since the server started (steps, steps with drafts, verified drafted steps of requests before "
    "any back-off / after a recovery)"
)


def render(doc: dict[str, Any]) -> str:
    """The whole report: a header per source, then per TP the cells and engines tables, the serve checks, the
    overall verdict and the rules."""
    out = []
    for src in doc.get("sources", []):
        v = src.get("versions", {})
        out.append(
            f"{src.get('part', '?')} on {src.get('device', {}).get('label', '?')}: specdec {src.get('commit', '?')[:7]}"
            f" (before {(src.get('before_commit') or '-')[:7]}), vLLM {v.get('vllm', '?')}, torch {v.get('torch', '?')}"
            + (" PARTIAL" if src.get("partial") else "")
        )
    verdicts = []
    evs = {tp: gate_verdicts(gate) for tp, gate in sorted(doc.get("gates", {}).items())}
    for tp, gate in sorted(doc.get("gates", {}).items()):
        ev = evs[tp]
        verdicts.append(ev["overall"])
        out += ["", f"== cells {tp} ({gate.get('model', '')}) ==", *render_cells(ev["cells"]), ""]
        out += render_references(ev["cells"])
        out += render_plugin(gate.get("engines", {}).get(CANDIDATE, {}))
        out += render_walls(gate.get("engines", {}), (REFERENCE, CANDIDATE, BEFORE))
        out += render_engines(ev["engines"])
        out += origin_notes(gate, doc.get("sources", []))
        if gate.get("skipped"):
            out.append(f"not run or no result (see the log): {', '.join(gate['skipped'])}")
    if doc.get("serve"):
        rows = serve_rows(doc["serve"])
        verdicts += [r["verdict"] for r in rows]
        out += ["", "== low-acceptance serving ==", *render_serve(rows)]
    out += render_compare(compare({tp: ev["cells"] for tp, ev in evs.items()}, doc.get("serve", {})))
    out += ["", f"GATE: {rules.overall(verdicts)}", _wrap(RULES_LINE), _wrap(LEGEND)]
    return "\n".join(out)


def origin_notes(gate: dict[str, Any], sources: list[dict[str, Any]]) -> list[str]:
    """Where an engine did not run the tree it should: the before engine's process or its engine's workers
    importing another ``specdec`` than the base commit's, or an engine whose native suffix core did not load."""
    wanted = {s.get("before_commit") for s in sources if s.get("before_commit")}
    notes = []
    for m, eng in ordered(gate.get("engines", {})):
        origin = eng.get("origin", {})
        mine = origin.get("worker", {})
        files = {w.get("file") for w in origin.get("engine", [])} - {mine.get("file")}
        if files:
            notes.append(f"note: {m}'s engine workers import specdec from {', '.join(map(str, files))}")
        if base_method(m) == BEFORE and mine.get("commit") not in wanted:
            notes.append(f"note: {m} ran {mine.get('file')} (commit {mine.get('commit')}), not {', '.join(wanted)}")
        if m.startswith(CANDIDATE) and not mine.get("native_suffix", True):
            notes.append(f"note: {m} ran without the native suffix core ({mine.get('import_error', '')[:60]})")
    return notes


def _wrap(text: str) -> str:
    lines, line = [], ""
    for word in text.split(" "):
        if len(line) + len(word) + 1 > WIDTH:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join([*lines, line])


def markdown(doc: dict[str, Any]) -> str:
    cmds = "\n".join(f"- `{s.get('command', '')}`" for s in doc.get("sources", []))
    return f"# specdec GPU gate\n\n```text\n{render(doc)}\n```\n\nCommands:\n{cmds}\n"


def merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document from several calls' (same or different TPs, serve): engines joined per TP (a method measured
    twice keeps the run with more cells), serve checks joined, every source kept."""
    out: dict[str, Any] = {"kind": KIND, "schema": 1, "gates": {}, "serve": {}, "sources": []}
    for doc in docs:
        if doc.get("kind") != KIND:
            raise SystemExit(f"not a gate results file (kind {doc.get('kind')!r}): {doc.get('path', '?')}")
        out["sources"] += doc.get("sources", [])
        for name, check in doc.get("serve", {}).items():
            out["serve"][name] = join_servers(out["serve"].get(name), check)
        for tp, gate in doc.get("gates", {}).items():
            mine = out["gates"].setdefault(tp, {"engines": {}, "skipped": [], "model": gate.get("model", "")})
            for m, eng in gate.get("engines", {}).items():
                have = mine["engines"].get(m)
                if have is None or len(eng.get("cells", {})) > len(have.get("cells", {})):
                    mine["engines"][m] = eng
            mine["skipped"] = [s for s in [*mine["skipped"], *gate.get("skipped", [])] if s not in mine["engines"]]
    return out


def results_name(doc: dict[str, Any], part: str) -> str:
    """``<date>_<device>_gate_<part>_<commit7>``."""
    src = doc["sources"][-1]
    return f"{time.strftime('%Y-%m-%d')}_{src['device']['label']}_gate_{part}_{src['commit'][:7]}"


def write(doc: dict[str, Any], out_dir: Path, name: str) -> Path:
    """The results JSON (with the verdicts as drawn) and its markdown twin; returns the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    evs = {tp: gate_verdicts(g) for tp, g in doc.get("gates", {}).items()}
    stored = {**doc, "verdicts": {tp: _summary(ev) for tp, ev in evs.items()}}
    if doc.get("serve"):
        stored["verdicts"]["serve"] = serve_rows(doc["serve"])
    stored["verdicts"]["before_after"] = compare({tp: ev["cells"] for tp, ev in evs.items()}, doc.get("serve", {}))
    path = out_dir / f"{name}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(stored, separators=(",", ":")))
    tmp.replace(path)
    (out_dir / f"{name}.md").write_text(markdown(doc))
    return path


def _summary(ev: dict[str, Any]) -> dict[str, Any]:
    cells = {r["key"]: {k: r[k] for k in ("nospec_tps", "repeat_diff", "void") if k in r} for r in ev["cells"]}
    for r in ev["cells"]:
        c = r.get(CANDIDATE, {})
        cells[r["key"]].update(
            {k: c[k] for k in ("x_nospec", "x_rerun", "x_suffix", "vs_nospec", "vs_suffix") if k in c}
        )
    return {"overall": ev["overall"], "void": ev["void"], "cells": cells, "engines": ev["engines"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="gate results JSON files (one call's, or several to merge)")
    ap.add_argument("--out", default="", help="write the merged results here (JSON; the .md beside it)")
    args = ap.parse_args(argv)
    docs = []
    for f in args.files:
        try:
            docs.append({**json.loads(Path(f).read_text()), "path": f})
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{f}: cannot read a gate results file ({exc})") from None
    doc = merge(docs)
    print(render(doc))
    if args.out:
        out = Path(args.out)
        print(f"wrote {write(doc, out.parent, out.name.removesuffix('.json'))}")


if __name__ == "__main__":
    main()
