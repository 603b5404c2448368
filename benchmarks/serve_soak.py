"""Soak: many requests through `vllm serve` with the plugin, memory sampled over time.

    python -m benchmarks.serve_soak --out-dir $OUT                          # GPU: 10,000 requests, concurrency 64
    python -m benchmarks.serve_soak --base-url http://127.0.0.1:8000 ...    # against a running server

Requests (``openai`` AsyncOpenAI, at most ``--concurrency`` in flight): prompts cycled from the code, agentic and
chat pools, max_tokens drawn from SOAK_LENGTHS, STREAM_SHARE of them streamed and ``--cancel-share`` streamed and
closed after CANCEL_AFTER chunks. Every ``--sample-s`` the host RSS of the server's process group and the GPU's used
memory (nvidia-smi) are recorded. /metrics is scraped before and after (vLLM's spec-decode counters, preemptions), and
so is the plugin's own endpoint (``metrics_port``, added to a specdec ``--spec`` on a free port unless it names one;
``--metrics-port``): its counters at the end and over the run, its drafter's size. Passes with zero failed requests,
host RSS growing less than RSS_GROWTH_MAX between 20% and 100% of the run, GPU memory not growing over that span and
the suffix drafter's global cache within its caps (where the endpoint reports it). Bounded: ``--requests`` and
``--time-limit-s`` (no new request past it).

``--faults raise:100`` / ``sleep:100`` (test only) starts the server with ``SPECDEC_TEST_FAULTS`` set: the plugin's
drafter then raises, or sleeps past the drafting deadline, on every 100th drafting call
(``specdec/vllm_plugin/faults.py``); the run must still pass, and the plugin counts the failures and late steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.serve_common import (
    ServeError,
    Server,
    check_reachable,
    device_name,
    free_port,
    gpu_memory_mib,
    plugin_counters,
    rss_mib,
    scrape,
    scrape_plugin,
    spec_delta,
    with_metrics_port,
    write_json,
)
from specdec.config import ConfigError
from specdec.eval.results import installed_versions
from specdec.vllm_plugin.faults import FAULTS_ENV, Faults

SOAK_LENGTHS = (16, 32, 64, 128, 256, 512)
STREAM_SHARE = 0.3
CANCEL_AFTER = 4  # chunks read before a cancelled stream is closed
RSS_GROWTH_MAX = 0.05
WINDOW = (0.2, 1.0)  # the part of the run (by time) whose growth is judged: start-up and warm-up excluded
POOLS = ("code", "agentic", "chat")
CACHE_PREFIX = "specdec_global_cache_"  # the suffix drafter's global cache gauges on the plugin's endpoint
DRAFTER_MEMORY = "specdec_drafter_memory_bytes"


def plan(prompts: list[str], n: int, *, cancel_share: float, seed: int = 0) -> list[dict[str, Any]]:
    """n requests: prompt, max_tokens, mode ("plain", "stream", "cancel"), seeded."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        u = rng.random()
        mode = "cancel" if u < cancel_share else "stream" if u < cancel_share + STREAM_SHARE else "plain"
        out.append({"prompt": prompts[i % len(prompts)], "max_tokens": rng.choice(SOAK_LENGTHS), "mode": mode})
    return out


async def one(c: Any, model: str, req: dict[str, Any]) -> str:
    """'ok', 'cancelled' or 'failed: ...'."""
    try:
        kw = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0.0}
        if req["mode"] == "plain":
            resp = await c.completions.create(**kw)
            return "ok" if resp.choices else "failed: no choices"
        stream = await c.completions.create(stream=True, **kw)
        chunks = 0
        async for _ in stream:
            chunks += 1
            if req["mode"] == "cancel" and chunks >= CANCEL_AFTER:
                await stream.close()
                return "cancelled"
        return "ok"
    except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
        return f"failed: {type(exc).__name__}: {str(exc)[:200]}"


async def drive(
    base_url: str,
    model: str,
    reqs: list[dict[str, Any]],
    *,
    concurrency: int,
    time_limit_s: float,
    progress: dict[str, int],
) -> list[str]:
    import openai

    c = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    end = time.monotonic() + time_limit_s

    async def task(req: dict[str, Any]) -> str:
        async with sem:
            if time.monotonic() > end:
                return "not sent"
            out = await one(c, model, req)
            progress["done"] += 1
            return out

    try:
        return list(await asyncio.gather(*(task(r) for r in reqs)))
    finally:
        await c.close()


