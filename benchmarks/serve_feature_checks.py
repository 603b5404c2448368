"""The features serve_features checks, one function each (``FEATURES``), run on one spec server (a mode) with
nothing else on it: its requests are the feature's own, and vLLM's spec-decode counters over the feature's window
(``solo``) say whether drafts were accepted on them. Greedy features send their requests to the no-speculation
server ``ref`` once and to ``spec`` PASSES times (the second pass meets its own first answer in the drafter's cache)
and require identical outputs and accepted draft tokens; ``max_tokens_1`` has no decoding step to draft for, so it
requires that nothing was drafted instead. ``sampling`` tests the target's distribution at an output position where
drafts are accepted (``sampling_test``).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.serve_common import ServeError, scrape, spec_delta
from benchmarks.serve_sampling import sampling_test

MAX_MODEL_LEN = 1024  # the shared target's training length: past ~1,200 tokens it no longer continues a copy
PREEMPT_REQUESTS = 64
PREEMPT_TOKENS = 256
MAX_TOKENS = 96
PASSES = 2
TOP_P_ONE = 0.01  # a top_p that keeps only the top token wherever it holds at least 1% of the probability
FEATURE_PROMPTS = 4
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
    sampling: list[list[int]] = field(default_factory=list)  # token ids of the sampling prompts for this position
    sampling_position: int = 2  # the output position the sampling check tests (serve_sampling.TESTED_POSITION)
    peer: Any = None  # vLLM's own ngram server: a feature that fails on spec is re-run there (attribution)
    peer_url: str = ""


def client(base_url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)


def complete(c: Any, model: str, prompt: Any, **kw: Any) -> Any:
    return c.completions.create(model=model, prompt=prompt, **{"temperature": 0.0, "max_tokens": MAX_TOKENS, **kw})


def texts(resp: Any) -> list[str]:
    return [ch.text for ch in sorted(resp.choices, key=lambda ch: ch.index)]


def feature_prompts(ctx: Ctx, count: int = FEATURE_PROMPTS) -> list[str]:
    return ctx.prompts[:count]


def solo(url: str, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``body`` (the only traffic on the server at ``url``) and add vLLM's spec-decode delta over it; ok also
    needs accepted draft tokens, or, where ``body`` says its requests have no step to draft for (``draft_step``
    False), nothing drafted."""
    before = scrape(url)
    out = body()
    out["spec"] = delta = spec_delta(before, scrape(url))
    drafted_ok = delta["accepted_tokens"] > 0 if out.get("draft_step", True) else delta["draft_tokens"] == 0
    out["ok"] = bool(out.get("ok")) and drafted_ok
    return out


def _same(ctx: Ctx, prompts: list[Any], passes: int = PASSES, **kw: Any) -> dict[str, Any]:
    """Greedy requests to ``ref`` once and to ``spec`` ``passes`` times; identical texts and finish reasons
    required on every pass."""
    want = [complete(ctx.ref, ctx.model, p, **kw) for p in prompts]
    same, first = 0, None
    for k in range(passes):
        got = [complete(ctx.spec, ctx.model, p, **kw) for p in prompts]
        for i, (x, y) in enumerate(zip(want, got)):
            if texts(x) == texts(y) and [c.finish_reason for c in x.choices] == [c.finish_reason for c in y.choices]:
                same += 1
            elif first is None:
                first = mismatch(k, i, texts(x), texts(y))
    return tally(same, passes * len(prompts), first)


def tally(same: int, compared: int, first: dict[str, Any] | None = None) -> dict[str, Any]:
    """A comparison's result: ok when every output was identical; where one was not, its ``first_mismatch``."""
    out = {"ok": same == compared, "identical": same, "compared": compared}
    return {**out, "first_mismatch": first} if first else out


def mismatch(passed: int, index: int, want: list[str], got: list[str]) -> dict[str, Any]:
    """Where a comparison first differs: the pass, the prompt, the character and both texts from just before it."""
    a, b = "\x1e".join(want), "\x1e".join(got)  # choices joined by a record separator
    at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"pass": passed, "prompt": index, "char": at, "ref": a[max(0, at - 20) : at + 60],
            "spec": b[max(0, at - 20) : at + 60]}  # fmt: skip


def f_streaming(ctx: Ctx) -> dict[str, Any]:
    prompts = feature_prompts(ctx)
    want = [texts(complete(ctx.ref, ctx.model, p))[0] for p in prompts]
    same = 0
    for _ in range(PASSES):
        got = [
            "".join(ch.choices[0].text for ch in complete(ctx.spec, ctx.model, p, stream=True) if ch.choices)
            for p in prompts
        ]
        same += sum(a == b for a, b in zip(got, want))
    return tally(same, PASSES * len(prompts))


