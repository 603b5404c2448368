"""One engine of the GPU gate in a process of its own (started by ``benchmarks.gate``): vLLM's ``LLM`` with its
default engine arguments (only the model, bf16, the speculative config, the tensor-parallel size, and the stats
that ``get_metrics()`` reads), then every cell of the asked sets, each result written to ``--out`` at once.

    python -m benchmarks.gate_worker --inputs device_inputs/gate_inputs.json --method specdec --sets code \
        --out /tmp/x.json [--tp 1] [--cpus 0,1,...] [--deadline EPOCH] [--reference nospec.json] [--fake]

Per cell: the prefix cache reset, then ``REPEATS[method]`` runs (no speculation: 2) of its prompts (batch b: chunks
of b submitted together; b1 one at a time), each with its wall time, output tokens/s and vLLM's spec-decode counter
deltas; the outputs' digests and their share of repeated 4-grams. A specdec cell under 1.0x no speculation's (the
``--reference`` worker's file, waited for) is re-run once after the others, on the same prompts. Nothing imports
``specdec`` here but the origin check: the "specdec-before" engine resolves it from its own tree (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gate_metrics import (
    digest,
    mean_speed,
    plugin_delta,
    repeat_share,
    request_rate,
    spec_counts,
    spec_delta,
    speed,
    wall_split,
)

METHODS: dict[str, dict[str, Any] | None] = {
    "nospec": None,
    "suffix": {"method": "suffix"},
    "specdec": {"method": "specdec"},  # the plugin's own defaults, as the installed tree has them
    "specdec-before": {"method": "specdec"},  # the same, from the base commit's tree
    "nospec-v1": None,  # no speculation on vLLM's V1 model runner (what CPU drafters run on): runner vs plugin cost
    # references run once per issue, not per change: vLLM's n-gram method and the plugin's synchronous path
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "specdec-sync": {"method": "specdec", "async": False},
    "specdec-schedule": {"method": "specdec", "async_mode": "schedule"},  # schedule mode whatever the target's size
}
REPLICA_SEP = "."  # "specdec.2": a second engine of a method in the same call (the before/after's crossed pairs)
METHOD_ENV = {"nospec-v1": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
REPEATS = {"nospec": 2, "nospec-v1": 2}  # runs per cell (the run is void if no speculation's two differ > 2%)
RERUN_METHODS = ("specdec", "specdec-before")  # a cell under 1.0x no speculation is re-run once
REFERENCE_METHOD = "nospec"
DTYPE = "bfloat16"
SAMPLED_TEMPERATURE = 0.8
SAMPLED_SEED = 1000  # request i of a sampled cell: seed SAMPLED_SEED + i (the same for every method)
WARMUP_MAX_TOKENS = 32
CELL_ORDER = ("b1", "b8", "b32", "b64", "s8")
CELL_EST_S = {"b1": 20.0, "b8": 6.0, "b32": 6.0, "b64": 8.0, "s8": 4.0}  # an 8B-shaped cell on an H100, one run
REFERENCE_POLL_S = 5.0
ALLOW_PICKLE_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"  # collective_rpc of the origin check (a function)


def base_method(name: str) -> str:
    """The method an engine runs: ``specdec.2`` (a replica) -> ``specdec``."""
    return name.split(REPLICA_SEP, 1)[0]


def known_method(name: str) -> bool:
    """A method of ``METHODS``, or a replica of one: ``<method>.<n>``, n >= 2."""
    base, _, n = name.partition(REPLICA_SEP)
    return base in METHODS and (not n or (n.isdigit() and int(n) >= 2))


def _method_arg(name: str) -> str:
    if not known_method(name):
        raise argparse.ArgumentTypeError(f"{name!r} is unknown; valid: {', '.join(METHODS)} (or <method>.2, ...)")
    return name


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, [int(c) for c in args.cpus.split(",")])
    method = base_method(args.method)
    os.environ.update(METHOD_ENV.get(method, {}))
    inputs = json.loads(Path(args.inputs).read_text())
    spec = METHODS[method]
    llm, params, start_s = make_engine(args, spec, max_model_len=inputs.get("max_model_len"))
    res: dict[str, Any] = {
        "method": args.method,
        "speculative_config": spec,
        "start_s": start_s,
        **engine_info(llm),
        "origin": origin(llm, fake=args.fake),
        "cpus": sorted(os.sched_getaffinity(0)),
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "cells": {},
        "partial": True,
    }
    out = Path(args.out)
    _write(out, res)
    _warmup(llm, params, inputs, args.sets)
    clock = getattr(llm, "clock", time.perf_counter)
    run = CellRunner(llm, params, clock=clock, plugin=(spec or {}).get("method") == "specdec")
    for name in args.sets:
        for cell in [c for c in CELL_ORDER if c in inputs["sets"][name]]:
            if not _fits(args.deadline, run.estimate(cell) * REPEATS.get(method, 1)):
                res.setdefault("skipped", []).append(f"{name}/{cell}")
                continue
            items = inputs["sets"][name][cell]
            res["cells"][f"{name}/{cell}"] = run.cell(name, cell, items, inputs["batch"][cell], REPEATS.get(method, 1))
            print(f"[{args.method}] {name}/{cell}: {_brief(res['cells'][f'{name}/{cell}'])}", flush=True)
            _write(out, res)
    if args.method in RERUN_METHODS and args.reference:  # not a replica: the verdicts are the first engine's
        _reruns(run, res, inputs, args, out)
    res["partial"] = bool(res.get("skipped"))
    _write(out, res)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--method", required=True, type=_method_arg, help=f"of {', '.join(METHODS)}, or <method>.2, ...")
    ap.add_argument("--sets", required=True, type=lambda s: [x for x in s.split(",") if x])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--cpus", default="", help="comma-separated CPU ids this engine (and its children) run on")
    ap.add_argument("--deadline", type=float, default=0.0, help="epoch seconds: no cell starts that would pass it")
    ap.add_argument("--reference", default="", help="no speculation's worker file (re-runs of cells under 1.0x)")
    ap.add_argument("--fake", action="store_true", help="gate_fake.FakeLLM instead of vLLM (CPU dry run)")
    return ap


def make_engine(
    args: argparse.Namespace, spec: dict[str, Any] | None, *, max_model_len: int | None = None
) -> tuple[Any, Callable[..., Any], float]:
    """(the engine, a factory of its per-request sampling parameters, the seconds ``LLM()`` took); ``max_model_len``
    from the inputs (the near-end inputs set it), else vLLM's default."""
    if args.fake:
        from benchmarks.gate_fake import FakeLLM, fake_params

        llm = FakeLLM(base_method(args.method), tp=args.tp, spec=spec)
        return llm, fake_params, llm.fake_start_s
    os.environ.setdefault(ALLOW_PICKLE_ENV, "1")  # before LLM(): the engine's processes inherit it
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=DTYPE,
        speculative_config=spec,
        tensor_parallel_size=args.tp,
        **({"max_model_len": max_model_len} if max_model_len else {}),
        disable_log_stats=False,  # LLM()'s default turns off the stats get_metrics() reads
    )
    start_s = time.perf_counter() - t0

    def params(*, temperature: float, max_tokens: int, seed: int | None) -> Any:
        return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, detokenize=False)

    return llm, params, start_s


