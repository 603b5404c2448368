"""Prompt-lookup match finding: our hash index (``NgramIndex``) vs pyahocorasick, same answers, µs per step.

For every response position of the first records of a trace set, each method finds the longest n in
[min_n, max_n] whose last-n context tokens occurred earlier, and all the end positions of those earlier
occurrences (what ``NgramDrafter`` needs), then the context grows by one token:

* ``hash-index``: ``NgramIndex`` (tuple -> end positions), O(#lengths) probes and updates per token.
* ``ac-scan``: an Aho-Corasick automaton of the last-n patterns built per step, scanning the context.
* ``ac-trie``: a pyahocorasick trie (no automaton) keyed by the n-grams, used like our dict.

All methods must return identical matches (checked). Usage::

    python -m benchmarks.bench_ngram_lookup openhands_swebench --limit 2 --records 20 --positions 300
"""

from __future__ import annotations

import argparse
import time

from specdec.drafters.ngram import NgramIndex

SURROGATE_LO = 0xD800
SURROGATE_SKIP = 0x800


def tok_char(t: int) -> str:
    """Token id -> one unicode character (pyahocorasick keys are strings); skips the surrogate range."""
    return chr(t if t < SURROGATE_LO else t + SURROGATE_SKIP)


def ac_scan_match(ahocorasick, ctx: list[int], lengths: list[int]) -> tuple[int, list[int]] | None:
    text = "".join(tok_char(t) for t in ctx)
    last = len(ctx) - 1
    auto = ahocorasick.Automaton()
    for n in lengths:
        if last >= n:
            auto.add_word(text[last - n + 1 :], n)
    if not len(auto):
        return None
    auto.make_automaton()
    ends: dict[int, list[int]] = {n: [] for n in lengths}
    for end, n in auto.iter(text, 0, last):  # occurrences ending before `last`
        ends[n].append(end)
    for n in lengths:
        if ends[n]:
            return n, ends[n]
    return None


class AcTrie:
    """pyahocorasick's trie used as a map n-gram string -> end positions (incremental)."""

    def __init__(self, ahocorasick, tokens: list[int], lengths: list[int]) -> None:
        self.trie = ahocorasick.Automaton()
        self.text: list[str] = []
        self.lengths = lengths
        for t in tokens:
            self.append(t)

    def append(self, t: int) -> None:
        self.text.append(tok_char(t))
        end = len(self.text) - 1
        for n in self.lengths:
            if end + 1 >= n:
                key = "".join(self.text[end - n + 1 :])
                lst = self.trie.get(key, None)
                if lst is None:
                    self.trie.add_word(key, [end])
                else:
                    lst.append(end)

    def match(self, cands: int) -> tuple[int, list[int]] | None:
        last = len(self.text) - 1
        for n in self.lengths:
            if last < n:
                continue
            hit = self.trie.get("".join(self.text[last - n + 1 :]), None)
            if hit:
                ends = hit[:-1] if hit[-1] == last else hit
                if ends:
                    return n, list(ends[-cands:])
        return None


def run(records, *, min_n: int, max_n: int, positions: int, scan_context_cap: int, cands: int) -> list[dict]:
    import ahocorasick

    lengths = list(range(max_n, min_n - 1, -1))
    timers = {"hash-index": 0.0, "ac-trie": 0.0, "ac-scan": 0.0}
    build = {"hash-index": 0.0, "ac-trie": 0.0, "ac-scan": 0.0}  # indexing the prompt, once per record
    prompt_tokens = 0
    steps = {"hash-index": 0, "ac-trie": 0, "ac-scan": 0}
    mismatches = 0
    pc = time.perf_counter
    for rec in records:
        prompt, resp = rec.prompt_list(), rec.response_list()[:positions]
        prompt_tokens += len(prompt)
        t0 = pc()
        idx = NgramIndex(prompt, lengths, keep_all=True)
        build["hash-index"] += pc() - t0
        t0 = pc()
        act = AcTrie(ahocorasick, prompt, lengths)
        build["ac-trie"] += pc() - t0
        ctx = list(prompt)
        for tok in resp:
            t0 = pc()
            a = idx.longest_match(cands)
            t1 = pc()
            a = (a[0], sorted(a[1])) if a else None  # most recent first -> ascending, like the others
            b = act.match(cands)
            t2 = pc()
            timers["hash-index"] += t1 - t0
            timers["ac-trie"] += t2 - t1
            steps["hash-index"] += 1
            steps["ac-trie"] += 1
            if len(ctx) <= scan_context_cap:
                t3 = pc()
                c = ac_scan_match(ahocorasick, ctx, lengths)
                c = (c[0], c[1][-cands:]) if c else None
                timers["ac-scan"] += pc() - t3
                steps["ac-scan"] += 1
                mismatches += int(c != a)
            mismatches += int(a != b)
            t0 = pc()
            idx.extend([tok])
            t1 = pc()
            act.append(tok)
            t2 = pc()
            timers["hash-index"] += t1 - t0
            timers["ac-trie"] += t2 - t1
            ctx.append(tok)
    return [
        {
            "method": m,
            "steps": steps[m],
            "us_per_step": timers[m] * 1e6 / max(steps[m], 1),
            "build_us_per_prompt_token": build[m] * 1e6 / max(prompt_tokens, 1),
            "mismatches_vs_hash_index": mismatches,
        }
        for m in timers
    ]


def main(argv: list[str] | None = None) -> int:
    from specdec.eval.loaders import load_traces
    from specdec.eval.results import results_path, write_results

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", help="trace set name or path (see specdec-eval --help)")
    ap.add_argument("--limit", type=int, default=None, help="records (OpenHands: instances) to load")
    ap.add_argument("--records", type=int, default=20, help="records benchmarked")
    ap.add_argument("--positions", type=int, default=300, help="response positions per record")
    ap.add_argument("--min-n", type=int, default=2)
    ap.add_argument("--max-n", type=int, default=8)
    ap.add_argument("--max-candidates", type=int, default=8, help="most recent occurrences returned (ngram's)")
    ap.add_argument(
        "--scan-context-cap",
        type=int,
        default=20_000,
        help="skip ac-scan steps on longer contexts (it is O(context) per step)",
    )
    ap.add_argument("--save-results", default="ngram_lookup", help="results name under eval/results/")
    args = ap.parse_args(argv)
    name, records = load_traces(args.source, limit=args.limit)
    rows = run(
        records[: args.records],
        min_n=args.min_n,
        max_n=args.max_n,
        positions=args.positions,
        scan_context_cap=args.scan_context_cap,
        cands=args.max_candidates,
    )
    for r in rows:
        print(
            f"{name:24s} {r['method']:11s} steps {r['steps']:7d}  {r['us_per_step']:9.2f} us/step (lookup + "
            f"update)  build {r['build_us_per_prompt_token']:6.2f} us/prompt token  "
            f"mismatches {r['mismatches_vs_hash_index']}"
        )
    path = results_path(args.save_results)
    write_results(path, vars(args), [{"dataset": name, **r} for r in rows])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
