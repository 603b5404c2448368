"""The vLLM benchmark's driver: each method's engine in a worker process of its own (``bench_vllm --worker``, under
``--method-timeout-s``), their results read back (whole, or the cells a cut-short worker finished) and joined, and
the results JSON + markdown written after every method."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_vllm_load import FIXED, VARIED, VARIED_LENGTH_SEED, VARIED_LENGTHS
from benchmarks.bench_vllm_methods import LOADS, LOSSLESS_MAX_TOKENS, SUSTAINED_SET, _spec_config
from benchmarks.bench_vllm_report import markdown, summarise
from benchmarks.gate_env import pythonpath
from benchmarks.step_trace import save_step_traces
from specdec.eval.model_shapes import SHAPES
from specdec.eval.results import installed_versions
from specdec.paths import TARGET_MODEL

ENGINE_INPROC_SETTING = "vLLM LLM(), engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), seed 0"
ENGINE_PROCESS_SETTING = (
    "vLLM LLM(), engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's "
    "default layout; drafting and GPU timers there, read through collective_rpc), seed 0"
)
TIMEOUT_RC = 124  # a worker past --method-timeout-s (killed): reported like timeout(1)
FIRST_ENGINE_EXTRA_S = 60  # the run's first engine also compiles (torch.compile) for the later ones, which start
# from vLLM's compile cache


def _spawn(
    args: argparse.Namespace,
    method: str,
    dtype: str,
    batches: list[int],
    max_tokens: int,
    eager: bool,
    tmp: Path,
    *,
    load: str = "closed",
    first: bool = False,
) -> dict[str, Any] | None:
    """One engine in its own worker process, under ``--method-timeout-s`` (``first``: the run's first engine,
    ``FIRST_ENGINE_EXTRA_S`` more); its result, or the cells it finished (``_read_worker``)."""
    out = tmp / f"{method}_{dtype}{'' if load == 'closed' else '_' + load}.json"
    cmd = _worker_cmd(args, method, dtype, batches=batches, max_tokens=max_tokens, eager=eager, out=out, load=load)
    what = f"{method} ({dtype}{'' if load == 'closed' else ', ' + load + ' load'})"
    print(f"=== {what} ===", flush=True)
    out.unlink(missing_ok=True)  # an earlier run's file must not stand in for this worker's
    t0 = time.perf_counter()
    path = json.loads(args.variants or "{}").get(method, {}).get("path")
    rc = run_worker(cmd, args.method_timeout_s + (FIRST_ENGINE_EXTRA_S if first else 0), path=path)
    print(f"=== {what} rc={rc} in {time.perf_counter() - t0:.0f} s ===", flush=True)
    return _read_worker(out, rc, what)


def _worker_cmd(
    args: argparse.Namespace,
    method: str,
    dtype: str,
    *,
    batches: list[int],
    max_tokens: int,
    eager: bool,
    out: Path,
    load: str,
) -> list[str]:
    """The command line of one method's worker (``python -m benchmarks.bench_vllm --worker``), writing to ``out``."""
    options = {
        "--method": method,
        "--dtype": dtype,
        "--prompts": args.prompts,
        "--model": args.model,
        "--worker-out": str(out),
        "--max-tokens": str(max_tokens),
        "--temperature": str(0.0 if dtype == "float32" else args.temperature),
        "--batch-sizes": ",".join(map(str, batches)),
        "--datasets": ",".join(args.datasets),
        "--max-model-len": str(args.max_model_len),
        "--gpu-mem": str(args.gpu_mem),
        "--specdec-config": args.specdec_config or "{}",
        "--variants": args.variants or "{}",
        "--tp": str(args.tp),
        "--pp": str(args.pp),
        "--compilation-config": args.compilation_config or "null",
        "--profile-dir": args.profile_dir if method in args.profile_methods else "",
        "--shape": args.shape,
        "--load": load,
        "--output-lengths": args.output_lengths,
    }
    switches = {
        "--trace": args.trace,
        "--engine-process": args.engine_process,
        "--vllm-defaults": args.vllm_defaults,
        "--eager": eager,
    }
    cmd = [sys.executable, "-m", "benchmarks.bench_vllm", "--worker"]
    for flag, value in options.items():
        cmd += [flag, value]
    return cmd + [flag for flag, on in switches.items() if on]