class CellRunner:
    """Runs cells on one engine and keeps each cell's last wall time (the estimate of the next cell of its name)."""

    def __init__(
        self, llm: Any, params: Callable[..., Any], *, clock: Callable[[], float], plugin: bool = False
    ) -> None:
        """``plugin``: the engine runs specdec's proposer (its counters are read around each run)."""
        self.llm, self.params, self.clock, self.plugin = llm, params, clock, plugin
        self.walls: dict[str, float] = {}

    def estimate(self, cell: str) -> float:
        return self.walls.get(cell, CELL_EST_S.get(cell, max(CELL_EST_S.values())))

    def cell(self, name: str, cell: str, items: list[dict[str, Any]], batch: int, repeats: int) -> dict[str, Any]:
        temperature = SAMPLED_TEMPERATURE if cell.startswith("s") else 0.0
        runs, outs = [], []
        for _ in range(repeats):
            run, outs = self.once(items, batch, temperature)
            runs.append(run)
        self.walls[cell] = runs[-1]["wall_s"]
        return {
            "set": name,
            "cell": cell,
            "batch": batch,
            "prompts": len(items),
            "temperature": temperature,
            "runs": runs,
            "digests": [digest(o) for o in outs],
            "repeat4": repeat_share(outs),
        }

    def once(self, items: list[dict[str, Any]], batch: int, temperature: float) -> tuple[dict[str, Any], list]:
        """One run of a cell's prompts, ``batch`` at a time, after a prefix-cache reset: (its figures, outputs)."""
        self.llm.reset_prefix_cache()
        seeds = [SAMPLED_SEED + i if temperature else None for i in range(len(items))]
        sps = [self.params(temperature=temperature, max_tokens=it["max_tokens"], seed=s) for it, s in zip(items, seeds)]
        before = spec_counts(self.llm.get_metrics())
        plugin_before = plugin_stats(self.llm) if self.plugin else None
        wall, outs, results = 0.0, [], []
        for i in range(0, len(items), batch):
            chunk = [{"prompt_token_ids": it["ids"]} for it in items[i : i + batch]]
            t0 = self.clock()
            res = self.llm.generate(chunk, sps[i : i + batch], use_tqdm=False)
            wall += self.clock() - t0
            outs += [list(r.outputs[0].token_ids) for r in res]
            results += res
        n = sum(map(len, outs))
        run = {"wall_s": wall, "output_tokens": n, "tokens_per_s": n / wall if wall > 0 else None}
        run["request_tokens_per_s"] = request_rate(results)
        run["wall_split"] = wall_split(results[i : i + batch] for i in range(0, len(results), batch))
        run.update(spec_delta(before, spec_counts(self.llm.get_metrics())))
        plugin = plugin_delta(plugin_before, plugin_stats(self.llm)) if self.plugin else None
        return ({**run, "plugin": plugin} if plugin else run), outs


