"""The features serve_features checks, one function each (``FEATURES``): the same greedy requests to the
no-speculation server ``ref`` and to ``spec`` must give identical outputs, while CARRIERS greedy requests keep
``spec`` drafting (``with_carriers``); ``sampling`` compares the two servers' sample distributions instead.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.serve_common import ServeError, scrape, spec_delta
from benchmarks.serve_stats import biased, chi_square_two_sample

MAX_MODEL_LEN = 2048
PREEMPT_REQUESTS = 64
PREEMPT_TOKENS = 256
CARRIERS = 8
CARRIER_TOKENS = 128
MAX_TOKENS = 96
SAMPLES = 2000
SAMPLES_PER_REQUEST = 50  # n of each sampling request
SAMPLE_TOKENS = 3
SAMPLE_PROMPTS = 3
P_MIN = 1e-3
BIAS_FRACTION = 0.15
LOGPROB_ATOL = 1e-2  # float32: verifying k + 1 positions at once sums in another order than one-token decoding
IDLE_WAIT_S = 60.0
JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}},
    "required": ["name", "count"],
    "additionalProperties": False,
}


@dataclass
class Ctx:
    """What a feature needs: clients of the servers, the model name, prompts, long prompt ids."""

    model: str
    ref: Any
    spec: Any
    spec_url: str
    prompts: list[str]
    long_ids: list[int] = field(default_factory=list)
    preempt: Any = None
    preempt_url: str = ""


def client(base_url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)


def complete(c: Any, model: str, prompt: Any, **kw: Any) -> Any:
    return c.completions.create(model=model, prompt=prompt, **{"temperature": 0.0, "max_tokens": MAX_TOKENS, **kw})


def texts(resp: Any) -> list[str]:
    return [ch.text for ch in sorted(resp.choices, key=lambda ch: ch.index)]


def with_carriers(ctx: Ctx, body: Callable[[], dict[str, Any]], *, url: str = "", c: Any = None) -> dict[str, Any]:
    """Run ``body`` while CARRIERS greedy requests go to the spec server; add the spec-decode delta over the window,
    whether the carriers matched ``ref``, and ok = body ok, carriers identical and tokens accepted."""
    url, c = url or ctx.spec_url, c or ctx.spec
    carrier_prompts = ctx.prompts[:CARRIERS]
    before = scrape(url)
    with cf.ThreadPoolExecutor(CARRIERS) as pool:
        futs = [pool.submit(complete, c, ctx.model, p, max_tokens=CARRIER_TOKENS) for p in carrier_prompts]
        out = body()
        got = [texts(f.result())[0] for f in futs]
    delta = spec_delta(before, scrape(url))
    want = [texts(complete(ctx.ref, ctx.model, p, max_tokens=CARRIER_TOKENS))[0] for p in carrier_prompts]
    out["carriers_identical"] = sum(a == b for a, b in zip(got, want))
    out["spec"] = delta
    out["ok"] = bool(out.get("ok")) and out["carriers_identical"] == len(want) and delta["accepted_tokens"] > 0
    return out


def _same(ctx: Ctx, prompts: list[Any], **kw: Any) -> dict[str, Any]:
    """Greedy requests to both servers; identical texts and finish reasons required."""
    a = [complete(ctx.ref, ctx.model, p, **kw) for p in prompts]
    b = [complete(ctx.spec, ctx.model, p, **kw) for p in prompts]
    same = sum(
        texts(x) == texts(y) and [c.finish_reason for c in x.choices] == [c.finish_reason for c in y.choices]
        for x, y in zip(a, b)
    )
    return {"ok": same == len(prompts), "identical": same, "compared": len(prompts)}


def f_streaming(ctx: Ctx) -> dict[str, Any]:
    prompts = ctx.prompts[CARRIERS : CARRIERS + 4]
    want = [texts(complete(ctx.ref, ctx.model, p))[0] for p in prompts]
    got = [
        "".join(ch.choices[0].text for ch in complete(ctx.spec, ctx.model, p, stream=True) if ch.choices)
        for p in prompts
    ]
    same = sum(a == b for a, b in zip(got, want))
    return {"ok": same == len(prompts), "identical": same, "compared": len(prompts)}


def f_stop(ctx: Ctx) -> dict[str, Any]:
    return _same(ctx, ctx.prompts[CARRIERS : CARRIERS + 4], stop=["\n\n", "return "])


def f_max_tokens_1(ctx: Ctx) -> dict[str, Any]:
    return _same(ctx, ctx.prompts[CARRIERS : CARRIERS + 4], max_tokens=1)


def f_top_p_top_k(ctx: Ctx) -> dict[str, Any]:
    """Sampling parameters that leave one candidate (top_k 1; a tiny top_p) must give the greedy text."""
    prompts = ctx.prompts[CARRIERS : CARRIERS + 3]
    want = [texts(complete(ctx.ref, ctx.model, p))[0] for p in prompts]
    got_k = [texts(complete(ctx.spec, ctx.model, p, temperature=1.0, extra_body={"top_k": 1}))[0] for p in prompts]
    got_p = [texts(complete(ctx.spec, ctx.model, p, temperature=1.0, top_p=1e-9))[0] for p in prompts]
    same = sum(a == w for a, w in zip(got_k, want)) + sum(a == w for a, w in zip(got_p, want))
    return {"ok": same == 2 * len(prompts), "identical": same, "compared": 2 * len(prompts)}


def f_logprobs(ctx: Ctx) -> dict[str, Any]:
    prompts = ctx.prompts[CARRIERS : CARRIERS + 3]
    worst, same = 0.0, 0
    for p in prompts:
        a, b = (complete(c, ctx.model, p, logprobs=5).choices[0].logprobs for c in (ctx.ref, ctx.spec))
        same += a.tokens == b.tokens and [set(x) for x in a.top_logprobs] == [set(x) for x in b.top_logprobs]
        if a.tokens == b.tokens:
            worst = max([worst, *(abs(x - y) for x, y in zip(a.token_logprobs, b.token_logprobs))])
    return {
        "ok": same == len(prompts) and worst <= LOGPROB_ATOL,
        "identical": same,
        "compared": len(prompts),
        "max_logprob_diff": worst,
    }


def f_n2(ctx: Ctx) -> dict[str, Any]:
    return _same(ctx, ctx.prompts[CARRIERS : CARRIERS + 3], n=2)


def f_long_prompt(ctx: Ctx) -> dict[str, Any]:
    """A prompt of max_model_len - 1 tokens (room for one), and one of max_model_len - 8 (drafts must be cut)."""
    if not ctx.long_ids:
        raise ServeError("feature 'long_prompt' needs token ids (the tokenizer of --model)")
    out = _same(ctx, [ctx.long_ids[-(MAX_MODEL_LEN - 1) :]], max_tokens=1)
    out8 = _same(ctx, [ctx.long_ids[-(MAX_MODEL_LEN - 8) :]], max_tokens=7)
    return {"ok": out["ok"] and out8["ok"], "identical": out["identical"] + out8["identical"], "compared": 2}


def f_json_schema(ctx: Ctx) -> dict[str, Any]:
    import openai

    prompts = [p + "\n# the result as JSON:\n" for p in ctx.prompts[CARRIERS : CARRIERS + 2]]
    kw = {"max_tokens": 64, "extra_body": {"structured_outputs": {"json": JSON_SCHEMA}}}
    try:
        out = _same(ctx, prompts, **kw)
    except openai.BadRequestError as exc:  # a refusal: reported with vLLM's message
        return {"ok": False, "refused": str(exc)[:300]}
    parsed = 0
    for p in prompts:
        try:
            json.loads(texts(complete(ctx.spec, ctx.model, p, **kw))[0])
            parsed += 1
        except json.JSONDecodeError:
            pass
    return {**out, "valid_json": parsed}


def f_cancel_stream(ctx: Ctx) -> dict[str, Any]:
    """A streaming request closed after a few chunks: the server drops it (no request left running) and answers
    the next request exactly."""
    stream = complete(
        ctx.spec, ctx.model, ctx.prompts[CARRIERS], stream=True, max_tokens=512, extra_body={"ignore_eos": True}
    )
    got = 0
    for _ in stream:
        got += 1
        if got >= 5:
            break
    stream.close()
    return {"chunks_read": got, **_same(ctx, ctx.prompts[CARRIERS + 1 : CARRIERS + 2])}


def wait_idle(url: str, timeout_s: float = IDLE_WAIT_S) -> float:
    """Seconds until /metrics shows no running request (``timeout_s`` if never)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if scrape(url).get("vllm:num_requests_running", 0.0) == 0:
            return time.monotonic() - t0
        time.sleep(0.5)
    return timeout_s