class Sampler(threading.Thread):
    """Every ``every_s``: (seconds, requests done, host RSS MiB of ``pids()``, GPU used MiB)."""

    def __init__(self, pids: Any, every_s: float, progress: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.pids, self.every_s, self.progress = pids, every_s, progress
        self.samples: list[tuple[float, int, float, float | None]] = []
        self.halt = threading.Event()
        self.t0 = time.monotonic()

    def take(self) -> None:
        self.samples.append((time.monotonic() - self.t0, self.progress["done"], rss_mib(self.pids()), gpu_memory_mib()))

    def run(self) -> None:
        while not self.halt.is_set():
            self.take()
            self.halt.wait(self.every_s)


def growth(samples: list[tuple[float, int, float, float | None]], col: int) -> float | None:
    """Relative growth of column ``col`` from the first sample at WINDOW[0] of the run to the window's maximum."""
    vals = [(s[0], s[col]) for s in samples if s[col] is not None]
    if len(vals) < 2:
        return None
    span = vals[-1][0]
    window = [v for t, v in vals if WINDOW[0] * span <= t <= WINDOW[1] * span]
    if not window or not window[0]:
        return None
    return (max(window) - window[0]) / window[0]


def plot(samples: list[tuple[float, int, float, float | None]], path: Path) -> str:
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
        ax.axvspan(WINDOW[0] * t[-1], t[-1], alpha=0.08)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


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
    failed = [o for o in outcomes if o.startswith("failed")]
    rss_g, gpu_g = growth(sampler.samples, 2), growth(sampler.samples, 3)
    out = {
        "requests": len(outcomes),
        "ok": outcomes.count("ok"),
        "cancelled": outcomes.count("cancelled"),
        "not_sent": outcomes.count("not sent"),
        "failed": len(failed),
        "failures": failed[:20],
        "rss_growth": rss_g,
        "gpu_growth": gpu_g,
        "spec": spec_delta(before, after),
        "preemptions": after.get("vllm:num_preemptions_total", 0.0) - before.get("vllm:num_preemptions_total", 0.0),
        **plugin_report(before, after),
        "samples": sampler.samples,
    }
    out["pass"] = (
        not failed
        and out["not_sent"] == 0
        and (rss_g is None or rss_g < RSS_GROWTH_MAX)
        and (gpu_g is None or gpu_g <= 0)
        and out["cache_within_cap"] is not False
    )
    return out


def soak_prompts(path: Path) -> list[str]:
    """The pools' prompts interleaved (code, agentic, chat, code, ...)."""
    from benchmarks.serve_inputs import load_pools

    pools = load_pools(path)
    lists = [[r["prompt"] for r in pools[p]] for p in POOLS if p in pools] or [
        [r["prompt"] for r in v] for v in pools.values()
    ]
    return [lst[i] for i in range(max(map(len, lists))) for lst in lists if i < len(lst)]


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    reqs = plan(soak_prompts(Path(args.prompts)), args.requests, cancel_share=args.cancel_share)
    progress = {"done": 0}
    server = None
    if args.base_url:
        check_reachable(args.base_url)
        base_url, pids, plugin_port = args.base_url, (list), max(args.metrics_port, 0)
    else:
        spec, plugin_port = with_metrics_port(json.loads(args.spec) if args.spec else None, args.metrics_port)
        server = Server(
            args.model,
            port=free_port(),
            log=Path(args.out_dir) / "soak-server.log",
            spec=spec,
            server_args=args.server_args,
            cli=args.vllm_cli,
            env={FAULTS_ENV: args.faults} if args.faults else None,
        )
        server.start(args.health_timeout_s)
        base_url, pids = server.base_url, server.pids
    plugin_url = f"{base_url.rsplit(':', 1)[0]}:{plugin_port}/metrics" if plugin_port else ""
    sampler = Sampler(pids, args.sample_s, progress)
    try:
        before = scrape(base_url)
        plugin_before, _ = scrape_plugin(plugin_url)
        sampler.start()
        t0 = time.monotonic()
        outcomes = asyncio.run(
            drive(
                base_url,
                args.model,
                reqs,
                concurrency=args.concurrency,
                time_limit_s=args.time_limit_s,
                progress=progress,
            )
        )
        wall = time.monotonic() - t0
        sampler.halt.set()
        sampler.join()
        sampler.take()
        after = scrape(base_url)
        plugin_after, plugin_error = scrape_plugin(plugin_url)
    finally:
        sampler.halt.set()
        exit_code = server.stop() if server else None
    doc = {
        "command": sys.argv,
        "device": device_name(),
        "versions": installed_versions(),
        "spec": args.spec,
        "settings": {k: v for k, v in vars(args).items()},
        "wall_s": wall,
        "server_exit_code": exit_code,
        "plugin_metrics_url": plugin_url,
        "plugin_metrics_error": plugin_error,
        **summarize(outcomes, sampler, {**before, **plugin_before}, {**after, **plugin_after}),
    }
    return doc


def main(argv: list[str] | None = None) -> int:
    from specdec.paths import TARGET_MODEL, model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="device_inputs/serve_prompts.json", help="from `serve_bench prepare`")
    ap.add_argument("--model", default=str(model_path(TARGET_MODEL)))
    ap.add_argument("--spec", default='{"method": "specdec"}', help="speculative config JSON ('' for none)")
    ap.add_argument("--base-url", default="", help="drive this running server instead of starting one")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--cancel-share", type=float, default=0.05)
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--time-limit-s", type=float, default=420.0, help="no new request past this")
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
        if args.requests < 1 or args.concurrency < 1:
            raise ServeError(f"--requests {args.requests} / --concurrency {args.concurrency}: both must be >= 1")
        check_faults(args.faults, base_url=args.base_url)
        if args.spec:
            try:
                json.loads(args.spec)
            except json.JSONDecodeError as exc:
                raise ServeError(
                    f'--spec {args.spec!r} is not JSON ({exc.msg}): e.g. \'{{"method": "specdec"}}\''
                ) from None
        doc = run(args)
    except ServeError as exc:
        print(f"serve_soak: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    doc["png"] = plot(doc["samples"], out / "serve_soak.png") if doc["samples"] else "no samples"
    write_json(out / "serve_soak.json", doc)
    print(
        json.dumps(
            {
                k: doc[k]
                for k in (
                    "requests",
                    "ok",
                    "cancelled",
                    "failed",
                    "not_sent",
                    "rss_growth",
                    "gpu_growth",
                    "spec",
                    "plugin_delta",
                    "plugin_cache",
                    "cache_within_cap",
                    "plugin_metrics_error",
                    "pass",
                )
            },
            indent=1,
        )
    )
    return 0 if doc["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