def _warmup(llm: Any, params: Callable[..., Any], inputs: dict[str, Any], sets: list[str]) -> None:
    """One batch of every asked set's warm-up prompts (short outputs; never measured)."""
    items = [it for name in sets for it in inputs["sets"][name].get("warmup", [])]
    if items:
        sps = [params(temperature=0.0, max_tokens=WARMUP_MAX_TOKENS, seed=None) for _ in items]
        llm.generate([{"prompt_token_ids": it["ids"]} for it in items], sps, use_tqdm=False)


def _reruns(run: CellRunner, res: dict[str, Any], inputs: dict[str, Any], args: argparse.Namespace, out: Path) -> None:
    """Re-run once, on the same prompts, each cell under 1.0x no speculation's mean (waiting for that reference)."""
    for key, cell in res["cells"].items():
        ref = _reference_tps(Path(args.reference), key, args.deadline)
        tps = speed(cell["runs"][0], cell["temperature"])
        if ref is None or tps is None or tps >= ref:
            continue
        if not _fits(args.deadline, run.estimate(cell["cell"])):
            cell["rerun_skipped"] = "time budget"
            continue
        items = inputs["sets"][cell["set"]][cell["cell"]]
        cell["rerun"], _ = run.once(items, cell["batch"], cell["temperature"])
        cell["rerun"]["reference_tokens_per_s"] = ref
        print(f"[{args.method}] {key} re-run: {_brief({'runs': [cell['rerun']]})}", flush=True)
        _write(out, res)


def _reference_tps(path: Path, key: str, deadline: float) -> float | None:
    """No speculation's mean speed (``gate_metrics.speed``) of cell ``key`` from its worker's file, polled until it
    has the cell, the worker finished, or the deadline passed (None then)."""
    while True:
        try:
            ref = json.loads(path.read_text())
        except (OSError, ValueError):
            ref = {"partial": True, "cells": {}}
        cell = ref.get("cells", {}).get(key)
        if cell:
            return mean_speed(cell)
        if not ref.get("partial", True) or not _fits(deadline, REFERENCE_POLL_S):
            return None
        time.sleep(REFERENCE_POLL_S)


def engine_info(llm: Any) -> dict[str, Any]:
    """KV-cache tokens (num_gpu_blocks x block_size) and the resolved configs the engine runs with."""
    cfg = llm.llm_engine.vllm_config
    cache = cfg.cache_config
    blocks = getattr(cache, "num_gpu_blocks", None)
    return {
        "kv_tokens": blocks * cache.block_size if blocks else None,
        "kv_blocks": blocks,
        "block_size": cache.block_size,
        "resolved_speculative_config": _plain_fields(getattr(cfg, "speculative_config", None)),
        "additional_config": _plain_fields(getattr(cfg, "additional_config", None)),
        "specdec_options": specdec_options(cfg),
        "engine_config": _engine_fields(cfg),
    }


