"""The soak's load (serve_soak): its requests (prompts from the pools, lengths, plain, streamed or cancelled
streams), the asynchronous client that sends them at a bounded concurrency, and the greedy comparison requests."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

SOAK_LENGTHS = (16, 32, 64, 128, 256, 512)
STREAM_SHARE = 0.3
CANCEL_AFTER = 4  # chunks read before a cancelled stream is closed
COMPARE_TOKENS = 128
POOLS = ("code", "agentic", "chat")


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


async def greedy_texts(base_url: str, model: str, prompts: list[str], *, concurrency: int) -> list[str]:
    """COMPARE_TOKENS greedy tokens for each prompt (texts in order; a failure's text names it)."""
    import openai

    c = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)

    async def task(prompt: str) -> str:
        async with sem:
            try:
                r = await c.completions.create(model=model, prompt=prompt, max_tokens=COMPARE_TOKENS, temperature=0.0)
                return r.choices[0].text
            except Exception as exc:  # noqa: BLE001 - a failed request is a mismatch, named
                return f"\x00failed: {type(exc).__name__}"

    try:
        return list(await asyncio.gather(*(task(p) for p in prompts)))
    finally:
        await c.close()


def soak_prompts(path: Path) -> list[str]:
    """The pools' prompts interleaved (code, agentic, chat, code, ...)."""
    from benchmarks.serve_inputs import load_pools

    pools = load_pools(path)
    lists = [[r["prompt"] for r in pools[p]] for p in POOLS if p in pools] or [
        [r["prompt"] for r in v] for v in pools.values()
    ]
    return [lst[i] for i in range(max(map(len, lists))) for lst in lists if i < len(lst)]
