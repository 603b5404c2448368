"""The proposer's statistics (``SpecdecProposer.stats()``: a nested dict of numbers) as Prometheus text (format
0.0.4, what vLLM's own ``/metrics`` serves).

The metrics an operator acts on are mapped by name (``METRICS``: stable names, HELP and TYPE, counters ending in
``_total``, gauges for sizes; docs/metrics.md explains each). Every other numeric entry of the dict is exported as
read, ``untyped``, under ``specdec_`` + its key path joined by ``_`` (``schedule.fills`` -> ``specdec_schedule_fills``),
so counters added to the statistics later appear without a change here. Strings and the per-bucket diagnostics
(``DIAGNOSTIC_KEYS``) are left out; a mapped key that is absent (another mode's counter) gives no line.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

PREFIX = "specdec_"
COUNTER, GAUGE, UNTYPED = "counter", "gauge", "untyped"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# per-bucket diagnostics whose keys are batch-size buckets (logs and ``stats()`` only: series that come and go), a
# copy of a mapped counter (``timeouts`` is ``draft_timeouts``) and a fixed internal setting
DIAGNOSTIC_KEYS = frozenset({"cost_model", "thread_timing_us", "timeouts", "thread_spin_us"})
# ``ScheduledDrafting.stats`` merges the engine's CUDA-graph counts into its "schedule" dict; ``SpecdecProposer.stats``
# gives them under "graphs" too: exported once, from there
GRAPHS_KEY, SCHEDULE_KEY = "graphs", "schedule"
_BAD_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_]")


@dataclass(frozen=True)
class Metric:
    """One mapped metric: its name after ``PREFIX``, the dotted key path it reads, its type and HELP text."""

    name: str
    key: str
    kind: str
    help: str


METRICS: tuple[Metric, ...] = (
    # ----------------------------------------------------------------- work and yield
    Metric("steps_total", "steps", COUNTER, "Engine steps the proposer took part in."),
    Metric("plain_steps_total", "plain_steps", COUNTER, "Steps without a decoding request (nothing to draft)."),
    Metric(
        "drafted_steps_total",
        "drafted_steps",
        COUNTER,
        "Steps that handed vLLM at least one draft token (the others verify no draft, as without speculation).",
    ),
    Metric("drafted_tokens_total", "drafted_tokens", COUNTER, "Draft tokens handed to vLLM (padding included)."),
    Metric("accepted_tokens_total", "accepted_tokens", COUNTER, "Draft tokens vLLM's verification accepted."),
    Metric(
        "emitted_tokens_total",
        "emitted_tokens",
        COUNTER,
        "Tokens vLLM emitted for the drafted requests (accepted drafts plus one per decoding request and step).",
    ),
    Metric(
        "propose_seconds_total",
        "propose_seconds",
        COUNTER,
        "Seconds vLLM's engine thread spent in the plugin's drafting calls.",
    ),
    Metric(
        "propose_ms_per_step",
        "propose_ms_per_step",
        GAUGE,
        "Mean milliseconds per step in the plugin's drafting calls since start.",
    ),
    Metric("requests_started_total", "started", COUNTER, "Requests the drafter started (first seen or restarted)."),
    Metric(
        "requests_stopped_total", "stopped", COUNTER, "Requests the drafter stopped (finished, aborted, preempted)."
    ),
    Metric("active_requests", "active_requests", GAUGE, "Requests the drafter holds now."),
    # ----------------------------------------------------------------- faults and fallbacks
    Metric(
        "deadline_misses_total",
        "draft_timeouts",
        COUNTER,
        "Steps whose drafting passed draft_timeout_ms; each went on without drafts.",
    ),
    Metric(
        "drafter_errors_total",
        "draft_errors",
        COUNTER,
        "Drafting calls that raised; their step went on without drafts (the first of each error type is logged).",
    ),
    Metric(
        "resyncs_total",
        "resyncs",
        COUNTER,
        "Requests restarted from their full context because their length did not follow (preemption, recompute).",
    ),
    Metric("busy_skips_total", "busy_skips", COUNTER, "Steps without drafts because a late drafting job still ran."),
    Metric(
        "native_step",
        "native_step",
        GAUGE,
        "1 while the suffix drafter's native step drafts; 0 without one or after it fell back to the Python path.",
    ),
    Metric(
        "blind_requests_total",
        "schedule.blind_requests",
        COUNTER,
        "Schedule mode: requests first seen mid-generation without their tokens; they get no real drafts.",
    ),
    Metric(
        "eager_fills_total",
        "schedule.eager_fills",
        COUNTER,
        "Schedule mode: steps drafted at once because vLLM reads their drafts on the host (structured output, "
        "penalties).",
    ),
    Metric(
        "skipped_fills_total",
        "schedule.skipped_fills",
        COUNTER,
        "Schedule mode: steps whose draft buffer vLLM replaced (rows near max_model_len); no drafts.",
    ),
    Metric(
        "watchdog_releases_total",
        "schedule.watchdog_releases",
        COUNTER,
        "Schedule mode: steps whose GPU wait for drafts the watchdog released; after 3 the host waits instead.",
    ),
    Metric(
        "watchdog_stalls_total",
        "schedule.watchdog_stalls",
        COUNTER,
        "Schedule mode: of the watchdog's releases, waits the host never released in time (not late drafting).",
    ),
    # ----------------------------------------------------------------- drafter state (sampled about once a second)
    Metric(
        "drafter_memory_bytes",
        "drafter_state.memory_bytes",
        GAUGE,
        "Host bytes of drafter state (suffix tries with the global cache; a draft model's per-request caches).",
    ),
    Metric(
        "global_cache_requests",
        "drafter_state.global_cache_requests",
        GAUGE,
        "Finished responses in the suffix drafter's global cache.",
    ),
    Metric(
        "global_cache_tokens",
        "drafter_state.global_cache_tokens",
        GAUGE,
        "Response tokens in the suffix drafter's global cache.",
    ),
    Metric(
        "global_cache_bytes",
        "drafter_state.global_cache_bytes",
        GAUGE,
        "Host bytes of the suffix drafter's global cache.",
    ),
    Metric(
        "global_cache_max_requests",
        "drafter_state.global_cache_max_requests",
        GAUGE,
        "The global cache's cap on responses (max_cached_requests; oldest evicted first).",
    ),
    Metric(
        "global_cache_max_tokens",
        "drafter_state.global_cache_max_tokens",
        GAUGE,
        "The global cache's cap on response tokens (max_cached_tokens; oldest evicted first).",
    ),
)
_MAPPED = frozenset(m.key for m in METRICS)


def render(stats: Mapping[str, Any], *, info: Mapping[str, str] | None = None) -> str:
    """Prometheus text of ``stats`` (see the module docstring); ``info``: labels of a constant ``specdec_info``
    gauge (1), first."""
    out: list[str] = []
    names: set[str] = set()
    if info is not None:
        labels = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in info.items())
        _family(out, names, "info", GAUGE, "The plugin's settings, as labels (value 1).", "1", labels)
    for m in METRICS:
        value = _number(_lookup(stats, m.key))
        if value is not None:
            _family(out, names, m.name, m.kind, m.help, value)
    for path, raw in _leaves(stats):
        dotted = ".".join(path)
        value = _number(raw)
        if value is None or dotted in _MAPPED:
            continue
        name = _BAD_NAME_CHARS.sub("_", "_".join(path))
        if PREFIX + name not in names:  # a name taken by a mapped metric or an earlier path is not repeated
            _family(out, names, name, UNTYPED, f"Proposer statistic {dotted!r}, exported as read.", value)
    return "".join(out)


def _family(out: list[str], names: set[str], name: str, kind: str, text: str, value: str, labels: str = "") -> None:
    full = PREFIX + name
    names.add(full)
    out.append(f"# HELP {full} {_escape_help(text)}\n# TYPE {full} {kind}\n")
    out.append(f"{full}{{{labels}}} {value}\n" if labels else f"{full} {value}\n")


def _lookup(stats: Mapping[str, Any], key: str) -> Any:
    node: Any = stats
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _leaves(stats: Mapping[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(key path, value) of every non-dict entry, depth first in the dict's order; diagnostics and the schedule
    dict's copies of the graph counts left out."""
    graphs = stats.get(GRAPHS_KEY) if not path else None
    for key, value in stats.items():
        key = str(key)
        if not path and key in DIAGNOSTIC_KEYS:
            continue
        if isinstance(value, Mapping):
            inner = value
            if not path and key == SCHEDULE_KEY and isinstance(graphs, Mapping):
                inner = {k: v for k, v in value.items() if k not in graphs}
            yield from _leaves(inner, (*path, key))
        else:
            yield (*path, key), value


def _number(value: Any) -> str | None:
    """The sample value's text (bools as 0/1), or None for what is not a number."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        x = float(value)
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "+Inf" if x > 0 else "-Inf"
        return repr(x)
    return None


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