def run_worker(cmd: list[str], timeout_s: float, *, path: str | None = None) -> int:
    """Run ``cmd`` in a process group of its own; its exit code, or ``TIMEOUT_RC`` once it ran past ``timeout_s``.
    ``path``: a tree first on the worker's import path (a variant's ``path``: the base commit's install, as the
    GPU gate's ``specdec-before`` engine runs it). On the way out (whatever the exit) the whole group is killed: an
    engine core in its own process (``--engine-process``) outlives a killed worker and would hold its GPU memory
    from every later engine."""
    env = {**os.environ, "PYTHONPATH": pythonpath(path)} if path else None
    proc = subprocess.Popen(cmd, start_new_session=True, env=env)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # the other methods go on
        return TIMEOUT_RC
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _read_worker(out: Path, rc: int, what: str) -> dict[str, Any] | None:
    """A worker's result: whole if it exited 0; if it failed or was killed, the cells it had finished (marked
    ``partial`` with its ``rc``), or None when it finished none."""
    try:
        res = json.loads(out.read_text())
    except (OSError, ValueError):  # no file (killed before its first cell), or not JSON
        return None
    if rc == 0:
        return res
    kept = sum(len(cells) for cells in res.get("datasets", {}).values())
    if not kept:
        return None
    print(f"=== {what}: kept the {kept} cells it finished before rc={rc} ===", flush=True)
    return {**res, "partial": True, "rc": rc}


def _merge_loads(closed: dict[str, Any] | None, sustained: dict[str, Any] | None) -> dict[str, Any] | None:
    """One method's result from its two engines (``--load both``): the closed engine's, its datasets' cells joined
    by the sustained engine's ("sus{b}"), whose own startup, engine config and specdec stats go under
    ``sustained_engine``."""
    if closed is None or sustained is None:
        return closed or sustained
    names = dict.fromkeys([*closed["datasets"], *sustained["datasets"]])
    datasets = {n: {**closed["datasets"].get(n, {}), **sustained["datasets"].get(n, {})} for n in names}
    engine = {k: sustained.get(k) for k in ("startup_s", "engine_config", "specdec_stats")}
    return {**closed, "load": "both", "datasets": datasets, "sustained_engine": engine}


def write_doc(args: argparse.Namespace, runs: dict, lossless: dict, t_start: float) -> dict[str, Any]:
    """Write the results JSON + markdown (called after every method, so a cut-off run keeps what it has)."""
    prompts = json.loads(Path(args.prompts).read_text())
    versions = installed_versions()
    device = args.device or versions.get("gpu", "gpu").replace("NVIDIA ", "").split()[0].lower()
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "device": device,
        "versions": versions,
        "settings": {
            "model": _model_label(args),
            "shape": SHAPES.get(args.shape),
            "methods": {m: _spec_config(m, {}, json.loads(args.variants or "{}")) for m in args.methods},
            "variants": json.loads(args.variants or "{}"),
            "compilation_config": json.loads(args.compilation_config or "null"),
            "specdec_override": json.loads(args.specdec_config or "{}"),
            "batch_sizes": args.batch_sizes,
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "greedy": not args.temperature,
            "temperature": args.temperature,
            "dtype": "bfloat16",
            "cuda_graphs": not args.eager_bench,
            "datasets": args.datasets,
            "prompts_per_batch": {b: len(prompts["datasets"][args.datasets[0]][f"bs{b}"]) for b in args.batch_sizes},
            "load": args.load,
            **_sustained_settings(args, prompts),
            "output_lengths": _output_lengths_setting(args.output_lengths),
            "cache_policy": prompts["policy"],
            "lossless": {
                "dtype": "float32",
                "batch_sizes": args.lossless_batch_sizes,
                "max_tokens": LOSSLESS_MAX_TOKENS,
                "eos": "respected",
                "enforce_eager": not args.lossless_graphs,
            }
            if args.lossless
            else None,
            "engine": ENGINE_PROCESS_SETTING if args.engine_process else ENGINE_INPROC_SETTING,
            "tensor_parallel_size": args.tp,
            "pipeline_parallel_size": args.pp,
            "command": " ".join(sys.argv),
            "total_s": time.perf_counter() - t_start,
        },
        "summary": summarise(runs, lossless),
    }
    name = f"{doc['date']}_{device}_vllm_{'lossless' if args.lossless_only else 'bench'}"
    (Path(args.out_dir) / f"{name}.md").write_text(markdown(doc))  # reads the traces (host-late shares)
    # compact, and the per-step traces (--trace, ~95% of it) in a gzip file beside it: every GPU call carries the
    # repo (the .md is the human-readable copy)
    path = Path(args.out_dir) / f"{name}.json"
    stored = {**doc, "summary": dict(doc["summary"])}  # the returned doc keeps its traces (the printed markdown)
    save_step_traces(stored, path)
    path.write_text(json.dumps(stored, separators=(",", ":")))
    return doc


