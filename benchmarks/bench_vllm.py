"""GPU benchmark: vLLM no-spec vs vLLM ngram vs vLLM suffix (ArcticInference) vs specdec, same model, prompts, run.

    python -m benchmarks.prepare_prompts                      # CPU machine: device_inputs/prompts.json
    # GPU machine (vLLM staged, project installed with pip -e .):
    python -m benchmarks.bench_vllm --prompts device_inputs/prompts.json --out-dir $OUT \
        --methods nospec,ngram,suffix,specdec,specdec-async --lossless [--load closed|sustained|both]

Each method runs in its own subprocess (a fresh engine; vLLM's engine core in-process so drafting time can be
timed). Per dataset: warm-up on a disjoint prompt set, then batch sizes 1/8/32/64, each on its own disjoint prompts
(cache policy: see prepare_prompts). Greedy, ``--max-tokens`` new tokens with ignore_eos. Reported per cell:
tokens/s, TPOT, MAT (= output tokens / (output tokens - accepted), bonus included), ms per step spent in
``propose_draft_token_ids`` (drafting, on the critical path) and its share of wall time, and bf16 output
mismatches against no-spec. ``--load`` (``bench_vllm_load``): ``closed`` (the default) submits each batch size's
prompts b at a time, ``sustained`` runs a ``sus{b}`` set (more prompts than b) with at most b in flight, a new
request as one finishes, its cells keyed "sus{b}" beside the closed cells' "b"; ``both`` runs each load in an engine
of its own per method. ``--output-lengths varied`` gives prompt i of each sustained cell its own ``max_tokens``
(uniform over 128-384, mean 256, one seed: the same per prompt for every method; ``bench_vllm_load.varied_lengths``)
instead of ``--max-tokens`` for all, so that no method runs in lockstep. ``--lossless`` adds float32 runs (no-spec vs
specdec, EOS respected) at batch 1/8/64 and counts prompts compared and identical. Writes
eval/results/<date>_<device>_vllm_bench.json (+ .md).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.bench_vllm_load import (
    FIXED,
    OUTPUT_LENGTHS,
    VARIED,
    VARIED_LENGTH_SEED,
    VARIED_LENGTHS,
    run_closed,
    run_sustained,
    varied_lengths,
)
from benchmarks.bench_vllm_report import markdown, summarise  # noqa: F401 - re-exported
from benchmarks.engine_timer import EngineTimer, allow_rpc, in_engine, install_local
from benchmarks.prepare_prompts import SUSTAINED_FACTOR
from benchmarks.step_timer import CellTimer
from benchmarks.step_trace import save_step_traces
from specdec.eval.model_shapes import INFLATE_SHAPES, SHAPES, shaped_model
from specdec.eval.results import installed_versions
from specdec.paths import TARGET_MODEL, model_path

METHODS: dict[str, dict[str, Any] | None] = {
    "nospec": None,
    "nospec-v1": None,  # no-spec on vLLM's V1 model runner, the runner every CPU-drafter method runs on
    # the same with vLLM's synchronous scheduling, which vLLM 0.26 imposes on every CPU drafter: the reference that
    # splits "GPU waiting" into what synchronous scheduling costs and what speculation adds (bench_vllm_report)
    "nospec-sync": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    # vLLM's own GPU n-gram drafter: the one model-free method vLLM runs with async scheduling
    "ngram-gpu": {"method": "ngram_gpu", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix"},  # ArcticInference 0.1.1 cache, vLLM's defaults (k = depth = 24)
    # the default configuration ("async": true; async_mode "auto": schedule mode for targets of 1e9+
    # parameters on one GPU, thread mode below) and the synchronous path
    "specdec": {"method": "specdec", "drafter": "suffix", "num_speculative_tokens": 16},
    "specdec-sync": {"method": "specdec", "drafter": "suffix", "num_speculative_tokens": 16, "async": False},
    # async_mode "thread" ("specdec-async" keeps the name it had while thread mode was the default): the native
    # step on the suffix engine's own thread, GIL released, beside vLLM's update_from_output; stops and starts while
    # the GPU runs the step
    "specdec-async": {
        "method": "specdec",
        "drafter": "suffix",
        "num_speculative_tokens": 16,
        "async": True,
        "async_mode": "thread",
    },
    "specdec-thread": {
        "method": "specdec",
        "drafter": "suffix",
        "num_speculative_tokens": 16,
        "async": True,
        "async_mode": "thread",
    },
    # vLLM's async scheduling (the engine prepares step N+1 while the GPU runs step N; drafts filled just in time)
    "specdec-sched": {
        "method": "specdec",
        "drafter": "suffix",
        "num_speculative_tokens": 16,
        "async": True,
        "async_mode": "schedule",
    },
    # vLLM's uniform k slots per request under async scheduling (draft_slots "adaptive", the default, reserves each
    # request only as many slots as its latest draft had tokens past the confidence cut)
    "specdec-sched-uniform": {
        "method": "specdec",
        "drafter": "suffix",
        "num_speculative_tokens": 16,
        "async": True,
        "async_mode": "schedule",
        "draft_slots": "uniform",
    },
    # the same with k by batch size (vLLM's scheduler reserves k slots for every request under async scheduling)
    "specdec-sched-dyn": {
        "method": "specdec",
        "drafter": "suffix",
        "num_speculative_tokens": 16,
        "async": True,
        "async_mode": "schedule",
        "num_speculative_tokens_per_batch_size": [[1, 16, 16], [17, 1024, 8]],
    },
    # a short k at large batches (k 4 lifted agentic batch 64 on the 8B-sized target from 0.73x to 0.86x no-spec)
    "specdec-sched-k2": {
        "method": "specdec",
        "drafter": "suffix",
        "num_speculative_tokens": 16,
        "async": True,
        "async_mode": "schedule",
        "num_speculative_tokens_per_batch_size": [[1, 16, 16], [17, 1024, 2]],
    },
    # the draft model on the host CPU: the native forward on 8 threads (half the GPU host's cores), named rather
    # than calibrated at engine start (backend=auto would also build and time ONNX Runtime and numpy)
    "specdec-hybrid": {
        "method": "specdec",
        "drafter": ["suffix", "model"],
        "num_speculative_tokens": 8,
        "async": False,
        "drafter_options": {"model": {"num_threads": 8, "backend": "native"}},
    },
    # k=4: each draft token is one model step
    "specdec-model": {
        "method": "specdec",
        "drafter": "model",
        "num_speculative_tokens": 4,
        "async": False,
        "drafter_options": {"model": {"num_threads": 8, "backend": "native"}},
    },
}
V1_REFERENCES = ("nospec-v1", "nospec-sync")  # no-spec engines forced onto the V1 model runner
LOADS = {"closed": ("closed",), "sustained": ("sustained",), "both": ("closed", "sustained")}  # --load -> engines
SUSTAINED_SET = "sus"  # prompts file: "sus{b}" = the sustained set of concurrency b; results: its cell's key
LOSSLESS_BATCHES = (1, 8, 64)
LOSSLESS_MAX_TOKENS = 128
PROFILE_TOP = 45  # functions listed per sort order in --profile output
ENGINE_INPROC_SETTING = "vLLM LLM(), engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), seed 0"
ENGINE_PROCESS_SETTING = (
    "vLLM LLM(), engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's "
    "default layout; drafting and GPU timers there, read through collective_rpc), seed 0"
)
TIMEOUT_RC = 124  # a worker past --method-timeout-s (killed): reported like timeout(1)
FIRST_ENGINE_EXTRA_S = 60  # the run's first engine also compiles (torch.compile, CUDA graphs) for the later ones:
# on a fresh H200 machine it took 108-135 s where the others took 70-97 s


# --------------------------------------------------------------------------- worker (one engine)
def _engine_config(llm: Any) -> dict[str, Any]:
    """What the engine actually ran with (async scheduling, CUDA graph mode and capture limit)."""
    try:
        cfg = llm.llm_engine.vllm_config
        cc = cfg.compilation_config
        return {
            "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
            "cudagraph_mode": str(cc.cudagraph_mode),
            "max_cudagraph_capture_size": cc.max_cudagraph_capture_size,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "max_model_len": cfg.model_config.max_model_len,
            "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
        }
    except Exception as exc:  # noqa: BLE001 - informational only
        return {"error": repr(exc)}


def _spec_config(
    method: str, override: dict[str, Any], variants: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The speculative config of a method or of a ``--variants`` entry ({"base": method, "spec": {...}})."""
    variant = (variants or {}).get(method)
    if variant is not None:
        base_cfg = _spec_config(variant.get("base", "specdec"), override)
        return None if base_cfg is None else {**base_cfg, **variant.get("spec", {})}
    base = METHODS[method]
    if base is None:
        return None
    return {**base, **override} if method.startswith("specdec") else dict(base)


