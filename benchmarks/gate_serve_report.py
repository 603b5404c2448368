"""The GPU gate's serve checks in its report: the rows of each check (each server's median-TPOT ratio to its own
call's no speculation: the median of its runs' ratios, each run paired by seed; the verdict on the candidate's), their
table, and the join of one check measured in two calls (``gate.py --before-round``)."""

from __future__ import annotations

from typing import Any

from benchmarks import gate_rules as rules
from benchmarks.gate_compare import CANDIDATE, REFERENCE, reference_of, run_ratios, serve_ratio
from benchmarks.gate_tables import fmt as _f


def serve_rows(serve: dict[str, Any]) -> list[dict[str, Any]]:
    """Per serve check: the TPOT ratio (speculation / none) and its verdict, or whether the server started and
    answered."""
    out = []
    for name, check in serve.items():
        if "skipped" in check:
            out.append({"check": name, "verdict": rules.NONE, "note": f"not run: {check['skipped']}"[:33]})
            continue
        if check.get("kind") == "tpot":
            out += _tpot_rows(name, check.get("servers", {}))
        for label, srv in check.get("servers", {}).items():
            # a server's start and answer are on the first of its checks (another rate's check ran on the same
            # server: it holds neither, unless the start failed)
            if label.startswith(CANDIDATE) and "skipped" not in srv and ("answered" in srv or "error" in srv):
                ok = bool(srv.get("answered"))
                note = f"start {srv.get('start_s') or 0:.0f} s, " + (
                    "answered" if ok else srv.get("error", "no answer")
                )
                out.append(
                    {"check": f"{name} {label} serves", "verdict": rules.PASS if ok else rules.FAIL, "note": note}
                )
                if srv.get("plugin"):  # the plugin's totals since start: steps, of them with drafts (why)
                    note = _plugin_note(srv["plugin"])
                    out.append({"check": f"{name} {label} drafting", "verdict": "-", "note": note})
    return out


def _tpot_rows(name: str, servers: dict[str, Any]) -> list[dict[str, Any]]:
    """A TPOT check's rows: the candidate's ratio and verdict, then each other speculating server's and each other
    no-speculation server's (the calls' spread) for reference; each against its own call's no speculation, with
    the ratio of each measured run (``runs``: same seeds, same call)."""

    def row(check: str, label: str, ref: dict[str, Any]) -> dict[str, Any]:
        srv = servers.get(label, {})
        ms, none_ms = srv.get("bench", {}).get("median_tpot_ms"), ref.get("bench", {}).get("median_tpot_ms")
        emit = srv.get("spec", {}).get("emitted_per_step") if label.startswith(CANDIDATE) else None
        r = {"check": check, "none_ms": none_ms, "spec_ms": ms, "ratio": serve_ratio(srv, ref), "emit": emit}
        return {**r, "runs": run_ratios(srv, ref), "verdict": "-"}

    first = row(name, CANDIDATE, reference_of(servers, CANDIDATE))
    rows = [{**first, "verdict": rules.tpot_verdict(first["ratio"])}]
    for label, srv in servers.items():
        if label in (REFERENCE, CANDIDATE) or "skipped" in srv:
            continue
        # another call's no speculation against the verdict's (the calls' spread); a speculating server against its own
        ref = servers.get(REFERENCE, {}) if label.startswith(REFERENCE) else reference_of(servers, label)
        rows.append(row(f"{name} {label}", label, ref))
    return rows


def _plugin_note(p: dict[str, int]) -> str:
    """``2104 steps, 451 drafted, 380/71``: the server's steps, those that verified a draft, and the verified
    drafted steps of requests before any back-off / after a recovery (at most 33 characters)."""
    note = f"{p.get('steps', 0)} steps, {p.get('drafted_steps', 0)} drafted"
    if "outcomes_first" in p:
        note += f", {p['outcomes_first']}/{p.get('outcomes_recovered', 0)}"
    return note[:33]


def render_serve(rows: list[dict[str, Any]]) -> list[str]:
    head = f"{'serve check':<34}{'none ms':>9}{'server ms':>11}{'ratio':>7}{'emit':>6}  verdict"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "ratio" in r or "none_ms" in r:
            nums = f"{_f(r.get('none_ms'), '.2f', 9)}{_f(r.get('spec_ms'), '.2f', 11)}{_f(r.get('ratio'), '.3f', 7)}"
            runs = " ".join(f"{x:.3f}" for x in r.get("runs") or [])
            tail = f"  {r['verdict']:<7} runs {runs}" if runs else f"  {r['verdict']}"
            lines.append(f"{r['check']:<34}{nums}{_f(r.get('emit'), '.2f', 6)}{tail}")
        else:
            lines.append(f"{r['check']:<34}{r.get('note', ''):<33}  {r['verdict']}")
    return lines


def join_servers(have: dict[str, Any] | None, check: dict[str, Any]) -> dict[str, Any]:
    """A serve check measured in two calls (``gate.py --before-round``: the before's servers in a call of their own):
    one check whose servers are both calls'. A label the first call already has gets ``-2`` (its no-speculation
    server: ``nospec-2``, the calls' spread). Every server the later call measured is judged against that call's own
    no-speculation server (``reference``): one call's servers share the host's state and the bench's seeds, two
    calls' do not, and two calls' no-speculation servers differ by more than the gate's serving bounds."""
    if not have or "servers" not in have:
        return check
    if "servers" not in check:
        return have
    servers = dict(have["servers"])
    measured = {label: srv for label, srv in check["servers"].items() if "skipped" not in srv}
    own = REFERENCE if REFERENCE not in servers or "skipped" in servers[REFERENCE] else f"{REFERENCE}-2"
    for label, server in check["servers"].items():
        if label in measured and REFERENCE in measured and label != REFERENCE:
            server = {**server, "reference": own}
        if label not in servers or "skipped" in servers[label]:  # new, or skipped for time by the earlier call
            servers[label] = server
        elif label in measured:
            servers[f"{label}-2"] = server
    return {**have, "servers": servers}
