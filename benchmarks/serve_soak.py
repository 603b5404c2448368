"""Soak: many requests through `vllm serve` with the plugin in each mode, memory sampled over time, faults injected.

    python -m benchmarks.serve_soak --faults raise:100,sleep:100 --out-dir $OUT   # GPU: both modes, one call
    python -m benchmarks.serve_soak --base-url http://127.0.0.1:8000 ...          # against a running server

Per mode (``--modes``: the plugin's ``async_mode``, thread and schedule; one server each, started one after
another, then soaked at the same time; the suffix cache capped at ``--max-cached-requests``): ``--requests``
requests (``openai`` AsyncOpenAI, at most ``--concurrency`` in flight), prompts cycled from the code, agentic and
chat pools, max_tokens drawn from SOAK_LENGTHS, STREAM_SHARE of them streamed and ``--cancel-share`` streamed and
closed after CANCEL_AFTER chunks (serve_soak_load).
Every ``--sample-s`` the host RSS of the server's process group, the GPU's used memory (nvidia-smi) and the
plugin's cache gauges are recorded. /metrics is scraped before and after (vLLM's counters), and so is the plugin's
own endpoint (``metrics_port``, added to a specdec ``--spec`` on a free port unless it names one;
``--metrics-port``). Then ``--compare`` greedy requests go to the same server. A mode passes with zero failed
requests, every request sent, the cache's cap reached, host RSS growing less than RSS_GROWTH_MAX and GPU memory
less than GPU_GROWTH_MAX after that, the cache within its caps, vLLM's inter-token latencies (its histogram) within
the drafting deadline plus two median steps, and, with faults, the plugin's counts equal to the injected faults
(serve_soak_checks). At the end no-speculation and vLLM ngram servers answer the same greedy requests: specdec's
mismatches must be no more than ngram's. Bounded: ``--requests`` per mode, ``--time-limit-s`` (none sent after).
``--baseline`` soaks a no-speculation server beside them with the same requests (it then answers the greedy
requests as the reference): its inter-token latencies past each mode's bound say what vLLM itself does under this
load (``with_baseline``: a mode whose share of such gaps is no larger than the baseline's passes the ITL check).

``--faults raise:100`` / ``sleep:100`` (test only) starts the server with ``SPECDEC_TEST_FAULTS`` set: the plugin's
drafter then raises, or sleeps past the drafting deadline, on every 100th drafting call
(``specdec/vllm_plugin/faults.py``); the run must still pass, and the plugin counts the failures and late steps.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.serve_common import (
    METHODS,
    MODES,
    ServeError,
    Server,
    check_reachable,
    device_name,
    free_port,
    http_get,
    parse_metrics,
    parse_names,
    plugin_counters,
    scrape_plugin,
    spec_delta,
    with_metrics_port,
    write_json,
)
from benchmarks.serve_soak_checks import (
    BASELINE,
    Sampler,
    cap_reached_at,
    compare_verdict,
    fault_check,
    fault_kinds,
    growth_after,
    itl_verdict,
    itl_window,
    mismatches,
    plot,
    with_baseline,
)
from benchmarks.serve_soak_load import drive, greedy_texts, plan, soak_prompts
from specdec.config import ConfigError
from specdec.eval.results import installed_versions
from specdec.vllm_plugin.faults import FAULTS_ENV, Faults

RSS_GROWTH_MAX = 0.05
GPU_GROWTH_MAX = 0.01  # the whole GPU's used memory (every server on it): the caching allocator settles late
DEFAULT_TIMEOUT_MS = 50.0  # the plugin's draft_timeout_ms default (entry/options.py)
DEFAULT_GPU_UTIL = 0.9  # vLLM's default gpu_memory_utilization, shared by soak servers running at once
CACHE_PREFIX = "specdec_global_cache_"  # the suffix drafter's global cache gauges on the plugin's endpoint
DRAFTER_MEMORY = "specdec_drafter_memory_bytes"


def plugin_report(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The plugin's metrics at the end (``plugin_counters``), its counters' growth over the run (``plugin_delta``:
    the ``_total`` ones), its drafter's size at the end (``plugin_cache``) and whether the suffix drafter's global
    cache kept within its caps (``cache_within_cap``; None where the endpoint gave no cache gauges)."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if k.endswith("_total")}
    cache = {k: v for k, v in after.items() if k.startswith(CACHE_PREFIX) or k == DRAFTER_MEMORY}
    within = None
    if all(f"{CACHE_PREFIX}{w}" in cache for w in ("tokens", "requests", "max_tokens", "max_requests")):
        within = all(cache[f"{CACHE_PREFIX}{w}"] <= cache[f"{CACHE_PREFIX}max_{w}"] for w in ("tokens", "requests"))
    return {
        "plugin_counters": plugin_counters(after),
        "plugin_delta": plugin_counters(delta),
        "plugin_cache": cache,
        "cache_within_cap": within,
    }


def summarize(
    outcomes: list[str], sampler: Sampler, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    """Outcomes, spec-decode counters and the plugin's, memory growth from the moment the drafter's cache first
    held its maximum of requests (``cap_reached_s``; never reached fails the run)."""
    failed = [o for o in outcomes if o.startswith("failed")]
    cap_s = cap_reached_at(sampler.plugin_samples)
    start = cap_s if cap_s is not None else float("inf")
    rss_g, gpu_g = growth_after(sampler.samples, 2, start), growth_after(sampler.samples, 3, start)
    out = {
        "requests": len(outcomes),
        "ok": outcomes.count("ok"),
        "cancelled": outcomes.count("cancelled"),
        "not_sent": outcomes.count("not sent"),
        "failed": len(failed),
        "failures": failed[:20],
        "cap_reached_s": cap_s,
        "rss_growth": rss_g,
        "gpu_growth": gpu_g,
        "spec": spec_delta(before, after),
        "vllm_counters": {k: v for k, v in after.items() if k.startswith("vllm:") and k.endswith("_total")},
        "preemptions": after.get("vllm:num_preemptions_total", 0.0) - before.get("vllm:num_preemptions_total", 0.0),
        **plugin_report(before, after),
        "samples": sampler.samples,
        "plugin_samples": sampler.plugin_samples,
    }
    out["pass"] = (
        not failed
        and out["not_sent"] == 0
        and cap_s is not None
        and (rss_g is None or rss_g < RSS_GROWTH_MAX)
        and (gpu_g is None or gpu_g < GPU_GROWTH_MAX)
        and out["cache_within_cap"] is not False
    )
    return out


def check_faults(spec: str, *, base_url: str) -> None:
    """``--faults``: a valid ``SPECDEC_TEST_FAULTS`` value, for a server this driver starts."""
    if not spec:
        return
    if base_url:
        raise ServeError(f"--faults {spec!r} with --base-url: faults are set when the server starts; drop one")
    try:
        Faults.parse(spec, timeout_ms=0.0)
    except ConfigError as exc:
        raise ServeError(f"--faults: {exc}") from None


def mode_spec(args: argparse.Namespace, mode: str) -> tuple[dict[str, Any] | None, int]:
    """The speculative config of ``mode``'s server (None: no speculation) and its plugin metrics port: ``--spec``
    with ``async_mode`` and the suffix cache's ``max_cached_requests`` set for a specdec config."""
    spec = json.loads(args.spec) if args.spec and mode != BASELINE else None
    if spec is not None and spec.get("method") == "specdec":
        if mode in MODES:
            spec["async_mode"] = mode
        if args.max_cached_requests:
            opts = spec.setdefault("drafter_options", {})
            opts["suffix"] = {**opts.get("suffix", {}), "max_cached_requests": args.max_cached_requests}
    return with_metrics_port(spec, args.metrics_port)