def f_stop(ctx: Ctx) -> dict[str, Any]:
    return _same(ctx, feature_prompts(ctx), stop=["\n\n", "return "])


def f_max_tokens_1(ctx: Ctx) -> dict[str, Any]:
    """One token comes from the prefill step: there is no decoding step to draft for (``draft_step`` False)."""
    return {**_same(ctx, feature_prompts(ctx), max_tokens=1), "draft_step": False}


def f_top_k_1(ctx: Ctx) -> dict[str, Any]:
    """Sampling at temperature 1 with top_k 1 keeps one candidate: the greedy text."""
    return _one_candidate(ctx, extra_body={"top_k": 1})


def f_top_p_small(ctx: Ctx) -> dict[str, Any]:
    """Sampling at temperature 1 with top_p TOP_P_ONE keeps one candidate (the top token holds more): the greedy
    text. (A top_p below float32's epsilon is vLLM 0.26's bug, not a plugin's: its Triton top-p kernel, which
    samples 8+ rows, ends such outputs early with or without speculation; benchmarks/vllm_top_p_check.py.)"""
    return _one_candidate(ctx, top_p=TOP_P_ONE)


def _one_candidate(ctx: Ctx, n: int = 1, **kw: Any) -> dict[str, Any]:
    """Requests at temperature 1 whose ``kw`` leave one candidate: each of the ``n`` choices the greedy text."""
    prompts = feature_prompts(ctx, 3)
    want = [[texts(complete(ctx.ref, ctx.model, p))[0]] * n for p in prompts]
    same, first = 0, None
    for k in range(PASSES):
        for i, p in enumerate(prompts):
            got = texts(complete(ctx.spec, ctx.model, p, temperature=1.0, n=n, **kw))
            same += got == want[i]
            first = first or (mismatch(k, i, want[i], got) if got != want[i] else None)
    return tally(same, PASSES * len(prompts), first)


def f_logprobs(ctx: Ctx) -> dict[str, Any]:
    prompts = feature_prompts(ctx, 3)
    worst, same = 0.0, 0
    for p in prompts:
        a = complete(ctx.ref, ctx.model, p, logprobs=5).choices[0].logprobs
        for _ in range(PASSES):
            b = complete(ctx.spec, ctx.model, p, logprobs=5).choices[0].logprobs
            same += a.tokens == b.tokens and [set(x) for x in a.top_logprobs] == [set(x) for x in b.top_logprobs]
            if a.tokens == b.tokens:
                worst = max([worst, *(abs(x - y) for x, y in zip(a.token_logprobs, b.token_logprobs))])
    compared = PASSES * len(prompts)
    return {"ok": same == compared and worst <= LOGPROB_ATOL, "identical": same, "compared": compared,
            "max_logprob_diff": worst}  # fmt: skip


def f_n2(ctx: Ctx) -> dict[str, Any]:
    """n=2 (vLLM refuses n > 1 at temperature 0): temperature 1 with top_k 1, both choices the greedy text."""
    return _one_candidate(ctx, n=2, extra_body={"top_k": 1})


def f_long_prompt(ctx: Ctx) -> dict[str, Any]:
    """A prompt of max_model_len - 1 tokens (room for one), and one of max_model_len - 8 (drafts must be cut)."""
    if not ctx.long_ids:
        raise ServeError("feature 'long_prompt' needs token ids (the tokenizer of --model)")
    out = _same(ctx, [ctx.long_ids[-(MAX_MODEL_LEN - 1) :]], max_tokens=1)
    drafting = ctx.long_ids[-(MAX_MODEL_LEN - 8) :]
    out8 = _same(ctx, [drafting], max_tokens=7)
    # the target's own continuation (the copy's rest when it follows the copy, which the drafter proposes)
    ref_ids = complete(ctx.ref, ctx.model, drafting, max_tokens=7, extra_body={"return_token_ids": True})
    return {"ok": out["ok"] and out8["ok"], "identical": out["identical"] + out8["identical"],
            "compared": out["compared"] + out8["compared"], "ref_text": texts(ref_ids)[0],
            "ref_token_ids": getattr(ref_ids.choices[0], "token_ids", None)}  # fmt: skip


def f_json_schema(ctx: Ctx) -> dict[str, Any]:
    import openai

    prompts = [p + "\n# the result as JSON:\n" for p in feature_prompts(ctx, 2)]
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
    return {**out, "valid_json": parsed}  # ref's texts are the same: a 64-token cut may leave both unclosed


