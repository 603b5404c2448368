"""The GPU gate's measurements from what vLLM hands back (no vLLM import): its spec-decode counters from
``LLM.get_metrics()``, the share of repeated 4-grams in outputs, output digests for the mismatch count, the
`vllm bench serve` result, and start-up phases read from an engine's log."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SPEC_PREFIX = "vllm:spec_decode_num_"  # vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}[_total]
SPEC_KEYS = ("drafts", "draft_tokens", "accepted_tokens")
NGRAM = 4  # repeated n-grams: the 53M target loops on some prompts, which flatters every drafter
DIGEST_CHARS = 12
# `vllm bench serve` keys kept per run (vLLM 0.26's result JSON; the text summary's labels as a fallback)
BENCH_KEYS = ("median_tpot_ms", "mean_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "median_itl_ms", "output_throughput")
BENCH_TEXT = {
    "median_tpot_ms": r"Median TPOT \(ms\):\s*([\d.]+)",
    "mean_tpot_ms": r"Mean TPOT \(ms\):\s*([\d.]+)",
    "p99_tpot_ms": r"P99 TPOT \(ms\):\s*([\d.]+)",
    "median_ttft_ms": r"Median TTFT \(ms\):\s*([\d.]+)",
    "median_itl_ms": r"Median ITL \(ms\):\s*([\d.]+)",
    "output_throughput": r"Output token throughput \(tok/s\):\s*([\d.]+)",
    "completed": r"Successful requests:\s*(\d+)",
}
# engine log lines (vLLM 0.26) -> start-up phases in seconds; "compile_cached" when the graphs came from the cache
LOG_PHASES = {
    "weights_s": r"Loading weights took ([\d.]+) seconds",
    "model_load_s": r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) seconds",
    "compile_s": r"torch\.compile took ([\d.]+) s in total",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "graph_mem_gib": r"Estimated CUDA graph memory: ([\d.]+) GiB total",  # subtracted from the KV cache's memory
    "kv_mem_gib": r"Available KV cache memory: ([\d.]+) GiB",
}
LOG_GRAPH_COUNTS = r"Profiling CUDA graph memory: ([^\n]+)"  # "PIECEWISE=64 (largest=1088), FULL=160 (...)"
LOG_CACHE_HIT = r"Directly load the compiled graph"
# the plugin's statistics line (core/reporting.py): periodic, "idle:" (the totals whenever the engine goes idle) or
# "final:" (at exit, where the process gets to run its exit hooks); the last one in a server's log
PLUGIN_LINE = re.compile(
    r"specdec(?:: final|: idle)?: (?P<steps>\d+) steps \((?P<drafted_steps>\d+) with drafts\), "
    r"drafted (?P<drafted>\d+), accepted (?P<accepted>\d+) .*?\((?:low acceptance; )?(?P<back_offs>\d+) back-offs, "
    r"(?P<recoveries>\d+) recoveries, (?P<newcomers_held>\d+) newcomers held so far"
    r"(?:; verified drafted steps (?P<outcomes_first>\d+) before any back-off, (?P<outcomes_recovered>\d+) after a "
    r"recovery)?(?:; (?P<gated_steps>\d+) steps gated)?\)"
)


def spec_counts(metrics: Iterable[Any]) -> dict[str, float]:
    """vLLM's spec-decode counters in a ``get_metrics()`` list, summed over label sets: {"drafts", "draft_tokens",
    "accepted_tokens"} (0 where absent; the per-position vector, which has ``values`` not ``value``, is skipped)."""
    out = dict.fromkeys(SPEC_KEYS, 0.0)
    for m in metrics:
        name = str(getattr(m, "name", ""))
        if not name.startswith(SPEC_PREFIX) or not hasattr(m, "value"):
            continue
        key = name[len(SPEC_PREFIX) :].removesuffix("_total")
        if key in out:
            out[key] += float(m.value)
    return out


def request_rate(results: Iterable[Any]) -> float | None:
    """The requests' own decode rate over ``LLM.generate``'s results: their generated tokens after the first over
    the engine-core time from each one's first token to its last (``RequestOutput.metrics``, kept with
    ``disable_log_stats=False``); None where no request has those timestamps."""
    tokens, seconds = 0, 0.0
    for r in results:
        m = getattr(r, "metrics", None)
        first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
        n = len(r.outputs[0].token_ids) if getattr(r, "outputs", None) else 0
        if n > 1 and first and last > first:
            tokens, seconds = tokens + n - 1, seconds + last - first
    return tokens / seconds if seconds > 0 else None


def wall_split(chunks: Iterable[Sequence[Any]]) -> dict[str, float] | None:
    """Where a cell's wall goes, summed over its closed batches (``LLM.generate`` calls), from each result's
    ``RequestOutput.metrics`` (engine-core time): ``first_tokens_s`` from a batch's first request queued to its last
    first token (prefill, chunked beside early decodes), ``tail_s`` from there to the batch's last token (the decode
    tail its slowest request sets), and that slowest request's tokens after its first and its own first-to-last time
    (``slowest_tokens``, ``slowest_s``). None where a batch has no timed request."""
    splits = [_batch_split(c) for c in chunks]
    if not splits or any(s is None for s in splits):
        return None
    return {k: sum(s[k] for s in splits) for k in splits[0]}  # type: ignore[index]


def _batch_split(results: Sequence[Any]) -> dict[str, float] | None:
    """``wall_split`` of one closed batch."""
    timed = []
    for r in results:
        m = getattr(r, "metrics", None)
        queued, first = getattr(m, "queued_ts", 0.0), getattr(m, "first_token_ts", 0.0)
        last = getattr(m, "last_token_ts", 0.0)
        n = len(r.outputs[0].token_ids) if getattr(r, "outputs", None) else 0
        if queued and first and last >= first >= queued:
            timed.append((queued, first, last, n))
    if not timed:
        return None
    last_first = max(t[1] for t in timed)
    slowest = max(timed, key=lambda t: t[2])
    return {
        "first_tokens_s": last_first - min(t[0] for t in timed),
        "tail_s": slowest[2] - last_first,
        "slowest_tokens": float(max(slowest[3] - 1, 0)),
        "slowest_s": slowest[2] - slowest[1],
    }


def speed(run: dict[str, Any] | None, temperature: float) -> float | None:
    """What a cell's run is judged on: its output tokens/s, or for a sampled cell (``temperature`` > 0) its
    requests' own decode rate (``request_tokens_per_s``) where the run has it. Sampling from the same seeds, two
    methods emit outputs of different lengths (a speculative step draws its random numbers differently), and a closed
    batch's wall is its longest request: with fewer tokens in the same wall, output tokens/s would judge the
    outputs' lengths, not the speed."""
    run = run or {}
    if temperature and run.get("request_tokens_per_s"):
        return run["request_tokens_per_s"]
    return run.get("tokens_per_s")


