"""Feature parity through the `openai` client: `vllm serve` with specdec against a no-speculation server.

    python -m benchmarks.serve_features --out-dir $OUT                      # GPU: every feature, both modes
    python -m benchmarks.serve_features --features streaming,stop --modes schedule --out-dir $OUT

Servers on loopback (float32, the shared 53M target, started one after another so memory profiling does not see
the others): ``ref`` (no speculation) and ``peer`` (vLLM ngram, ``--peer``: a greedy feature that differs from
``ref`` runs again there, to tell vLLM's own differences from the plugin's) for the whole run, then per mode
(``--modes``: the plugin's ``async_mode``, thread and schedule) ``spec`` (``--spec`` with that mode and only
PREEMPT_BLOCKS KV blocks, so the preemption feature's PREEMPT_REQUESTS long requests overflow it), stopped before
the next mode's start. Every feature runs on a spec server with nothing else on it, so
vLLM's spec-decode counters over its window count its own requests: greedy features must match ``ref`` and have
drafts accepted (serve_feature_checks), ``sampling`` tests the target's distribution where drafts are accepted
(serve_sampling).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.serve_common import (
    METHODS,
    MODES,
    Budget,
    ServeError,
    Server,
    check_reachable,
    device_name,
    free_port,
    parse_names,
    write_json,
)
from benchmarks.serve_feature_checks import FEATURES, MAX_MODEL_LEN, Ctx, client, run_feature
from benchmarks.serve_sampling import P_MIN, SAMPLES, TESTED_POSITION, load_sampling_prompts
from specdec.eval.results import installed_versions

# this driver's public names; P_MIN and SAMPLES are re-exported for the tests that read them here
__all__ = [
    "FEATURES",
    "MAX_MODEL_LEN",
    "MODES",
    "P_MIN",
    "PREEMPT_BLOCKS",
    "SAMPLES",
    "SERVER_ARGS",
    "Ctx",
    "load_prompts",
    "copy_unit",
    "long_prompt_ids",
    "long_prompt_offset",
    "main",
    "make_ctx",
    "run_all",
    "run_feature",
    "start_server",
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
PREEMPT_BLOCKS = 256  # the spec servers' KV cache: 4,096 tokens (block size 16), far below PREEMPT_REQUESTS long
# requests, enough for one max_model_len request and for the sampling requests (SAMPLE_THREADS x n, prefix shared)
# the peer verifies as many draft tokens as the plugin's default k, so a failure tied to the verified width (vLLM
# samples 8+ rows with another top-k/top-p kernel than fewer) shows on both
PEER_WIDTH = {"num_speculative_tokens": 16}
SMALL_KV = ["--num-gpu-blocks-override", str(PREEMPT_BLOCKS)]  # the spec servers' and the peer's KV cache
BOS = 0  # the shared tokenizer's <|endoftext|>, which the serve prompts start with
LONG_PROMPT_FILE = Path(__file__).with_name("long_prompt.json")  # where the long prompt ends (benchmarks.long_prompt)
NOT_RUN = {"ok": False, "skipped": "not run: --time-budget-s ran out"}  # a feature past the time budget


# --------------------------------------------------------------------------- CLI
def copy_unit(model: str, prompts: list[str]) -> list[int]:
    """The token ids the long prompt repeats: the code pool's first prompt, its BOS dropped."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    unit = [t for t in tok.encode(prompts[0], add_special_tokens=False).ids if t != BOS] if prompts else []
    if len(unit) < 2:
        raise ServeError("the long-prompt feature needs a prompt of 2+ tokens (the code pool's first is not)")
    return unit


def long_prompt_offset(path: Path = LONG_PROMPT_FILE) -> int:
    if not path.exists():
        raise ServeError(f"{path} missing: pick the long prompt's end with `python -m benchmarks.long_prompt`")
    return int(json.loads(path.read_text())["offset"])


