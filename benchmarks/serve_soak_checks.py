"""The soak's checks beyond "no request failed": injected faults against the plugin's counts and log lines, the
longest gap between streamed chunks against the drafting deadline, memory growth once the drafter's cache is full,
and greedy outputs against a no-speculation server's (no more mismatches than vLLM ngram's)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.serve_common import by_label, gpu_memory_mib, rss_mib
from specdec.eval.report import save_png

FAULT_COUNTERS = {  # fault kind: (the plugin's count of what it injected, the plugin's count of what it handled)
    "raise": ("specdec_test_faults_raised", "specdec_drafter_errors_total"),
    "sleep": ("specdec_test_faults_slept", "specdec_deadline_misses_total"),
}
FAULT_LOG_LINES = {  # fault kind: the plugin's warning for it (logged once per kind)
    "raise": re.compile(r"drafter \S+ failed for request"),
    "sleep": re.compile(r"took longer than draft_timeout_ms"),
}
COUNT_TOLERANCE = 0.01  # handled faults within 1% of the injected ones (at least one either way)
ITL_STEPS = 2  # the longest gap between a request's outputs: at most the drafting deadline plus this many steps
ITL_METRIC = "vllm:inter_token_latency_seconds"
BASELINE = "nospec"  # --baseline: a no-speculation server soaked beside the spec modes (its ITL tail for reference)
CACHE_REQUESTS, CACHE_MAX_REQUESTS = "specdec_global_cache_requests", "specdec_global_cache_max_requests"
# sampled over time: the cache gauges (when the cap is reached) and the counters of late steps (when they happen:
# an inter-token gap past the bound during warm-up or under load)
SAMPLED_PLUGIN = (CACHE_REQUESTS, CACHE_MAX_REQUESTS, "specdec_deadline_misses_total",
                  "specdec_watchdog_releases_total", "specdec_drafter_errors_total")  # fmt: skip


def fault_check(kinds: list[str], before: dict[str, float], after: dict[str, float], log: str) -> dict[str, Any]:
    """Per injected fault kind: injected (the plugin's own count), handled (its error / deadline counter), log lines
    of its warning; ok when handled is within COUNT_TOLERANCE of injected (> 0) and the warning appears once."""
    out: dict[str, Any] = {"ok": True}
    for kind in kinds:
        injected_key, handled_key = FAULT_COUNTERS[kind]
        injected = after.get(injected_key, 0.0) - before.get(injected_key, 0.0)
        handled = after.get(handled_key, 0.0) - before.get(handled_key, 0.0)
        lines = sum(bool(FAULT_LOG_LINES[kind].search(line)) for line in log.splitlines())
        ok = injected > 0 and abs(handled - injected) <= max(1.0, COUNT_TOLERANCE * injected) and lines == 1
        out[kind] = {"injected": injected, "handled": handled, "log_lines": lines, "ok": ok}
        out["ok"] = out["ok"] and ok
    return out


def fault_kinds(spec: str) -> list[str]:
    """The kinds of a ``--faults`` value ("raise:100,sleep:100" -> ["raise", "sleep"])."""
    return [part.split(":", 1)[0].strip() for part in spec.split(",") if part.strip()]


def histogram(text: str, name: str) -> dict[float, float]:
    """Cumulative counts by upper edge (``le``) of the Prometheus histogram ``name`` in ``text``, summed over
    its other labels."""
    return {float(le.replace("+Inf", "inf")): n for le, n in by_label(text, f"{name}_bucket", "le").items()}


def itl_window(before: str, after: str) -> list[tuple[float, float]]:
    """vLLM's inter-token latency histogram over a run, from /metrics texts before and after it: [(bucket edge in
    s, cumulative count)], ascending (engine timestamps of a request's successive outputs: one gap per step)."""
    b, a = histogram(before, ITL_METRIC), histogram(after, ITL_METRIC)
    return sorted((edge, a[edge] - b.get(edge, 0.0)) for edge in a)


def itl_verdict(cum: list[tuple[float, float]], *, timeout_ms: float) -> dict[str, Any]:
    """An ``itl_window``: its median step, and no gap past the drafting deadline plus ITL_STEPS median steps, read
    at the first bucket edge at or above that bound (``bound_edge_ms``; gaps between the bound and that edge are
    not seen). ``over_bound_edge`` counts the gaps past it; ``over_deadline_edge`` those past the last edge at or
    below the bound, for scale."""
    total = cum[-1][1] if cum else 0.0
    if not total:
        return {"ok": False, "gaps": 0, "why": f"no {ITL_METRIC} observations"}
    p50 = 1e3 * _quantile(cum, 0.5)
    bound = timeout_ms + ITL_STEPS * p50
    upper = min(edge for edge, _ in cum if 1e3 * edge >= bound)
    lower = max([edge for edge, _ in cum if 1e3 * edge <= bound] or [0.0])
    over = total - dict(cum)[upper]
    return {
        "ok": over == 0,
        "gaps": total,
        "p50_ms": p50,
        "p99_ms": 1e3 * _quantile(cum, 0.99),
        "bound_ms": bound,
        "bound_edge_ms": 1e3 * upper,
        "over_bound_edge": over,
        "over_deadline_edge": total - dict(cum).get(lower, 0.0),
        "deadline_edge_ms": 1e3 * lower,
        # the tail's shape: gaps per bucket above the bound's edge ({upper edge in ms: count}; "inf" past the last)
        "tail": {
            ("inf" if e == float("inf") else f"{1e3 * e:g}"): c - p
            for (e, c), (_, p) in zip(cum[1:], cum)
            if e > upper and c > p
        },  # fmt: skip
    }


def with_baseline(itl: dict[str, Any], baseline: list[tuple[float, float]]) -> dict[str, Any]:
    """A spec mode's ``itl_verdict`` beside the ``itl_window`` of a no-speculation server soaked at the same time
    (BASELINE): its gaps past the mode's bound edge. ``ok_absolute`` is the check alone; ``ok`` also holds when the
    mode's share of such gaps is no larger than the baseline's (the stalls are vLLM's own under this load)."""
    if "bound_edge_ms" not in itl:
        return itl
    cum = dict(baseline)
    total = max(cum.values(), default=0.0)
    upper = min((e for e in cum if 1e3 * e >= itl["bound_edge_ms"] - 1e-9), default=None)
    over = total - cum[upper] if upper is not None else 0.0
    share, base_share = itl["over_bound_edge"] / itl["gaps"], (over / total if total else 0.0)
    return {**itl, "ok_absolute": itl["ok"], "baseline_gaps": total, "baseline_over_bound_edge": over,
            "ok": itl["ok"] or (total > 0 and share <= base_share)}  # fmt: skip


def _quantile(cum: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of a cumulative histogram, linear within its bucket (the first bucket starts at 0)."""
    total, prev_edge, prev = cum[-1][1], 0.0, 0.0
    for edge, count in cum:
        if count >= q * total:
            if edge == float("inf"):
                return prev_edge
            return prev_edge + (edge - prev_edge) * (q * total - prev) / max(count - prev, 1e-12)
        prev_edge, prev = edge, count
    return prev_edge


def cap_reached_at(plugin_samples: list[tuple[float, dict[str, float]]]) -> float | None:
    """The first sampled time at which the drafter's global cache held its maximum of requests (None: never)."""
    for t, m in plugin_samples:
        if m.get(CACHE_MAX_REQUESTS, 0.0) > 0 and m.get(CACHE_REQUESTS, 0.0) >= m[CACHE_MAX_REQUESTS]:
            return t
    return None


def growth_after(samples: list[tuple[float, int, float, float | None]], col: int, start_s: float) -> float | None:
    """Relative growth of column ``col`` from the first sample at or after ``start_s`` to the maximum after it."""
    vals = [s[col] for s in samples if s[0] >= start_s and s[col] is not None]
    if len(vals) < 2 or not vals[0]:
        return None
    return (max(vals) - vals[0]) / vals[0]


def mismatches(outputs: list[str], reference: list[str]) -> dict[str, Any]:
    """Greedy outputs against the no-speculation server's: how many differ, and the first few indices."""
    diff = [i for i, (a, b) in enumerate(zip(outputs, reference)) if a != b]
    return {"compared": len(reference), "differ": len(diff), "first": diff[:10]}


def compare_verdict(results: dict[str, dict[str, Any]], *, baseline: str = "ngram") -> dict[str, Any]:
    """ok when every method's mismatches are no more than ``baseline``'s (vLLM ngram's, same run)."""
    limit = results[baseline]["differ"] if baseline in results else 0
    return {
        "ok": all(r["differ"] <= limit for m, r in results.items() if m != baseline),
        "limit": limit,
        "baseline": baseline,
    }


class Sampler(threading.Thread):
    """Every ``every_s``: (seconds, requests done, host RSS MiB of ``pids()``, GPU used MiB) in ``samples``, and
    (seconds, the plugin's SAMPLED_PLUGIN metrics from ``plugin()``) in ``plugin_samples``."""

    def __init__(
        self, pids: Any, every_s: float, progress: dict[str, int], plugin: Callable[[], dict[str, float]]
    ) -> None:
        super().__init__(daemon=True)
        self.pids, self.every_s, self.progress, self.plugin = pids, every_s, progress, plugin
        self.samples: list[tuple[float, int, float, float | None]] = []
        self.plugin_samples: list[tuple[float, dict[str, float]]] = []
        self.halt = threading.Event()
        self.t0 = time.monotonic()

    def take(self) -> None:
        t = time.monotonic() - self.t0
        self.samples.append((t, self.progress["done"], rss_mib(self.pids()), gpu_memory_mib()))
        gauges = {k: v for k, v in self.plugin().items() if k in SAMPLED_PLUGIN}
        if gauges:
            self.plugin_samples.append((t, gauges))

    def run(self) -> None:
        while not self.halt.is_set():
            self.take()
            self.halt.wait(self.every_s)


def plot(samples: list[tuple[float, int, float, float | None]], path: Path, *, judged_from: float) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "PNG skipped: matplotlib missing (the samples are in the JSON)"
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    t = [s[0] for s in samples]
    axes[0].plot(t, [s[2] for s in samples])
    axes[0].set_title("server host RSS (MiB)")
    axes[1].plot(t, [s[3] if s[3] is not None else float("nan") for s in samples])
    axes[1].set_title("GPU memory used (MiB)")
    for ax in axes:
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        ax.axvspan(judged_from, t[-1], alpha=0.08)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    return str(path)