def specdec_options(cfg: Any) -> dict[str, Any] | None:
    """The plugin's options as resolved from the engine's config, defaults filled in (None for another method;
    best effort: the before tree may resolve them otherwise)."""
    spec = getattr(cfg, "speculative_config", None)
    if "specdec" not in str(getattr(spec, "model", "")):
        return None
    try:
        import dataclasses

        from specdec.vllm_plugin.entry.options import options_from_vllm_config

        return _plain_fields(dataclasses.asdict(options_from_vllm_config(cfg)))
    except Exception as exc:  # noqa: BLE001 - informational
        return {"error": repr(exc)[:200]}


def _plain_fields(obj: Any) -> dict[str, Any] | None:
    """An object's (or dict's) fields of plain JSON types (nested configs left out)."""
    if obj is None:
        return None
    items = obj.items() if isinstance(obj, dict) else vars(obj).items()
    plain = (str, int, float, bool, type(None), list, dict)
    return {k: v for k, v in items if not k.startswith("_") and isinstance(v, plain) and _jsonable(v)}


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _engine_fields(cfg: Any) -> dict[str, Any]:
    """What vLLM resolved from its defaults (scheduling, sizes, CUDA graphs), each where this version has it."""
    paths = {
        "async_scheduling": "scheduler_config.async_scheduling",
        "max_num_seqs": "scheduler_config.max_num_seqs",
        "max_num_batched_tokens": "scheduler_config.max_num_batched_tokens",
        "max_model_len": "model_config.max_model_len",
        "dtype": "model_config.dtype",
        "gpu_memory_utilization": "cache_config.gpu_memory_utilization",
        "enable_prefix_caching": "cache_config.enable_prefix_caching",
        "cudagraph_mode": "compilation_config.cudagraph_mode",
        "max_cudagraph_capture_size": "compilation_config.max_cudagraph_capture_size",
        "tensor_parallel_size": "parallel_config.tensor_parallel_size",
    }
    out = {}
    for key, path in paths.items():
        obj: Any = cfg
        for part in path.split("."):
            obj = getattr(obj, part, None)
        out[key] = obj if isinstance(obj, (int, float, bool, type(None))) else str(obj)
    return out


def origin(llm: Any, *, fake: bool) -> dict[str, Any]:
    """Which ``specdec`` this process and the engine's workers import (the before engine: its own tree)."""
    out: dict[str, Any] = {"worker": where_specdec()}
    if not fake:
        # by reference to this module (not __main__'s copy), which the engine's processes import from the path
        from benchmarks.gate_worker import _engine_origin

        try:
            out["engine"] = llm.collective_rpc(_engine_origin)
        except Exception as exc:  # noqa: BLE001 - informational; the check needs the insecure-serialization env
            out["engine_error"] = repr(exc)[:200]
    return out


def plugin_stats(llm: Any) -> list[Any] | None:
    """Every rank's specdec proposer statistics (None for another method, or where they cannot be read)."""
    try:
        stats = llm.collective_rpc(_proposer_stats)
    except Exception:  # noqa: BLE001 - informational (a fake engine, no insecure-serialization env)
        return None
    return stats if stats and any(isinstance(s, dict) for s in stats) else None


def _proposer_stats(worker: Any = None) -> dict[str, Any] | None:
    """In a GPU worker: its runner's drafter's statistics, if it is the specdec proposer."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    stats = getattr(drafter, "stats", None) if type(drafter).__name__ == "SpecdecProposer" else None
    return stats() if callable(stats) else None


def _engine_origin(worker: Any = None) -> dict[str, Any]:
    del worker  # collective_rpc passes the GPU worker first
    return where_specdec()


def where_specdec() -> dict[str, Any]:
    """This process's ``specdec``: its file, the commit stamp of a before-tree, whether the native suffix core loads."""
    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        import specdec

        out["file"] = specdec.__file__
        stamp = Path(specdec.__file__).resolve().parent.parent / "GATE_COMMIT"
        out["commit"] = stamp.read_text().strip() if stamp.exists() else None
        from specdec.drafters import _suffix_native  # noqa: F401

        out["native_suffix"] = True
    except ImportError as exc:
        out.setdefault("file", None)
        out["native_suffix"] = False
        out["import_error"] = str(exc)[:200]
    return out


def _fits(deadline: float, seconds: float) -> bool:
    return not deadline or time.time() + seconds <= deadline


def _brief(cell: dict[str, Any]) -> str:
    parts = []
    for r in cell["runs"]:
        eps = r.get("emitted_per_step")
        parts.append(f"{r['tokens_per_s'] or 0:.0f} tok/s" + (f" ({eps:.2f}/step)" if eps else ""))
    return ", ".join(parts)


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


if __name__ == "__main__":
    main()