def long_prompt_ids(model: str, prompts: list[str], *, offset: int) -> list[int]:
    """MAX_MODEL_LEN token ids (BOS first): ``copy_unit`` repeated, ending ``offset`` tokens into a copy, so the
    drafter proposes the rest of that copy (``benchmarks.long_prompt`` picks an offset where the target follows
    it near max_model_len)."""
    unit = copy_unit(model, prompts)
    body = MAX_MODEL_LEN - 1
    ids = unit * (body // len(unit) + 2)
    end = (body // len(unit) + 1) * len(unit) + offset % len(unit)
    return [BOS, *ids[end - body : end]]


def start_server(args: argparse.Namespace, stack: list[Server], name: str, spec: Any, extra: list[str]) -> Server:
    """One server, appended to ``stack`` as soon as it exists (so it is stopped whatever happens), started."""
    srv = Server(
        args.model,
        port=free_port(),
        log=Path(args.out_dir) / f"features-{name}.log",
        spec=spec,
        server_args=SERVER_ARGS + args.server_args + extra,
        cli=args.vllm_cli,
    )
    stack.append(srv)
    srv.start(args.health_timeout_s)
    check_reachable(srv.base_url)
    return srv


def make_ctx(args: argparse.Namespace, servers: dict[str, Server], prompts: list[str], *, mode: str) -> Ctx:
    ids = long_prompt_ids(args.model, prompts, offset=long_prompt_offset()) if "long_prompt" in args.features else []
    position = TESTED_POSITION[mode]
    peer = servers.get("peer")
    return Ctx(
        model=args.model,
        ref=client(servers["ref"].base_url),
        spec=client(servers["spec"].base_url),
        spec_url=servers["spec"].base_url,
        prompts=prompts,
        long_ids=ids,
        sampling=load_sampling_prompts(position) if "sampling" in args.features else [],
        sampling_position=position,
        peer=client(peer.base_url) if peer else None,
        peer_url=peer.base_url if peer else "",
    )


def load_prompts(path: Path, pool: str = "code") -> list[str]:
    from benchmarks.serve_inputs import load_pools

    pools = load_pools(path)
    if pool not in pools:
        raise ServeError(f"{path}: no pool {pool!r} (pools: {sorted(pools)})")
    return [r["prompt"] for r in pools[pool]]


def run_mode(
    args: argparse.Namespace, base: dict[str, Server], mode: str, prompts: list[str], results: dict[str, Any]
) -> None:
    """The spec server of one mode, every feature on it (into ``results`` as each ends, saved by ``args.save``),
    the server stopped."""
    spec = {**args.spec, "async_mode": mode}
    stack: list[Server] = []
    try:
        servers = {**base, "spec": start_server(args, stack, f"spec-{mode}", spec, SMALL_KV)}
        ctx = make_ctx(args, servers, prompts, mode=mode)
        for name in args.features:
            if args.budget.left() <= 0:
                results[name] = dict(NOT_RUN)
                continue
            try:
                results[name] = run_feature(ctx, name)
            except Exception as exc:  # noqa: BLE001 - one feature's failure is a result, the others still run
                results[name] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"{mode} {name}: {'ok' if results[name]['ok'] else 'FAILED'}", flush=True)
            args.save()
    finally:
        results["exit_codes"] = {srv.log.stem: srv.stop() for srv in stack}


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    prompts = load_prompts(Path(args.prompts))
    doc: dict[str, Any] = {
        "command": sys.argv,
        "device": device_name(),
        "versions": installed_versions(),
        "spec": args.spec,
        "server_args": SERVER_ARGS + args.server_args,
        "modes": {},
    }
    stack: list[Server] = []
    try:
        base = {"ref": start_server(args, stack, "ref", None, [])}
        if args.peer:
            base["peer"] = start_server(args, stack, "peer", {**METHODS[args.peer], **PEER_WIDTH}, SMALL_KV)
        args.save = lambda: write_json(Path(args.out_dir) / "serve_features.json", {**doc, "partial": True})
        for mode in args.modes:
            if args.budget.left() <= 0:  # no spec server started past the budget (its start alone takes minutes)
                doc["modes"][mode] = {f: dict(NOT_RUN) for f in args.features}
                continue
            run_mode(args, base, mode, prompts, doc["modes"].setdefault(mode, {}))
    finally:
        doc["exit_codes"] = {srv.log.stem: srv.stop() for srv in stack}
    doc["ok"] = len(doc["modes"]) == len(args.modes) and all(
        name in res and res[name]["ok"] for res in doc["modes"].values() for name in args.features
    )
    return doc


def main(argv: list[str] | None = None) -> int:
    from specdec.paths import TARGET_MODEL, model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="device_inputs/serve_prompts.json", help="from `serve_bench prepare`")
    ap.add_argument("--model", default=str(model_path(TARGET_MODEL)))
    ap.add_argument("--spec", default='{"method": "specdec"}', type=json.loads)
    ap.add_argument("--features", default=",".join(FEATURES))
    ap.add_argument("--modes", default=",".join(MODES), help="the plugin's async_mode per spec server")
    ap.add_argument(
        "--peer", default="ngram", choices=["ngram", ""], help="vLLM's method that failing features rerun on"
    )
    ap.add_argument("--server-args", default="", type=lambda s: s.split(), help="added to every server")
    ap.add_argument("--health-timeout-s", type=float, default=600.0)
    ap.add_argument("--vllm-cli", default="")
    ap.add_argument("--out-dir", default="eval/results/serve")
    ap.add_argument(
        "--time-budget-s",
        type=float,
        default=0.0,
        help="start no feature or mode past this, so one device call ends with its results (0: no limit)",
    )
    args = ap.parse_args(argv)
    args.budget = Budget(args.time_budget_s if args.time_budget_s > 0 else float("inf"))
    try:
        args.features = parse_names(args.features, FEATURES, what="feature")
        args.modes = parse_names(args.modes, MODES, what="mode")
        doc = run_all(args)
    except ServeError as exc:
        print(f"serve_features: {exc}", file=sys.stderr)
        return 2
    write_json(Path(args.out_dir) / "serve_features.json", doc)
    print(json.dumps({m: {k: v["ok"] for k, v in res.items() if k in FEATURES} for m, res in doc["modes"].items()}))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
