"""Feature parity through the `openai` client: `vllm serve` with specdec against a no-speculation server.

    python -m benchmarks.serve_features --out-dir $OUT                      # GPU: every feature, JSON + log files
    python -m benchmarks.serve_features --features streaming,stop --out-dir $OUT

Three servers on loopback (float32, the shared 53M target, started one after another so memory profiling does not
see the others): ``ref`` (no speculation), ``spec`` (``--spec``, default ``{"method": "specdec"}``) and
``preempt`` (the same spec with only PREEMPT_BLOCKS KV blocks, so PREEMPT_REQUESTS long requests overflow the KV
cache). Each feature sends the same greedy requests to ``ref`` and to ``spec`` and requires identical outputs;
while it runs, CARRIERS greedy code requests go to ``spec`` too (outputs checked the same way) and the feature
passes only if vLLM's accepted-token counter rose during it: a feature that passes because nothing was drafted
proves nothing. ``sampling``: temperature 1, the first SAMPLE_TOKENS tokens of >= SAMPLES samples per prompt on
each server, two-sample chi-square p > P_MIN; a deliberately biased copy of the spec samples must fail it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.serve_common import (
    ServeError,
    Server,
    check_reachable,
    device_name,
    free_port,
    scrape,
    spec_delta,
    write_json,
)
from benchmarks.serve_stats import biased, chi_square_two_sample
from specdec.eval.results import installed_versions

MAX_MODEL_LEN = 2048
SERVER_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--gpu-memory-utilization",
    "0.25",
    "--seed",
    "0",
]
PREEMPT_BLOCKS = 256  # 4,096 tokens of KV cache (block size 16): far below PREEMPT_REQUESTS long requests
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


# --------------------------------------------------------------------------- CLI
def long_prompt_ids(model: str, prompts: list[str]) -> list[int]:
    """At least MAX_MODEL_LEN token ids (BOS first) from the prompts, tokenized with the model's tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    ids: list[int] = []
    for p in prompts:
        ids += tok.encode(p, add_special_tokens=False).ids
        if len(ids) > MAX_MODEL_LEN:
            break
    if len(ids) <= MAX_MODEL_LEN:
        raise ServeError(f"the prompts give {len(ids)} tokens; the long-prompt feature needs {MAX_MODEL_LEN + 1}")
    return [0, *ids[-(MAX_MODEL_LEN - 1) :]]


def start_servers(args: argparse.Namespace, stack: list[Server]) -> dict[str, Server]:
    """ref, spec (and preempt) one after another; each appended to ``stack`` as soon as it exists."""
    extra = SERVER_ARGS + args.server_args
    plan = {"ref": (None, extra), "spec": (args.spec, extra)}
    if "preemption" in args.features:
        plan["preempt"] = (args.spec, [*extra, "--num-gpu-blocks-override", str(PREEMPT_BLOCKS)])
    out = {}
    for name, (spec, sargs) in plan.items():
        srv = Server(
            args.model,
            port=free_port(),
            log=Path(args.out_dir) / f"features-{name}.log",
            spec=spec,
            server_args=sargs,
            cli=args.vllm_cli,
        )
        stack.append(srv)
        out[name] = srv.start(args.health_timeout_s)
    return out


def make_ctx(args: argparse.Namespace, servers: dict[str, Server], prompts: list[str]) -> Ctx:
    ids = long_prompt_ids(args.model, prompts) if "long_prompt" in args.features else []
    pre = servers.get("preempt")
    return Ctx(
        model=args.model,
        ref=client(servers["ref"].base_url),
        spec=client(servers["spec"].base_url),
        spec_url=servers["spec"].base_url,
        prompts=prompts,
        long_ids=ids,
        preempt=client(pre.base_url) if pre else None,
        preempt_url=pre.base_url if pre else "",
    )


def load_prompts(path: Path, pool: str = "code") -> list[str]:
    from benchmarks.serve_inputs import load_pools

    pools = load_pools(path)
    if pool not in pools:
        raise ServeError(f"{path}: no pool {pool!r} (pools: {sorted(pools)})")
    return [r["prompt"] for r in pools[pool]]


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    prompts = load_prompts(Path(args.prompts))
    doc: dict[str, Any] = {
        "command": sys.argv,
        "device": device_name(),
        "versions": installed_versions(),
        "spec": args.spec,
        "server_args": SERVER_ARGS + args.server_args,
        "features": {},
    }
    stack: list[Server] = []
    try:
        servers = start_servers(args, stack)
        for srv in servers.values():
            check_reachable(srv.base_url)
        ctx = make_ctx(args, servers, prompts)
        for name in args.features:
            try:
                doc["features"][name] = run_feature(ctx, name)
            except Exception as exc:  # noqa: BLE001 - one feature's failure is a result, the others still run
                doc["features"][name] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"{name}: {'ok' if doc['features'][name]['ok'] else 'FAILED'}", flush=True)
    finally:
        doc["exit_codes"] = {srv.log.stem: srv.stop() for srv in stack}
    doc["ok"] = all(f["ok"] for f in doc["features"].values()) and len(doc["features"]) == len(args.features)
    return doc


def _features(text: str) -> list[str]:
    names = [f for f in text.split(",") if f]
    for f in names:
        if f not in FEATURES:
            raise ServeError(f"unknown feature {f!r}: use one of {', '.join(FEATURES)}")
    return names


def main(argv: list[str] | None = None) -> int:
    from specdec.paths import TARGET_MODEL, model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="device_inputs/serve_prompts.json", help="from `serve_bench prepare`")
    ap.add_argument("--model", default=str(model_path(TARGET_MODEL)))
    ap.add_argument("--spec", default='{"method": "specdec"}', type=json.loads)
    ap.add_argument("--features", default=",".join(FEATURES))
    ap.add_argument("--server-args", default="", type=lambda s: s.split(), help="added to every server")
    ap.add_argument("--health-timeout-s", type=float, default=600.0)
    ap.add_argument("--vllm-cli", default="")
    ap.add_argument("--out-dir", default="eval/results/serve")
    args = ap.parse_args(argv)
    try:
        args.features = _features(args.features)
        doc = run_all(args)
    except ServeError as exc:
        print(f"serve_features: {exc}", file=sys.stderr)
        return 2
    write_json(Path(args.out_dir) / "serve_features.json", doc)
    print(json.dumps({k: v["ok"] for k, v in doc["features"].items()}))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