@dataclass
class Target:
    """A soak's server: its mode, speculative config, URLs and the process ids whose RSS is sampled."""

    mode: str
    spec: dict[str, Any] | None
    base_url: str
    pids: Callable[[], list[int]]
    plugin_url: str
    server: Server | None = None


def shared_gpu_args(args: argparse.Namespace, servers: int) -> list[str]:
    """``--server-args`` for one of ``servers`` soak servers on one GPU: each takes an equal share of vLLM's
    default memory utilization unless the arguments set one."""
    if servers < 2 or "--gpu-memory-utilization" in args.server_args:
        return list(args.server_args)
    return [*args.server_args, "--gpu-memory-utilization", f"{DEFAULT_GPU_UTIL / servers:.2f}"]


def open_target(args: argparse.Namespace, mode: str, stack: list[Server], *, servers: int = 1) -> Target:
    """``mode``'s server started (appended to ``stack`` first, so it is stopped whatever happens; one of
    ``servers`` sharing the GPU), or ``--base-url``."""
    spec, plugin_port = mode_spec(args, mode)
    server = None
    if args.base_url:
        check_reachable(args.base_url)
        base_url, pids, plugin_port = args.base_url, (list), max(args.metrics_port, 0)
    else:
        server = Server(
            args.model, port=free_port(), log=Path(args.out_dir) / f"soak-{mode}.log", spec=spec,
            server_args=shared_gpu_args(args, servers), cli=args.vllm_cli,
            env={FAULTS_ENV: args.faults} if args.faults else None,
        )  # fmt: skip
        stack.append(server)
        server.start(args.health_timeout_s)
        base_url, pids = server.base_url, server.pids
    plugin_url = f"{base_url.rsplit(':', 1)[0]}:{plugin_port}/metrics" if plugin_port else ""
    return Target(mode, spec, base_url, pids, plugin_url, server)