def _profiled(fn: Any, path: Path) -> Any:
    """Run ``fn()`` under cProfile; write the top functions by own and by cumulative time to ``path``."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    result = prof.runcall(fn)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(PROFILE_TOP)
    stats.sort_stats("cumulative").print_stats(PROFILE_TOP)
    path.write_text(buf.getvalue())
    return result


def worker(args: argparse.Namespace) -> None:
    if args.engine_process:  # vLLM's default layout (vllm serve, LLM()): the engine core in a process of its own
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: timers work
    variants = json.loads(args.variants or "{}")
    for key, value in (variants.get(args.method, {}).get("env") or {}).items():
        os.environ[key] = str(value)
    base = variants.get(args.method, {}).get("base", args.method)
    if base in V1_REFERENCES:  # plain no-spec uses Model Runner V2 where it can; spec methods force V1
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    cpus = variants.get(args.method, {}).get("cpus")
    if cpus:  # pin the engine process (threads started later inherit it): host-speed noise between processes
        os.sched_setaffinity(0, [int(c) for c in cpus])
    prompts = json.loads(Path(args.prompts).read_text())
    from vllm import LLM, SamplingParams

    timer: CellTimer = install_local(args.trace)  # before LLM(): a forked engine process inherits the hooks
    if args.engine_process:
        allow_rpc()
    spec = _spec_config(args.method, json.loads(args.specdec_config or "{}"), variants)
    extra: dict[str, Any] = {"async_scheduling": False} if base == "nospec-sync" else {}
    cc = variants.get(args.method, {}).get("compilation_config") or json.loads(args.compilation_config or "null")
    if cc:
        extra["compilation_config"] = cc
    t0 = time.perf_counter()
    if args.shape:
        extra["load_format"] = "dummy"
    if not args.vllm_defaults:  # the harness's own engine arguments; --vllm-defaults: vLLM's, as a user runs it
        extra.update(
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_mem,
            max_num_seqs=max(args.batch_sizes),
            seed=0,
        )
    llm = LLM(
        model=shaped_model(args.model, args.shape),
        dtype=args.dtype,
        speculative_config=spec,
        enforce_eager=args.eager,
        disable_log_stats=False,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        **extra,
    )
    startup = time.perf_counter() - t0
    if args.engine_process:  # the timer that counts is the engine process's
        timer = EngineTimer(llm, trace=args.trace)
    lossless = args.dtype == "float32"
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=not lossless, detokenize=False)
    result: dict[str, Any] = {
        "method": args.method,
        "dtype": args.dtype,
        "speculative_config": spec,
        "startup_s": startup,
        "load": args.load,
        "datasets": {},
    }
    result["engine_config"] = {**_engine_config(llm), "cpu_affinity": sorted(os.sched_getaffinity(0))}
    variant = variants.get(args.method, {})
    args.batch_sizes = [b for b in args.batch_sizes if b in variant.get("batch_sizes", args.batch_sizes)]
    out = Path(args.worker_out)
    for name in [d for d in args.datasets if d in variant.get("datasets", args.datasets)]:
        result["datasets"][name] = cells = {}
        # every finished cell is on disk at once: a worker killed by --method-timeout-s keeps them (``_read_worker``)
        _dataset_cells(
            args,
            llm,
            name,
            prompts["datasets"][name],
            sp,
            timer,
            cells=cells,
            on_cell=lambda: _write_atomic(out, json.dumps({**result, "partial": True})),
        )
    with contextlib.suppress(Exception):  # no specdec proposer (a peer's engine)
        result["specdec_stats"] = in_engine(timer, "specdec_stats")
    _write_atomic(out, json.dumps(result))


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` by a rename: a worker killed mid-write leaves the previous version whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _dataset_cells(
    args: argparse.Namespace,
    llm: Any,
    name: str,
    sets: dict[str, list[list[int]]],
    sp: Any,
    timer: CellTimer,
    *,
    cells: dict[str, Any],
    on_cell: Callable[[], None],
) -> None:
    """One dataset on this engine: the warm-up, then a cell per batch size into ``cells``, keyed "b" (closed load)
    or "sus{b}" (sustained load; batch sizes without a sustained set in the prompts file are skipped;
    ``--output-lengths varied``: per-prompt lengths, the cell marked ``output_lengths``); ``on_cell()`` after each."""
    llm.generate([{"prompt_token_ids": p} for p in sets["warmup"]], sp, use_tqdm=False)
    feed_sp = _final_only(sp) if args.load == "sustained" else sp
    varied = args.load == "sustained" and args.output_lengths == VARIED
    for b in args.batch_sizes:
        if args.load == "sustained":
            key = label = f"{SUSTAINED_SET}{b}"
            if key not in sets:
                print(
                    f"[{args.method}] {name}: no {key} set in {args.prompts}: batch {b} skipped (sustained load)",
                    flush=True,
                )
                continue
            run = functools.partial(
                run_sustained,
                llm,
                sets[key],
                b,
                feed_sp,
                timer,
                request_prefix=f"{name}-{key}",
                max_tokens=varied_lengths(len(sets[key])) if varied else None,
            )
        else:
            key, label = str(b), f"bs{b}"
            run = functools.partial(run_closed, llm, sets[f"bs{b}"], b, sp, timer)
        if args.profile_dir:
            Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
            out = Path(args.profile_dir) / f"profile_{args.method}_{name}_{label}.txt"
            run = functools.partial(_profiled, run, out)
        before = in_engine(timer, "slot_counters")
        cells[key] = cell = run()
        after = in_engine(timer, "slot_counters")
        if after:  # schedule mode's slot book: this cell's share of its counters (they run for the engine's life)
            cell["slot_book"] = {k: v - before.get(k, 0) for k, v in after.items()}
        if varied:
            cell["output_lengths"] = VARIED
        print(
            f"[{args.method} {args.dtype}] {name} {label}: {cell['tokens_per_s']:.0f} tok/s, MAT "
            f"{cell['mat']:.2f}, draft {cell['draft_ms_per_step'] or 0.0:.3f} ms/step",
            flush=True,
        )
        on_cell()


def _final_only(sp: Any) -> Any:
    """``sp`` asking for each request's final output only (what ``LLM.generate`` sets before adding requests)."""
    from vllm.sampling_params import RequestOutputKind

    out = sp.clone()
    out.output_kind = RequestOutputKind.FINAL_ONLY
    return out


