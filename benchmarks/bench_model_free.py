"""CPU cost of model-free drafters, interleaved per record so machine-load drift hits all drafters alike.

Each drafter keeps its own state (global trees persist across records, as in trace replay). For every
record, every drafter replays it in turn with the replay rule of ``specdec.eval.replay`` (draft -> longest
matching path accepted -> accepted + 1 bonus emitted -> extend), so all drafters see the same records at
nearly the same time. Timed: ``start`` (per prompt token), ``draft_batch`` and ``extend`` (per emitted
token), through the ``Drafter`` interface (TokenTree construction included). MAT is reported as a check
(it equals ``specdec-eval replay``'s). Usage::

    python -m benchmarks.bench_model_free openhands_swebench --limit 400 --drafters suffix arctic \
        --budget 16 --save-results cost_suffix_vs_arctic
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from specdec.drafters import build_drafter
from specdec.drafters.base import Drafter, DraftRequest

US = 1e6


@dataclass
class Cost:
    drafter: str
    records: int = 0
    steps: int = 0
    emitted: int = 0
    accepted: int = 0
    drafted: int = 0
    prompt_tokens: int = 0
    start_s: float = 0.0
    draft_s: float = 0.0
    update_s: float = 0.0

    def summary(self) -> dict:
        e = max(self.emitted, 1)
        return {
            **asdict(self),
            "mat": self.emitted / max(self.steps, 1),
            "acceptance_rate": self.accepted / max(self.drafted, 1),
            "draft_us_per_token": self.draft_s * US / e,
            "update_us_per_token": self.update_s * US / e,
            "draft_plus_update_us_per_token": (self.draft_s + self.update_s) * US / e,
            "start_us_per_prompt_token": self.start_s * US / max(self.prompt_tokens, 1),
        }


def replay_one(
    d: Drafter, cost: Cost, rid: str, prompt: list[int], resp: list[int], *, budget: int, tree: bool
) -> None:
    pc = time.perf_counter
    t0 = pc()
    d.start(rid, prompt)
    cost.start_s += pc() - t0
    req = [DraftRequest(rid, budget, tree)]
    pos = 0
    while pos < len(resp):
        t0 = pc()
        draft = d.draft_batch(req)[0]
        t1 = pc()
        acc = len(draft.match_length(resp[pos:]))
        emit = resp[pos : pos + acc + 1]
        t2 = pc()
        d.extend(rid, emit)
        t3 = pc()
        cost.draft_s += t1 - t0
        cost.update_s += t3 - t2
        cost.steps += 1
        cost.drafted += len(draft)
        cost.accepted += acc
        cost.emitted += len(emit)
        pos += len(emit)
    d.stop(rid)
    cost.records += 1
    cost.prompt_tokens += len(prompt)


def drafter_spec(text: str) -> str | dict:
    """``NAME`` or ``NAME:KEY=VALUE,...`` (values parsed as YAML), e.g. ``suffix:min_confidence=0.01``."""
    from specdec.eval.settings import parse_value

    name, _, opts = text.partition(":")
    if not opts:
        return name
    return {"name": name, **{k: parse_value(v) for k, v in (kv.split("=", 1) for kv in opts.split(","))}}


def run(records: Sequence, names: Sequence[str], *, budget: int, tree: bool) -> list[dict]:
    drafters = [build_drafter(drafter_spec(n)) for n in names]
    costs = [Cost(n) for n in names]
    for i, rec in enumerate(records):
        prompt, resp = rec.prompt_list(), rec.response_list()
        if not resp:
            continue
        for d, c in zip(drafters, costs):
            replay_one(d, c, f"r{i}", prompt, resp, budget=budget, tree=tree)
    return [c.summary() for c in costs]


def main(argv: list[str] | None = None) -> int:
    from specdec.eval.loaders import load_traces
    from specdec.eval.results import results_path, write_results

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sources", nargs="+", help="trace set names or paths")
    ap.add_argument("--limit", type=int, default=None, help="first N records (OpenHands: instances)")
    ap.add_argument(
        "--drafters",
        nargs="+",
        default=["suffix", "arctic"],
        help="NAME or NAME:KEY=VALUE,... (suffix:min_confidence=0.01)",
    )
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--tree", action="store_true")
    ap.add_argument("--save-results", default="cost_model_free")
    args = ap.parse_args(argv)
    rows = []
    for src in args.sources:
        name, records = load_traces(src, limit=args.limit)
        for row in run(records, args.drafters, budget=args.budget, tree=args.tree):
            row.update(dataset=name, budget=args.budget, tree=args.tree)
            rows.append(row)
            print(
                f"{name:24s} {row['drafter']:10s} MAT {row['mat']:.3f}  draft {row['draft_us_per_token']:7.2f} "
                f"+ update {row['update_us_per_token']:7.2f} = {row['draft_plus_update_us_per_token']:7.2f} us/tok"
                f"  start {row['start_us_per_prompt_token']:.2f} us/prompt tok",
                flush=True,
            )
    path = results_path(args.save_results)
    write_results(path, vars(args), rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