def cell_speeds(cell: dict[str, Any] | None) -> list[float]:
    """The speed (``speed``, at the cell's temperature) of each run of a cell that has one, in run order."""
    temperature = (cell or {}).get("temperature", 0.0)
    return [v for v in (speed(r, temperature) for r in (cell or {}).get("runs", [])) if v]


def mean_speed(cell: dict[str, Any] | None) -> float | None:
    """The mean of a cell's run speeds (``cell_speeds``): no speculation's reference for the cell."""
    vals = cell_speeds(cell)
    return sum(vals) / len(vals) if vals else None


def spec_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Counters over a window and the emitted tokens per drafted step, (drafts + accepted) / drafts (None: no
    drafts, e.g. no speculation)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_KEYS}
    d["emitted_per_step"] = (d["drafts"] + d["accepted_tokens"]) / d["drafts"] if d["drafts"] > 0 else None
    return d


def repeat_share(outputs: Sequence[Sequence[int]], n: int = NGRAM) -> float | None:
    """Share of n-gram positions whose n-gram already appeared earlier in the same output, over all outputs
    (None when no output is n tokens long)."""
    repeated = total = 0
    for ids in outputs:
        seen: set[tuple[int, ...]] = set()
        for i in range(len(ids) - n + 1):
            gram = tuple(ids[i : i + n])
            repeated += gram in seen
            seen.add(gram)
            total += 1
    return repeated / total if total else None


def digest(ids: Sequence[int]) -> str:
    """A short fingerprint of one output's token ids (mismatches are counted on these across result files)."""
    return hashlib.sha1(json.dumps(list(map(int, ids))).encode()).hexdigest()[:DIGEST_CHARS]


def mismatches(a: Sequence[str], b: Sequence[str]) -> int | None:
    """Outputs that differ between two digest lists of one cell (None when the lists do not line up)."""
    if len(a) != len(b) or not a:
        return None
    return sum(x != y for x, y in zip(a, b))


def bench_result(result: dict[str, Any] | None, text: str = "") -> dict[str, float]:
    """The kept figures of one `vllm bench serve` run: from its result JSON where there is one, else from its
    printed summary; {} when neither has a median TPOT."""
    out: dict[str, float] = {}
    for key in BENCH_KEYS + ("completed",):
        if result and isinstance(result.get(key), (int, float)):
            out[key] = float(result[key])
        elif text and (m := re.search(BENCH_TEXT[key], text)):
            out[key] = float(m.group(1))
    return out if "median_tpot_ms" in out else {}