def f_preemption(ctx: Ctx) -> dict[str, Any]:
    """PREEMPT_REQUESTS concurrent long requests on the small-KV server: preempted (vLLM's counter rises),
    outputs identical to ``ref``."""
    if ctx.preempt is None:
        raise ServeError("feature 'preemption' needs the preempt server")
    prompts = [ctx.prompts[i % len(ctx.prompts)] for i in range(PREEMPT_REQUESTS)]
    kw = {"max_tokens": PREEMPT_TOKENS, "extra_body": {"ignore_eos": True}}
    before = scrape(ctx.preempt_url)
    with cf.ThreadPoolExecutor(PREEMPT_REQUESTS) as pool:
        got = list(pool.map(lambda p: texts(complete(ctx.preempt, ctx.model, p, **kw))[0], prompts))
    after = scrape(ctx.preempt_url)
    want = [texts(complete(ctx.ref, ctx.model, p, **kw))[0] for p in prompts]
    same = sum(a == b for a, b in zip(got, want))
    pre = after.get("vllm:num_preemptions_total", 0.0) - before.get("vllm:num_preemptions_total", 0.0)
    delta = spec_delta(before, after)
    return {
        "ok": same == len(prompts) and pre > 0 and delta["accepted_tokens"] > 0,
        "identical": same,
        "compared": len(prompts),
        "preemptions": pre,
        "spec": delta,
    }