def _sustained_settings(args: argparse.Namespace, prompts: dict[str, Any]) -> dict[str, Any]:
    """Prompts per sustained cell (concurrency -> prompts, first dataset), where the run has sustained load."""
    if "sustained" not in LOADS[args.load]:
        return {}
    sets = prompts["datasets"][args.datasets[0]]
    return {
        "sustained_prompts": {
            b: len(sets[f"{SUSTAINED_SET}{b}"]) for b in args.batch_sizes if f"{SUSTAINED_SET}{b}" in sets
        }
    }


def _output_lengths_setting(choice: str) -> str | dict[str, Any]:
    """``--output-lengths`` as the results' settings record it: "fixed", or the varied lengths' bounds and seed."""
    if choice == VARIED:
        return {VARIED: list(VARIED_LENGTHS), "seed": VARIED_LENGTH_SEED}
    return FIXED


def _model_label(args: argparse.Namespace) -> str:
    if args.shape:
        return f"{Path(args.model).name} shape {args.shape} (random weights)"
    if args.inflate:
        from specdec.eval.inflate_model import param_count

        params = param_count(json.loads((Path(args.model) / "config.json").read_text())) / 1e9
        return f"{Path(args.model).name} ({params:.1f}B parameters: {TARGET_MODEL} inflated, same function)"
    return Path(args.model).name


def driver(args: argparse.Namespace) -> None:
    args.prompts = str(Path(args.prompts).resolve())
    if not Path(args.prompts).exists():
        raise SystemExit(f"--prompts {args.prompts} not found: run python -m benchmarks.prepare_prompts first")
    tmp = Path(args.raw_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    runs: dict[str, Any] = {}
    lossless: dict[str, Any] = {}
    t_start = time.perf_counter()
    if args.inflate:  # built once (own process, GPU if present), reused by every engine and later calls
        from specdec.eval.inflate_model import inflate_in_subprocess  # (imports torch: only when asked)

        args.model = inflate_in_subprocess(args.model, args.inflate)
    first = True  # the run's first engine compiles for the others
    if not args.lossless_only:
        for method in args.methods:
            res = None
            for load in LOADS[args.load]:  # --load both: a fresh engine per load (see prepare_prompts)
                part = _spawn(
                    args,
                    method,
                    "bfloat16",
                    args.batch_sizes,
                    args.max_tokens,
                    args.eager_bench,
                    tmp,
                    load=load,
                    first=first,
                )
                first = False
                res = part if load == "closed" else _merge_loads(res, part)
            if res is not None:
                runs[method] = res
                write_doc(args, runs, lossless, t_start)
    if args.lossless or args.lossless_only:
        args.lossless = True
        methods = args.lossless_methods or [m for m in args.methods if m.startswith("specdec")]
        for method in ["nospec"] + [m for m in methods if m != "nospec"]:
            res = _spawn(
                args,
                method,
                "float32",
                args.lossless_batch_sizes,
                LOSSLESS_MAX_TOKENS,
                not args.lossless_graphs,
                tmp,
                first=first,
            )
            first = False
            if res is not None:
                lossless[method] = res
                write_doc(args, runs, lossless, t_start)
    print(markdown(write_doc(args, runs, lossless, t_start)))