def soak_on(args: argparse.Namespace, t: Target, reqs: list[dict[str, Any]], compare: list[str]) -> dict[str, Any]:
    """The soak's requests through one server, then the greedy comparison requests on it; its checks."""
    progress = {"done": 0}
    sampler = Sampler(t.pids, args.sample_s, progress, lambda: scrape_plugin(t.plugin_url)[0])
    try:
        text_before, (plugin_before, _) = http_get(f"{t.base_url}/metrics")[1], scrape_plugin(t.plugin_url)
        sampler.start()
        t0 = time.monotonic()
        outcomes = asyncio.run(
            drive(t.base_url, args.model, reqs, concurrency=args.concurrency, time_limit_s=args.time_limit_s,
                  progress=progress)
        )  # fmt: skip
        wall = time.monotonic() - t0
        sampler.halt.set()
        sampler.join()
        sampler.take()
        text_after, (plugin_after, plugin_error) = http_get(f"{t.base_url}/metrics")[1], scrape_plugin(t.plugin_url)
        texts = asyncio.run(greedy_texts(t.base_url, args.model, compare, concurrency=args.concurrency))
    finally:
        sampler.halt.set()
    doc = {"mode": t.mode, "speculative_config": t.spec, "wall_s": wall, "plugin_metrics_url": t.plugin_url,
           "plugin_metrics_error": plugin_error,
           **summarize(outcomes, sampler, {**parse_metrics(text_before), **plugin_before},
                       {**parse_metrics(text_after), **plugin_after})}  # fmt: skip
    timeout_ms = float((t.spec or {}).get("draft_timeout_ms", DEFAULT_TIMEOUT_MS))
    window = itl_window(text_before, text_after)
    doc["itl"] = itl_verdict(window, timeout_ms=timeout_ms)
    doc["itl_window"] = window  # for the baseline's count at each mode's bound (popped)
    if t.mode == BASELINE:
        return {**doc, "pass": True, "greedy": texts}  # a reference: its cache and memory checks do not apply
    if args.faults and t.server is not None:
        log = t.server.log.read_text(errors="replace")
        doc["faults"] = fault_check(fault_kinds(args.faults), plugin_before, plugin_after, log)
    doc["pass"] = doc["pass"] and doc["itl"]["ok"] and doc.get("faults", {"ok": True})["ok"]
    doc["greedy"] = texts
    return doc


def soak_all(args: argparse.Namespace, modes: list[str], reqs: list[dict[str, Any]], compare: list[str]) -> dict:
    """Every mode's server started one after another (memory profiling sees no other start; each with its share of
    the GPU's memory, ``shared_gpu_args``), then all soaked at once (one call holds both modes), then stopped."""
    stack: list[Server] = []
    try:
        targets = [open_target(args, m, stack, servers=len(modes)) for m in modes]
        with cf.ThreadPoolExecutor(len(targets)) as pool:
            docs = list(pool.map(lambda t: soak_on(args, t, reqs, compare), targets))
    finally:
        codes = {srv.log.stem: srv.stop() for srv in stack}
    base = next((d for d in docs if d["mode"] == BASELINE), None)
    for d in docs:
        if base is not None and d is not base:
            d["itl"] = with_baseline(d["itl"], base["itl_window"])
            d["pass"] = d["pass"] and d["itl"]["ok"]
    for d in docs:
        d.pop("itl_window")
        d["server_exit_code"] = codes.get(f"soak-{d['mode']}")
        print(f"soak {d['mode']}: {'pass' if d['pass'] else 'FAIL'}", flush=True)
    return {d["mode"]: d for d in docs}