# --------------------------------------------------------------------------- driver
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
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_vllm",
        "--worker",
        "--method",
        method,
        "--dtype",
        dtype,
        "--prompts",
        args.prompts,
        "--model",
        args.model,
        "--worker-out",
        str(out),
        "--max-tokens",
        str(max_tokens),
        "--batch-sizes",
        ",".join(map(str, batches)),
        "--datasets",
        ",".join(args.datasets),
        "--max-model-len",
        str(args.max_model_len),
        "--gpu-mem",
        str(args.gpu_mem),
        "--specdec-config",
        args.specdec_config or "{}",
        "--variants",
        args.variants or "{}",
        "--tp",
        str(args.tp),
        "--pp",
        str(args.pp),
        "--compilation-config",
        args.compilation_config or "null",
        "--profile-dir",
        args.profile_dir if method in args.profile_methods else "",
        "--shape",
        args.shape,
        "--load",
        load,
        "--output-lengths",
        args.output_lengths,
    ]
    if args.trace:
        cmd.append("--trace")
    if args.engine_process:
        cmd.append("--engine-process")
    if args.vllm_defaults:
        cmd.append("--vllm-defaults")
    if eager:
        cmd.append("--eager")
    what = f"{method} ({dtype}{'' if load == 'closed' else ', ' + load + ' load'})"
    print(f"=== {what} ===", flush=True)
    out.unlink(missing_ok=True)  # an earlier run's file must not stand in for this worker's
    t0 = time.perf_counter()
    rc = run_worker(cmd, args.method_timeout_s + (FIRST_ENGINE_EXTRA_S if first else 0))
    print(f"=== {what} rc={rc} in {time.perf_counter() - t0:.0f} s ===", flush=True)
    return _read_worker(out, rc, what)


