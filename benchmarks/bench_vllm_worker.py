"""The vLLM benchmark's worker: one method's engine in a process of its own (``bench_vllm --worker``, started by
``bench_vllm_driver``), run over every dataset's cells, each finished cell written to ``--worker-out`` at once."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.bench_vllm_load import VARIED, run_closed, run_sustained, varied_lengths
from benchmarks.bench_vllm_methods import SUSTAINED_SET, V1_REFERENCES, _spec_config
from benchmarks.engine_timer import EngineTimer, allow_rpc, in_engine, install_local
from benchmarks.step_timer import CellTimer
from specdec.eval.model_shapes import shaped_model

PROFILE_TOP = 45  # functions listed per sort order in --profile output


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
    variants = json.loads(args.variants or "{}")
    variant = variants.get(args.method, {})
    base = _worker_env(args, variant)
    prompts = json.loads(Path(args.prompts).read_text())
    from vllm import LLM, SamplingParams

    timer: CellTimer = install_local(args.trace)  # before LLM(): a forked engine process inherits the hooks
    if args.engine_process:
        allow_rpc()
    spec = _spec_config(args.method, json.loads(args.specdec_config or "{}"), variants)
    extra = _engine_extra(args, base, variant)
    t0 = time.perf_counter()
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
    temperature = 0.0 if lossless else args.temperature
    sp = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=not lossless, detokenize=False)
    result: dict[str, Any] = {
        "method": args.method,
        "dtype": args.dtype,
        "temperature": temperature,
        "speculative_config": spec,
        "startup_s": startup,
        "load": args.load,
        "datasets": {},
    }
    result["engine_config"] = {**_engine_config(llm), "cpu_affinity": sorted(os.sched_getaffinity(0))}
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


def _worker_env(args: argparse.Namespace, variant: dict[str, Any]) -> str:
    """Set the worker's environment before vLLM is imported (engine core layout, the variant's ``env``, the V1
    model runner for the V1 references) and pin it to the variant's ``cpus``; the method's base method."""
    if args.engine_process:  # vLLM's default layout (vllm serve, LLM()): the engine core in a process of its own
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: timers work
    for key, value in (variant.get("env") or {}).items():
        os.environ[key] = str(value)
    base = variant.get("base", args.method)
    if base in V1_REFERENCES:  # plain no-spec uses Model Runner V2 where it can; spec methods force V1
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    cpus = variant.get("cpus")
    if cpus:  # pin the engine process (threads started later inherit it): host-speed noise between processes
        os.sched_setaffinity(0, [int(c) for c in cpus])
    return base


def _engine_extra(args: argparse.Namespace, base: str, variant: dict[str, Any]) -> dict[str, Any]:
    """``LLM()``'s keyword arguments past the model, dtype and speculative config, for this method and run."""
    extra: dict[str, Any] = {"async_scheduling": False} if base == "nospec-sync" else {}
    cc = variant.get("compilation_config") or json.loads(args.compilation_config or "null")
    if cc:
        extra["compilation_config"] = cc
    if args.shape:
        extra["load_format"] = "dummy"
    if not args.vllm_defaults:  # the harness's own engine arguments; --vllm-defaults: vLLM's, as a user runs it
        extra.update(
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_mem,
            max_num_seqs=max(args.batch_sizes),
            seed=0,
        )
    return extra


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