def f_cancel_stream(ctx: Ctx) -> dict[str, Any]:
    """A streaming request closed after a few chunks: the server drops it (no request left running) and answers
    the next request exactly. The window holds the cancelled stream only: the same prompt was answered in full
    just before it, so its drafts come from the cache."""
    prompt, kw = ctx.prompts[0], {"max_tokens": 512, "extra_body": {"ignore_eos": True}}
    complete(ctx.spec, ctx.model, prompt, **kw)

    def cancelled() -> dict[str, Any]:
        got = 0
        stream = complete(ctx.spec, ctx.model, prompt, stream=True, **kw)
        for _ in stream:
            got += 1
            if got >= 5:
                break
        stream.close()
        return {"ok": True, "chunks_read": got, "idle_after_s": wait_idle(ctx.spec_url)}

    out = solo(ctx.spec_url, cancelled)
    after = _same(ctx, ctx.prompts[1:2], passes=1)
    out["ok"] = out["ok"] and out["idle_after_s"] < IDLE_WAIT_S and after["ok"]
    return {**out, "next_request": after}


def wait_idle(url: str, timeout_s: float = IDLE_WAIT_S) -> float:
    """Seconds until /metrics shows no running request (``timeout_s`` if never)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if scrape(url).get("vllm:num_requests_running", 0.0) == 0:
            return time.monotonic() - t0
        time.sleep(0.5)
    return timeout_s


def f_preemption(ctx: Ctx) -> dict[str, Any]:
    """PREEMPT_REQUESTS concurrent long requests on the spec server, whose KV cache is small (serve_features'
    PREEMPT_BLOCKS): preempted (vLLM's counter rises), outputs identical to ``ref``."""
    prompts = [ctx.prompts[i % len(ctx.prompts)] for i in range(PREEMPT_REQUESTS)]
    kw = {"max_tokens": PREEMPT_TOKENS, "extra_body": {"ignore_eos": True}}
    before = scrape(ctx.spec_url)
    with cf.ThreadPoolExecutor(PREEMPT_REQUESTS) as pool:
        got = list(pool.map(lambda p: texts(complete(ctx.spec, ctx.model, p, **kw))[0], prompts))
    after = scrape(ctx.spec_url)
    want = [texts(complete(ctx.ref, ctx.model, p, **kw))[0] for p in prompts]
    differ = [i for i, (a, b) in enumerate(zip(want, got)) if a != b]
    first = mismatch(0, differ[0], [want[differ[0]]], [got[differ[0]]]) if differ else None
    out = tally(len(prompts) - len(differ), len(prompts), first)
    pre = after.get("vllm:num_preemptions_total", 0.0) - before.get("vllm:num_preemptions_total", 0.0)
    delta = spec_delta(before, after)
    return {**out, "ok": out["ok"] and pre > 0 and delta["accepted_tokens"] > 0, "preemptions": pre, "spec": delta}


FEATURES: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "streaming": f_streaming,
    "stop": f_stop,
    "max_tokens_1": f_max_tokens_1,
    "top_k_1": f_top_k_1,
    "top_p_small": f_top_p_small,
    "logprobs": f_logprobs,
    "n2": f_n2,
    "long_prompt": f_long_prompt,
    "json_schema": f_json_schema,
    "cancel_stream": f_cancel_stream,
    "preemption": f_preemption,
    "sampling": lambda ctx: sampling_test(
        ctx.ref, ctx.spec, spec_url=ctx.spec_url, model=ctx.model, prompts=ctx.sampling, position=ctx.sampling_position
    ),
}
OWN_WINDOW = ("preemption", "cancel_stream", "sampling")  # features that measure their own window


def run_feature(ctx: Ctx, name: str) -> dict[str, Any]:
    """The feature on ``ctx.spec``; a greedy feature whose outputs differ from ``ref`` runs again on the peer
    (vLLM ngram, with the spec servers' small KV cache, so it preempts too): ``peer`` says whether vLLM's own
    speculation differs the same way."""
    if name not in FEATURES:
        raise ServeError(f"unknown feature {name!r}: use one of {', '.join(FEATURES)}")
    out = FEATURES[name](ctx) if name in OWN_WINDOW else solo(ctx.spec_url, lambda: FEATURES[name](ctx))
    if out.get("identical", 0) < out.get("compared", 0) and ctx.peer is not None:
        peer = FEATURES[name](replace(ctx, spec=ctx.peer, spec_url=ctx.peer_url))
        out["peer"] = {k: peer[k] for k in ("identical", "compared", "first_mismatch") if k in peer}
    return out