def bench_windows(result: dict[str, Any] | None, windows: int) -> list[dict[str, float]]:
    """A `vllm bench serve --save-detailed` run's requests, in the order sent, cut into ``windows`` consecutive equal
    parts, each with its median / mean / p99 TPOT, median ITL and TTFT (ms) and its completed count: one run of
    ``windows`` x N requests gives ``windows`` paired samples (a server on the same seed got the same requests in
    each window). TPOT as vLLM counts it: the time after the first token over the tokens after it (a request's
    ITLs sum to it). [] when the run kept no per-request detail."""
    if not result or windows < 1 or not all(isinstance(result.get(k), list) for k in ("output_lens", "ttfts", "itls")):
        return []
    lens, ttfts, itls = result["output_lens"], result["ttfts"], result["itls"]
    errors = result.get("errors") or [""] * len(lens)
    n = len(lens) // windows
    out = []
    for w in range(windows):
        part = range(w * n, (w + 1) * n)
        ok = [i for i in part if not errors[i] and lens[i]]
        tpots = [sum(itls[i]) / (lens[i] - 1) * 1e3 for i in ok if lens[i] > 1]
        gaps = [x * 1e3 for i in ok for x in itls[i]]
        if not tpots:
            return []
        out.append(
            {
                "median_tpot_ms": float(np.median(tpots)),
                "mean_tpot_ms": float(np.mean(tpots)),
                "p99_tpot_ms": float(np.percentile(tpots, 99)),
                "median_itl_ms": float(np.median(gaps)) if gaps else 0.0,
                "median_ttft_ms": float(np.median([ttfts[i] * 1e3 for i in ok])),
                "completed": float(len(ok)),
            }
        )
    return out


def read_bench(path: Path, log: Path) -> dict[str, float]:
    """``bench_result`` of a run that wrote ``path`` (JSON) and ``log`` (its printed summary), either missing."""
    result = json.loads(path.read_text()) if path.exists() else None
    text = log.read_text(errors="replace") if log.exists() else ""
    return bench_result(result, text)


def log_phases(text: str) -> dict[str, Any]:
    """Start-up phases found in an engine's log (the last of each), and whether its graphs came from the compile
    cache (None when the log says neither)."""
    out: dict[str, Any] = {}
    for key, pattern in LOG_PHASES.items():
        found = re.findall(pattern, text)
        if found:
            out[key] = float(found[-1])
    counts = re.findall(LOG_GRAPH_COUNTS, text)
    if counts:
        out["graph_counts"] = counts[-1].strip()
    if re.search(LOG_CACHE_HIT, text):
        out["compile_cached"] = True
    elif "compile_s" in out:
        out["compile_cached"] = False
    return out


def flat_numbers(stats: Any, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a proposer's statistics (``SpecdecProposer.stats``), nested keys joined by '.'."""
    out: dict[str, float] = {}
    if isinstance(stats, dict):
        for k, v in stats.items():
            if isinstance(v, bool):
                continue
            if isinstance(v, (int, float)):
                out[prefix + str(k)] = float(v)
            elif isinstance(v, dict):
                out.update(flat_numbers(v, f"{prefix}{k}."))
    return out


def plugin_delta(before: list[Any] | None, after: list[Any] | None) -> list[dict[str, float]] | None:
    """Per rank, what a cell changed in the proposer's counters (non-zero differences of its numeric statistics:
    plain / narrow / ragged graph dispatches, back-off, withheld and drafted tokens, ...); None without both."""
    if not before or not after or len(before) != len(after):
        return None
    out = []
    for b, a in zip(before, after):
        fb, fa = flat_numbers(b), flat_numbers(a)
        out.append({k: round(v - fb.get(k, 0.0), 6) for k, v in fa.items() if v != fb.get(k, 0.0)})
    return out


def plugin_line(text: str) -> dict[str, int] | None:
    """The numbers of the last statistics line the plugin logged in ``text`` (a server's log; its totals since the
    server started, warm-up included): steps, steps with drafts, draft tokens, accepted, back-offs, recoveries,
    newcomers held and, where logged, the verified drafted steps before any back-off and after a recovery and the
    steps the large-batch step gate withheld every draft of."""
    found = list(PLUGIN_LINE.finditer(text))
    if not found:
        return None
    return {k: int(v) for k, v in found[-1].groupdict().items() if v is not None}
