"""GPU benchmark: vLLM no-spec vs vLLM ngram vs vLLM suffix (ArcticInference) vs specdec, same model, prompts, run.

    python -m benchmarks.prepare_prompts                      # CPU machine: device_inputs/prompts.json
    # GPU machine (vLLM staged, project installed with pip -e .):
    python -m benchmarks.bench_vllm --prompts device_inputs/prompts.json --out-dir $OUT \
        --methods nospec,ngram,suffix,specdec,specdec-async --lossless [--load closed|sustained|both]

Each method runs in its own subprocess (a fresh engine; vLLM's engine core in-process so drafting time can be
timed). Per dataset: warm-up on a disjoint prompt set, then batch sizes 1/8/32/64, each on its own disjoint prompts
(cache policy: see prepare_prompts). Greedy (``--temperature`` samples instead), ``--max-tokens`` new tokens with
ignore_eos. Reported per cell:
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
import json

from benchmarks.bench_vllm_driver import (  # noqa: F401 - re-exported
    ENGINE_INPROC_SETTING,
    ENGINE_PROCESS_SETTING,
    TIMEOUT_RC,
    _merge_loads,
    _read_worker,
    driver,
    run_worker,
    write_doc,
)
from benchmarks.bench_vllm_load import FIXED, OUTPUT_LENGTHS, VARIED, VARIED_LENGTH_SEED, VARIED_LENGTHS
from benchmarks.bench_vllm_methods import (  # noqa: F401 - re-exported
    LOADS,
    LOSSLESS_BATCHES,
    LOSSLESS_MAX_TOKENS,
    METHODS,
    SUSTAINED_SET,
    V1_REFERENCES,
    _spec_config,
)
from benchmarks.bench_vllm_report import markdown, summarise  # noqa: F401 - re-exported
from benchmarks.bench_vllm_worker import _dataset_cells, worker  # noqa: F401 - re-exported
from benchmarks.prepare_prompts import SUSTAINED_FACTOR
from specdec.eval.model_shapes import INFLATE_SHAPES, SHAPES
from specdec.paths import TARGET_MODEL, model_path

# This module is the command line (``python -m benchmarks.bench_vllm``, also each worker's); the method table is in
# bench_vllm_methods, one engine's worker in bench_vllm_worker, the spawning and the results file in
# bench_vllm_driver, the two load modes in bench_vllm_load and the summary and markdown in bench_vllm_report.


def main(argv: list[str] | None = None) -> None:
    ap = _parser()
    args = ap.parse_args(argv)
    _check_args(ap, args)
    worker(args) if args.worker else driver(args)


def _parser() -> argparse.ArgumentParser:
    """The benchmark's flags: the driver's (listed by ``--help``) and the worker's own (hidden)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_workload_args(ap)
    _add_engine_args(ap)
    _add_lossless_args(ap)
    _add_run_args(ap)
    return ap


def _add_workload_args(ap: argparse.ArgumentParser) -> None:
    """What is measured: prompts, model, methods, datasets, batch sizes, load, output lengths, engine size."""
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
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of the measured cells (0: greedy; the lossless runs stay greedy): 1 on the "
        "random dataset is the serve check's low-acceptance traffic",
    )
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument(
        "--vllm-defaults",
        action="store_true",
        help="engines with vLLM's default arguments (no "
        "max_model_len, gpu_memory_utilization or max_num_seqs set): what a user's first try runs",
    )


def _add_engine_args(ap: argparse.ArgumentParser) -> None:
    """How the engines run: configs merged into the methods', extra methods, profiling, tracing, engine layout."""
    ap.add_argument("--specdec-config", default="", help="JSON merged into the specdec methods' config")
    ap.add_argument(
        "--variants",
        default="",
        help='JSON {"name": {"base": "specdec", "spec": {...}, '
        '"compilation_config": {...}, "env": {...}, "batch_sizes": [...], "datasets": [...], '
        '"cpus": [...], "path": DIR}}: extra methods, usable in --methods (batch_sizes/datasets: a subset of the '
        "run's; cpus: CPU ids the engine process is pinned to; path: a tree first on its import path, e.g. "
        "the GPU gate's install of the base commit, /tmp/specdec-before)",
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


def _add_lossless_args(ap: argparse.ArgumentParser) -> None:
    """The float32 lossless runs (no-spec vs the specdec methods)."""
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


def _add_run_args(ap: argparse.ArgumentParser) -> None:
    """The run's own settings (CUDA graphs, timeout, parallelism, output places) and the worker's hidden flags."""
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


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flag combinations that cannot run, and unknown methods, before any engine starts."""
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


if __name__ == "__main__":
    main()