def reference_texts(args: argparse.Namespace, method: str, compare: list[str]) -> list[str]:
    """The comparison prompts' greedy texts from a fresh server of ``method`` (nospec or ngram)."""
    server = Server(
        args.model, port=free_port(), log=Path(args.out_dir) / f"soak-{method}.log",
        spec=METHODS[method], server_args=args.server_args, cli=args.vllm_cli,
    )  # fmt: skip
    try:
        server.start(args.health_timeout_s)
        return asyncio.run(greedy_texts(server.base_url, args.model, compare, concurrency=args.concurrency))
    finally:
        server.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts = soak_prompts(Path(args.prompts))
    reqs = plan(prompts, args.requests, cancel_share=args.cancel_share)
    compare = prompts[: args.compare]
    modes = ["external"] if args.base_url else [*args.modes, *([BASELINE] if args.baseline else [])]
    doc: dict[str, Any] = {"command": sys.argv, "device": device_name(), "versions": installed_versions(),
                           "spec": args.spec, "settings": dict(vars(args)), "modes": {}}  # fmt: skip
    doc["modes"] = soak_all(args, modes, reqs, compare)
    if compare and not args.base_url:
        greedy = {m: d.pop("greedy") for m, d in doc["modes"].items()}
        ref = greedy.get(BASELINE) or reference_texts(args, "nospec", compare)  # the baseline soak is one
        results = {f"specdec-{m}": mismatches(g, ref) for m, g in greedy.items() if m != BASELINE}
        results["ngram"] = mismatches(reference_texts(args, "ngram", compare), ref)
        doc["greedy_vs_nospec"] = {"methods": results, **compare_verdict(results)}
    doc["pass"] = all(d["pass"] for d in doc["modes"].values()) and doc.get("greedy_vs_nospec", {"ok": True})["ok"]
    return doc


def check_args(args: argparse.Namespace) -> None:
    if args.requests < 1 or args.concurrency < 1:
        raise ServeError(f"--requests {args.requests} / --concurrency {args.concurrency}: both must be >= 1")
    check_faults(args.faults, base_url=args.base_url)
    args.modes = parse_names(args.modes, MODES, what="mode")
    if args.spec:
        try:
            json.loads(args.spec)
        except json.JSONDecodeError as exc:
            example = '\'{"method": "specdec"}\''
            raise ServeError(f"--spec {args.spec!r} is not JSON ({exc.msg}): e.g. {example}") from None


def brief(doc: dict[str, Any]) -> dict[str, Any]:
    keys = ("requests", "ok", "cancelled", "failed", "not_sent", "cap_reached_s", "rss_growth", "gpu_growth", "spec",
            "itl", "faults", "plugin_cache", "cache_within_cap", "plugin_metrics_error", "pass")  # fmt: skip
    out = {m: {k: d[k] for k in keys if k in d} for m, d in doc["modes"].items()}
    return {"modes": out, "greedy_vs_nospec": doc.get("greedy_vs_nospec"), "pass": doc["pass"]}


def main(argv: list[str] | None = None) -> int:
    from specdec.paths import TARGET_MODEL, model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="device_inputs/serve_prompts.json", help="from `serve_bench prepare`")
    ap.add_argument("--model", default=str(model_path(TARGET_MODEL)))
    ap.add_argument("--spec", default='{"method": "specdec"}', help="speculative config JSON ('' for none)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="the plugin's async_mode, one server each, soaked at once")  # fmt: skip
    ap.add_argument("--base-url", default="", help="drive this running server instead of starting one")
    ap.add_argument("--requests", type=int, default=10_000, help="per mode")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--cancel-share", type=float, default=0.05)
    ap.add_argument("--max-cached-requests", type=int, default=1_000, help="the suffix cache's cap (0: the default)")
    ap.add_argument("--compare", type=int, default=200, help="greedy requests compared with nospec and ngram servers")
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="also soak a no-speculation server at the same time: vLLM's own inter-token latency tail",
    )
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--time-limit-s", type=float, default=300.0, help="no new request past this")
    ap.add_argument(
        "--metrics-port",
        type=int,
        default=-1,
        help="the plugin's metrics endpoint: -1 a free port (added to a specdec --spec), 0 none, N port N "
        "(with --base-url: where the running server's plugin serves them)",
    )
    ap.add_argument("--server-args", default="", type=lambda s: s.split())
    ap.add_argument("--health-timeout-s", type=float, default=600.0)
    ap.add_argument("--vllm-cli", default="")
    ap.add_argument("--out-dir", default="eval/results/serve")
    ap.add_argument("--faults", default="", help="test only: drafter faults for the server, e.g. 'raise:100'")
    args = ap.parse_args(argv)
    try:
        check_args(args)
        doc = run(args)
    except ServeError as exc:
        print(f"serve_soak: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    for mode, d in doc["modes"].items():
        start = d["cap_reached_s"] if d["cap_reached_s"] is not None else 0.0
        d["png"] = plot(d["samples"], out / f"serve_soak-{mode}.png", judged_from=start) if d["samples"] else ""
    write_json(out / "serve_soak.json", doc)
    print(json.dumps(brief(doc), indent=1))
    return 0 if doc["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