def draw(c: Any, model: str, prompt: str, samples: int) -> list[str]:
    """``samples`` completions of SAMPLE_TOKENS tokens at temperature 1 (n per request: SAMPLES_PER_REQUEST)."""
    reqs = -(-samples // SAMPLES_PER_REQUEST)
    with cf.ThreadPoolExecutor(16) as pool:
        outs = pool.map(
            lambda _: texts(
                complete(c, model, prompt, temperature=1.0, max_tokens=SAMPLE_TOKENS, n=SAMPLES_PER_REQUEST)
            ),
            range(reqs),
        )
        return [t for o in outs for t in o][:samples]


def f_sampling(ctx: Ctx, samples: int = SAMPLES) -> dict[str, Any]:
    per_prompt = []
    for p in ctx.prompts[CARRIERS : CARRIERS + SAMPLE_PROMPTS]:
        a, b = draw(ctx.ref, ctx.model, p, samples), draw(ctx.spec, ctx.model, p, samples)
        stat, dof, pval = chi_square_two_sample(a, b)
        _, _, p_biased = chi_square_two_sample(a, biased(b, fraction=BIAS_FRACTION))
        per_prompt.append({"samples": [len(a), len(b)], "chi2": stat, "dof": dof, "p": pval, "p_biased": p_biased})
    ok = all(r["p"] > P_MIN and r["p_biased"] <= P_MIN for r in per_prompt)
    return {"ok": ok, "per_prompt": per_prompt}


FEATURES: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "streaming": f_streaming,
    "stop": f_stop,
    "max_tokens_1": f_max_tokens_1,
    "top_p_top_k": f_top_p_top_k,
    "logprobs": f_logprobs,
    "n2": f_n2,
    "long_prompt": f_long_prompt,
    "json_schema": f_json_schema,
    "cancel_stream": f_cancel_stream,
    "preemption": f_preemption,
    "sampling": f_sampling,
}
OWN_WINDOW = ("preemption",)  # features that measure acceptance on their own server


def run_feature(ctx: Ctx, name: str) -> dict[str, Any]:
    if name not in FEATURES:
        raise ServeError(f"unknown feature {name!r}: use one of {', '.join(FEATURES)}")
    if name in OWN_WINDOW:
        return FEATURES[name](ctx)
    out = with_carriers(ctx, lambda: FEATURES[name](ctx))
    if name == "cancel_stream":
        out["idle_after_s"] = wait_idle(ctx.spec_url)
        out["ok"] = out["ok"] and out["idle_after_s"] < IDLE_WAIT_S
    return out
