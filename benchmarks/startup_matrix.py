"""Start-up matrix: does each engine configuration start with each method, and what does it cost?

For every (configuration, method) pair one engine starts in a subprocess of its own (vLLM's own defaults, plus
only the configuration's keys), serves a few greedy requests, and stops. From the engine's log and the process:
start-up seconds, KV-cache blocks, CUDA graphs vLLM profiled (per mode) and their estimated and actual memory,
the graphs specdec added and their bytes, and whether the greedy outputs equal no speculation's (use
``--dtype float32`` for exact equality).

    python benchmarks/startup_matrix.py --model M --prompts device_inputs/prompts.json \\
        --configs defaults,seqs16,seqs256 --methods nospec,suffix,specdec --out-dir $OUT

Writes ``<out-dir>/startup_matrix.json`` (rows, command, versions) and a Markdown table beside it; each engine's
full log is ``<out-dir>/logs/<config>_<method>.log`` (not returned by default: logs can be large).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from specdec.eval.results import installed_versions

CONFIGS: dict[str, dict[str, Any]] = {  # name -> engine keyword arguments beyond vLLM's defaults
    "defaults": {},
    "seqs16": {"max_num_seqs": 16},
    "seqs256": {"max_num_seqs": 256},
    "seqs1024": {"max_num_seqs": 1024},
    "mem0.5": {"gpu_memory_utilization": 0.5},
    "mem0.6": {"gpu_memory_utilization": 0.6},
    "len2048": {"max_model_len": 2048},
    "eager": {"enforce_eager": True},
    "noprefix": {"enable_prefix_caching": False},
    "nochunk": {"enable_chunked_prefill": False},
    "bench": {"max_num_seqs": 64, "gpu_memory_utilization": 0.5, "max_model_len": 2048},
}
METHODS: dict[str, dict[str, Any] | None] = {
    "nospec": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix"},
    "specdec": {"method": "specdec"},
}
REPEAT = "#"  # "specdec#2": the same method started again (a warm compile cache)
REQUESTS = 8  # greedy requests each engine serves
MAX_TOKENS = 64  # new tokens per request
LOG_PATTERNS = {  # vLLM 0.26's start-up lines (and specdec's own)
    "graph_profile": re.compile(r"Profiling CUDA graph memory: (.*)"),
    "graph_estimate_gib": re.compile(r"Estimated CUDA graph memory: ([\d.]+) GiB total"),
    "graph_mode_estimate": re.compile(
        r"Estimated (\w+) CUDA graph memory: (-?[\d.]+) MiB first-capture \+ "
        r"\((\d+)-1\) × ([\d.]+) MiB per-graph"
    ),
    "kv_cache_gib": re.compile(r"Available KV cache memory: (-?[\d.]+) GiB"),
    "kv_cache_tokens": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
    "graph_actual_gib": re.compile(r"CUDA graph pool memory: ([\d.]+) GiB \(actual\)"),
    "specdec_graphs": re.compile(r"specdec: (.*CUDA graphs.*)"),
    "specdec_patches": re.compile(r"specdec: (\d+/\d+ vLLM patches applied.*)"),
    "error": re.compile(r"((?:ValueError|RuntimeError|torch\.OutOfMemoryError|AssertionError): .*)"),
}


def child(spec: dict[str, Any]) -> None:
    """One engine: start, serve, report (JSON on the last stdout line)."""
    from vllm import LLM, SamplingParams

    prompts = spec["prompts"]
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], speculative_config=spec["speculative_config"], **spec["engine"])
    startup_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    cfg = llm.llm_engine.vllm_config
    report = {
        "startup_s": round(startup_s, 2),
        "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
        "block_size": cfg.cache_config.block_size,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_model_len": cfg.model_config.max_model_len,
        "max_cudagraph_capture_size": cfg.compilation_config.max_cudagraph_capture_size,
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
    }
    print("STARTUP_MATRIX_RESULT " + json.dumps(report), flush=True)


def parse_log(text: str) -> dict[str, Any]:
    """The start-up facts in one engine's log (first match of each pattern; every per-mode estimate)."""
    found: dict[str, Any] = {}
    for key, pattern in LOG_PATTERNS.items():
        if key == "graph_mode_estimate":
            found[key] = {
                mode: {"first_mib": float(first), "graphs": int(n), "per_graph_mib": float(per)}
                for mode, first, n, per in pattern.findall(text)
            }
            continue
        match = pattern.search(text)
        if match:
            value = match.group(1)
            found[key] = float(value.replace(",", "")) if re.fullmatch(r"-?[\d.,]+", value) else value.strip()
    return found


