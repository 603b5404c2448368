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
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.serve_common import (
    ServeError,
    Server,
    check_reachable,
    device_name,
    free_port,
    write_json,
)
from benchmarks.serve_feature_checks import (
    CARRIERS,
    FEATURES,
    MAX_MODEL_LEN,
    P_MIN,
    SAMPLES,
    Ctx,
    client,
    run_feature,
)
from specdec.eval.results import installed_versions

# this driver's public names; CARRIERS, P_MIN and SAMPLES are re-exported for the tests that read them here
__all__ = [
    "CARRIERS",
    "FEATURES",
    "MAX_MODEL_LEN",
    "P_MIN",
    "PREEMPT_BLOCKS",
    "SAMPLES",
    "SERVER_ARGS",
    "Ctx",
    "load_prompts",
    "long_prompt_ids",
    "main",
    "make_ctx",
    "run_all",
    "run_feature",
    "start_servers",
]

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
