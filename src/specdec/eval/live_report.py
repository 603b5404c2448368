"""What a live run records and reports: ``MethodRun`` (one method's totals and per-prompt records over a prompt
set), its results entry (speedups against the peers, medians, slow prompts, drafting statistics) and the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdec.eval.checks import BASELINES, per_prompt_medians
from specdec.eval.settings import Setting


@dataclass
class MethodRun:
    """Totals and per-prompt records of one method over one prompt set."""

    method: str
    setting: Setting | None = None
    seconds: float = 0.0
    tokens: int = 0
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)

    def add_stats(self, s: Any) -> None:
        for key in (
            "steps",
            "drafted_tokens",
            "accepted_tokens",
            "emitted_tokens",
            "draft_seconds",
            "verify_seconds",
            "draft_errors",
        ):
            self.stats[key] = self.stats.get(key, 0) + getattr(s, key, 0)
        for key in ("per_position_accepted", "per_position_drafted"):
            cur = self.stats.setdefault(key, [])
            new = list(getattr(s, key, []))
            cur.extend([0] * (len(new) - len(cur)))
            for i, v in enumerate(new):
                cur[i] += v


def live_entry(name: str, run: MethodRun, runs: list[MethodRun]) -> dict[str, Any]:
    by = {r.method: r for r in runs}
    e: dict[str, Any] = {
        "dataset": name,
        "method": run.method,
        "prompts": len(run.per_prompt),
        "prompt_ids": [p["id"] for p in run.per_prompt],
        "new_tokens": run.tokens,
        "seconds": run.seconds,
        "tokens_per_second": run.tokens / run.seconds if run.seconds else 0.0,
        "reference": runs[0].method,
        "lossless_equal_prompts": sum(p["equal_to_reference"] for p in run.per_prompt),
        "mismatched_prompts": [p["id"] for p in run.per_prompt if not p["equal_to_reference"]],
    }
    for peer in BASELINES:
        if peer in by and run.seconds:
            e[f"speedup_vs_{peer.replace('-', '_')}"] = by[peer].seconds / run.seconds  # 1.0 for itself
    mine = [p["seconds"] for p in run.per_prompt]
    med = per_prompt_medians(
        mine, {peer: [p["seconds"] for p in by[peer].per_prompt] for peer in BASELINES if peer in by}
    )
    e["median_seconds"] = med.pop("median_seconds")
    e["slow_prompts"] = [{"id": run.per_prompt[i]["id"], "seconds": mine[i]} for i in med.pop("slow_indices")]
    e.update(med)
    if run.setting is not None:
        e.update(run.setting.describe())
        s = run.stats
        steps, emitted = s.get("steps", 0), s.get("emitted_tokens", 0)
        pa, pd = s.get("per_position_accepted", []), s.get("per_position_drafted", [])
        e.update(
            {
                "mat": emitted / steps if steps else 0.0,
                "acceptance_rate": s.get("accepted_tokens", 0) / s["drafted_tokens"]
                if s.get("drafted_tokens")
                else 0.0,
                "per_position_acceptance": [a / d if d else 0.0 for a, d in zip(pa, pd)],
                "per_position_accepted": pa,
                "per_position_drafted": pd,
                "steps": steps,
                "drafted_tokens": s.get("drafted_tokens", 0),
                "accepted_tokens": s.get("accepted_tokens", 0),
                "emitted_tokens": emitted,
                "drafted_per_step": s.get("drafted_tokens", 0) / steps if steps else 0.0,
                "draft_us_per_token": s.get("draft_seconds", 0.0) * 1e6 / emitted if emitted else 0.0,
                "verify_us_per_token": s.get("verify_seconds", 0.0) * 1e6 / emitted if emitted else 0.0,
                "draft_errors": s.get("draft_errors", 0),
            }
        )
    else:
        e.update({"drafter": run.method, "label": run.method})
    e["per_prompt"] = run.per_prompt
    return e


def _method(r: dict[str, Any]) -> str:
    """A method as the table names it: a baseline, or ``specdec`` + the drafter (+ ``tree``)."""
    if r.get("budget") is None:
        return str(r["method"])
    return f"specdec {r.get('drafter', '?')}{' tree' if r.get('tree') else ''}"


LIVE_LEGEND = {
    "method": "hf-greedy: Hugging Face greedy generate (the reference output); specdec-greedy: specdec without a "
    "drafter; hf-assisted: Hugging Face assisted generation with the draft model; specdec X: specdec with drafter X",
    "budget": "most draft tokens per request per step",
    "new tok": "tokens generated over the set",
    "tok/s": "new tokens per wall-clock second",
    "vs hf, vs greedy, vs assist": "wall-clock speedup over hf-greedy, specdec-greedy, hf-assisted (summed seconds "
    "of the same prompts)",
    "med vs hf": "median per-prompt speedup over hf-greedy",
    "med s": "median seconds per prompt",
    "MAT": "tokens emitted per verify step, bonus token included",
    "accept": "accepted / drafted tokens",
    "draft us": "CPU microseconds spent drafting per emitted token",
    "lossless": "prompts whose output equals the reference token for token",
}


def live_table(entries: list[dict[str, Any]]) -> str:
    from specdec.eval.report import _f, format_table, group_by_dataset

    x = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    cols = [
        ("method", "<", _method, str),
        ("budget", ">", lambda r: r.get("budget"), lambda v: "-" if v is None else str(v)),
        ("new tok", ">", lambda r: r["new_tokens"], str),
        ("tok/s", ">", lambda r: r["tokens_per_second"], _f(".1f")),
        ("vs hf", ">", lambda r: r.get("speedup_vs_hf_greedy"), x),
        ("vs greedy", ">", lambda r: r.get("speedup_vs_specdec_greedy"), x),
        ("vs assist", ">", lambda r: r.get("speedup_vs_hf_assisted"), x),
        ("med vs hf", ">", lambda r: r.get("median_speedup_vs_hf_greedy"), x),
        ("med s", ">", lambda r: r.get("median_seconds"), _f(".3f")),
        ("MAT", ">", lambda r: r.get("mat"), _f(".3f")),
        ("accept", ">", lambda r: r.get("acceptance_rate"), _f(".3f")),
        ("draft us", ">", lambda r: r.get("draft_us_per_token"), _f(".1f")),
        ("lossless", ">", lambda r: f"{r['lossless_equal_prompts']}/{r['prompts']}", str),
    ]
    parts = []
    for ds, rows in group_by_dataset(entries).items():
        parts.append(
            format_table(
                rows,
                cols,
                title=f"== live {ds}: {rows[0]['prompts']} prompts, reference output = {rows[0]['reference']}",
            )
        )
    return "\n\n".join(parts)