def run_one(args: argparse.Namespace, config: str, method: str, prompts: list[list[int]]) -> dict[str, Any]:
    spec = {
        "model": args.model,
        "dtype": args.dtype,
        "prompts": prompts,
        "speculative_config": METHODS[method.split(REPEAT)[0]],
        "engine": {**CONFIGS[config], **json.loads(args.engine_json or "{}")},
    }
    log_path = Path(args.out_dir) / "logs" / f"{config}_{method}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VLLM_LOGGING_LEVEL": args.log_level}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=args.timeout_s,
            check=False,
        )
        text, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        text, rc = (out.decode() if isinstance(out, bytes) else out), "timeout"
    log_path.write_text(text)
    row: dict[str, Any] = {
        "config": config,
        "method": method,
        "engine": spec["engine"],
        "rc": rc,
        "wall_s": round(time.perf_counter() - t0, 1),
        **parse_log(text),
    }
    for line in text.splitlines():
        if line.startswith("STARTUP_MATRIX_RESULT "):
            row.update(json.loads(line.split(" ", 1)[1]))
    row["started"] = "num_gpu_blocks" in row
    return row


def compare(rows: list[dict[str, Any]]) -> None:
    """Each row's greedy outputs against no speculation's in the same configuration (``same_as_nospec``)."""
    base = {r["config"]: r.get("outputs") for r in rows if r["method"] == "nospec" and r.get("outputs")}
    first = next(iter(base.values()), None)  # configurations without a no-spec engine of their own compare to it
    for r in rows:
        ref = base.get(r["config"], first)
        if not r["method"].startswith("nospec") and ref is not None and r.get("outputs") is not None:
            r["prompts_differing"] = sum(a != b for a, b in zip(ref, r["outputs"]))


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| config | method | started | start-up s | KV blocks | graphs profiled | est. graph GiB | actual "
        "graph GiB | differing prompts |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        started = "yes" if r["started"] else "NO: " + str(r.get("error", r["rc"]))[:80]
        lines.append(
            f"| {r['config']} | {r['method']} | {started} | "
            f"{r.get('startup_s', '')} | {r.get('num_gpu_blocks', '')} | {r.get('graph_profile', '')} | "
            f"{r.get('graph_estimate_gib', '')} | {r.get('graph_actual_gib', '')} | "
            f"{r.get('prompts_differing', '')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="")
    ap.add_argument("--prompts", default="device_inputs/prompts.json", help="prepare_prompts output (code set)")
    ap.add_argument("--configs", default="defaults", type=lambda s: s.split(","))
    ap.add_argument("--methods", default="nospec,suffix,specdec", type=lambda s: s.split(","))
    ap.add_argument(
        "--nospec-configs",
        default="",
        type=lambda s: [c for c in s.split(",") if c],
        help="run no speculation only in these configurations (the others compare to the first one's)",
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--engine-json", default="", help="JSON engine arguments added to every configuration")
    ap.add_argument(
        "--log-level", default="INFO", help="VLLM_LOGGING_LEVEL of the engines (DEBUG: per-mode graph memory estimates)"
    )
    ap.add_argument("--timeout-s", type=int, default=300)
    ap.add_argument("--name", default="startup_matrix")
    ap.add_argument("--out-dir", default="eval/results")
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    bad = [c for c in args.configs if c not in CONFIGS] + [m for m in args.methods if m.split(REPEAT)[0] not in METHODS]
    if bad:
        ap.error(
            f"unknown --configs/--methods value(s) {bad}; valid configs {sorted(CONFIGS)}, methods {sorted(METHODS)}"
        )
    if not Path(args.prompts).is_file():
        ap.error(f"--prompts {args.prompts}: no such file (python -m benchmarks.prepare_prompts writes it)")
    data = json.loads(Path(args.prompts).read_text())
    prompts = data["datasets"]["code"]["bs8"][:REQUESTS]  # HumanEval prompts
    rows = []
    for config in args.configs:
        for method in args.methods:
            if method == "nospec" and args.nospec_configs and config not in args.nospec_configs:
                continue
            row = run_one(args, config, method, prompts)
            rows.append(row)
            print(
                f"[startup_matrix] {config:>9} {method:>8}: started={row['started']} "
                f"start-up {row.get('startup_s')} s, KV blocks {row.get('num_gpu_blocks')}, "
                f"graphs {row.get('graph_profile')}, est {row.get('graph_estimate_gib')} GiB, "
                f"{row.get('error', '')}",
                flush=True,
            )
    compare(rows)
    for r in rows:
        r.pop("outputs", None)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "versions": installed_versions(),
        "model": args.model,
        "dtype": args.dtype,
        "requests": REQUESTS,
        "max_tokens": MAX_TOKENS,
        "rows": rows,
    }
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{args.name}.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