def run_worker(cmd: list[str], timeout_s: float) -> int:
    """Run ``cmd`` in a process group of its own; its exit code, or ``TIMEOUT_RC`` once it ran past ``timeout_s``.
    On the way out (whatever the exit) the whole group is killed: an engine core in its own process
    (``--engine-process``) outlives a killed worker and would hold its GPU memory from every later engine."""
    proc = subprocess.Popen(cmd, start_new_session=True)
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
            "greedy": True,
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="device_inputs/prompts.json", help="from benchmarks.prepare_prompts")
    ap.add_argument("--model", default=str(model_path(TARGET_MODEL)))
    ap.add_argument("--methods", default="nospec,ngram,suffix,specdec", type=lambda s: s.split(","))
    ap.add_argument("--datasets", default="code,agentic", type=lambda s: s.split(","))
    ap.add_argument("--batch-sizes", default="1,8,32,64", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument(
        "--shape",
        default="",
        choices=("",) + tuple(SHAPES),
        help="benchmark a model of this shape with random weights (vLLM load_format='dummy') and the "
        "shared target's tokenizer: GPU step times of a real size (speed only; outputs are noise)",
    )
    ap.add_argument(
        "--inflate",
        default="",
        choices=("",) + tuple(INFLATE_SHAPES),
        help="benchmark the target inflated to this size (specdec.eval.inflate_model: same outputs, an "
        "8B model's step time); built under /tmp/specdec_shapes on first use",
    )
    ap.add_argument(
        "--load",
        default="closed",
        choices=tuple(LOADS),
        help="closed: each batch size b = b prompts submitted together (a closed batch); sustained: the "
        f"prompts file's sus{{b}} set ({SUSTAINED_FACTOR} x b prompts) with at most b in flight, a "
        "new request as one finishes; both: each, in an engine of its own per method",
    )
    ap.add_argument(
        "--output-lengths",
        default=FIXED,
        choices=OUTPUT_LENGTHS,
        help="fixed: every request asks for --max-tokens; varied (sustained load only; closed batches "
        "keep --max-tokens): prompt i of a sustained cell asks for a length drawn uniformly from "
        f"{VARIED_LENGTHS[0]}-{VARIED_LENGTHS[1]} (seed {VARIED_LENGTH_SEED}, the same per prompt "
        "for every method), so that no method runs in lockstep, as on a server",
    )
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument(
        "--vllm-defaults",
        action="store_true",
        help="engines with vLLM's default arguments (no "
        "max_model_len, gpu_memory_utilization or max_num_seqs set): what a user's first try runs",
    )
    ap.add_argument("--specdec-config", default="", help="JSON merged into the specdec methods' config")
    ap.add_argument(
        "--variants",
        default="",
        help='JSON {"name": {"base": "specdec", "spec": {...}, '
        '"compilation_config": {...}, "env": {...}, "batch_sizes": [...], "datasets": [...], '
        '"cpus": [...]}}: extra methods, usable in --methods (batch_sizes/datasets: a subset of the '
        "run's; cpus: CPU ids the engine process is pinned to)",
    )
    ap.add_argument("--compilation-config", default="", help="JSON compilation_config for every method's engine")
    ap.add_argument("--profile-dir", default="", help="write cProfile tables per cell here (--profile-methods)")
    ap.add_argument(
        "--profile-methods",
        default="",
        type=lambda s: [m for m in s.split(",") if m],
        help="methods run under cProfile (slower: their timings are not comparable)",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="record every engine step of the speed cells (width, "
        "tokens, drafting, CUDA-graph mode, GPU busy/gap): python -m benchmarks.step_trace RESULTS",
    )
    ap.add_argument(
        "--engine-process",
        action="store_true",
        help="each engine's core in a process of its own, as vllm serve and LLM() run it by default "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=1; default: in the worker's process); the timers (drafting, "
        "GPU gap and busy, --trace, specdec stats) run there and are read through vLLM's "
        "collective_rpc (engine_timer.py); --profile-methods is refused",
    )
    ap.add_argument("--lossless", action="store_true", help="add float32 runs: no-spec vs specdec methods")
    ap.add_argument(
        "--lossless-methods",
        default="",
        type=lambda s: [m for m in s.split(",") if m],
        help="methods compared with no-spec in float32 (default: the specdec methods of --methods)",
    )
    ap.add_argument("--lossless-only", action="store_true", help="only the float32 lossless runs")
    ap.add_argument(
        "--lossless-graphs",
        action="store_true",
        help="float32 runs with CUDA graphs (default eager): checks the graphs a method's batches replay",
    )
    ap.add_argument(
        "--lossless-batch-sizes",
        default=",".join(map(str, LOSSLESS_BATCHES)),
        type=lambda s: [int(x) for x in s.split(",") if x],
        help="batch sizes of the float32 runs",
    )
    ap.add_argument("--eager-bench", action="store_true", help="enforce_eager for the speed runs (no CUDA graphs)")
    ap.add_argument("--method-timeout-s", type=int, default=900)
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine (the shared target: <= 2)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size of every engine")
    ap.add_argument("--device", default="", help="device name for the results file (default: from the GPU)")
    ap.add_argument("--out-dir", default="eval/results")
    ap.add_argument("--raw-dir", default="/tmp/specdec_bench_raw", help="per-method outputs (token ids)")
    # worker-only
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", default="nospec", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    ap.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.output_lengths == VARIED and "sustained" not in LOADS[args.load] and not args.worker:
        ap.error("--output-lengths varied applies to sustained-load cells only: add --load sustained or --load both")
    if args.engine_process and args.profile_methods:
        ap.error(
            "--engine-process runs the engine core in another process, which --profile-methods (cProfile of "
            "the benchmark's process) does not see: drop one of them"
        )
    if args.shape and args.inflate:
        ap.error("--shape and --inflate exclude each other: --shape is random weights, --inflate the real model")
    known = set(METHODS) | set(json.loads(args.variants or "{}"))
    for m in args.methods + args.lossless_methods:
        if m not in known:
            ap.error(f"--methods: {m!r} is unknown; valid: {', '.join(METHODS)}")
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
