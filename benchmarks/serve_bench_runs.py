"""The measuring side of serve_bench: one `vllm bench serve` run against a server (its command line, result keys and
spec-decode deltas), the rates of a ``--rates`` list, a server's lifetime with its warm-up, and the search for the
saturation rate R of a dataset.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import serve_inputs as inputs
from benchmarks.serve_common import (
    HOST,
    Budget,
    ServeError,
    Server,
    free_port,
    scrape,
    spec_config,
    spec_delta,
    vllm_cli,
)
from benchmarks.serve_goals import REPEAT_MARK

# the low-acceptance random traffic of the issue: vLLM's random prompts, sampled at the server's default temperature
# (with --temperature 0 the 53M target repeats itself after a random prompt, and drafts of it are accepted)
RANDOM_INPUT_LEN, RANDOM_OUTPUT_LEN = 256, 128
WARMUP_SLICE = 0  # slice 0 of every pool warms a server up; rate k uses slice k + 1
# the saturation search's prompts: the two slices after the default five rates' (1-5), so that no speculation's rates
# can run on the server that found R without meeting a prompt it has seen (its prefix cache would answer it)
SATURATION_SLICES = (6, 7)
# rates (x capacity) measured from the top down, to show where output tokens/s stop rising: the ladder stops at the
# first rate that falls short of the all-at-once throughput, so the slowest (lowest) rates run only where needed
SATURATION_LADDER = (1.25, 1.0, 0.75, 0.5)
BENCH_TIMEOUT_S = 600


def parse_rates(text: str, saturation: dict[str, float] | None, dataset: str) -> list[tuple[str, float | str]]:
    """``0.25R,...,inf,12`` -> [(label, req/s or "inf")]; ``xR`` needs the dataset's saturation rate. A rate given
    again runs again on the same server (``inf,0.5R,inf``: all at once on a fresh server and after the others); its
    label gets ``#2``, ``#3``, ... (the goals read the median of a rate's repeats: ``serve_goals``)."""
    out: list[tuple[str, float | str]] = []
    for tok in (t.strip() for t in text.split(",") if t.strip()):
        repeat = sum(label.split(REPEAT_MARK)[0] == tok for label, _ in out)
        if repeat:
            rate = parse_rates(tok, saturation, dataset)[0][1]
            out.append((f"{tok}{REPEAT_MARK}{repeat + 1}", rate))
            continue
        if tok == "inf":
            out.append(("inf", "inf"))
        elif tok.endswith("R"):
            if not saturation or dataset not in saturation:
                raise ServeError(
                    f"rate {tok!r} needs the saturation rate R of dataset {dataset!r}: pass "
                    "--saturation-rate, --saturation-file or --saturation-rate auto"
                )
            if "rate" not in saturation[dataset]:
                why = saturation[dataset].get("error", "no rate")
                raise ServeError(f"rate {tok!r}: the saturation search found no R for dataset {dataset!r} ({why})")
            out.append((tok, float(tok[:-1] or 1) * saturation[dataset]["rate"]))
        else:
            try:
                out.append((tok, float(tok)))
            except ValueError:
                raise ServeError(f"rate {tok!r} is not a number, 'xR' or 'inf' (e.g. --rates 0.25R,0.5R,inf)") from None
    return out


def arrivals_capped(args: argparse.Namespace, rate: float | str) -> int:
    """The requests of one rate: ``--num-prompts``, at a finite rate at most ``--max-arrival-s`` seconds of
    arrivals (at least one)."""
    if rate == "inf" or not args.max_arrival_s:
        return args.num_prompts
    return max(1, min(args.num_prompts, round(float(rate) * args.max_arrival_s)))


def bench_flags(
    args: argparse.Namespace,
    *,
    port: int,
    dataset: str,
    rows_file: Path | None,
    num: int,
    rate: float | str,
    seed: int,
    result: Path,
) -> list[str]:
    """The flags of one rate's `vllm bench serve` (as in vLLM 0.26's benchmarks/serve.py), after `bench serve` on the
    CLI's line; the in-process worker parses the same."""
    cmd = [
        "--backend",
        "vllm",
        "--model",
        args.model,
        "--host",
        HOST,
        "--port",
        str(port),
        "--endpoint",
        "/v1/completions",
        "--num-prompts",
        str(num),
        "--request-rate",
        str(rate),
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]
    cmd += _dataset_flags(dataset, rows_file)
    if dataset != inputs.RANDOM_DATASET:  # random: the server's default sampling, as a user's first run has it
        cmd += ["--temperature", str(args.temperature)]
    if args.ignore_eos:
        cmd.append("--ignore-eos")
    return cmd


def _dataset_flags(dataset: str, rows_file: Path | None) -> list[str]:
    """The dataset flags of `vllm bench serve`: vLLM's random dataset, else the custom JSONL ``rows_file``."""
    if dataset == inputs.RANDOM_DATASET:
        return [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(RANDOM_INPUT_LEN),
            "--random-output-len",
            str(RANDOM_OUTPUT_LEN),
        ]
    return [
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(rows_file),
        "--custom-output-len",
        "-1",
        "--skip-chat-template",
        "--disable-shuffle",
        "--no-oversample",
    ]


def bench_once(
    args: argparse.Namespace,
    server: Server,
    *,
    dataset: str,
    slice_index: int,
    rate: float | str,
    budget: Budget,
    num: int = 0,
) -> dict[str, Any]:
    """One `vllm bench serve` run on the first ``num`` prompts (default all) of slice ``slice_index``: its result
    keys and the spec-decode deltas."""
    num = num or args.num_prompts
    work = Path(args.out_dir) / "work"
    work.mkdir(parents=True, exist_ok=True)  # the random dataset writes no prompt file that would make it
    tag = f"{server.port}-{dataset}-{slice_index}"
    rows_file = None
    if dataset != inputs.RANDOM_DATASET:
        rows = inputs.rate_slice(args.pools[dataset], slice_index, args.num_prompts, pool=dataset)
        rows_file = inputs.write_jsonl(work / f"{tag}.jsonl", rows[:num])
    result = work / f"{tag}.result.json"
    result.unlink(missing_ok=True)
    flags = bench_flags(
        args,
        port=server.port,
        dataset=dataset,
        rows_file=rows_file,
        num=num,
        rate=rate,
        seed=slice_index,
        result=result,
    )
    cmd = [*vllm_cli(args.vllm_cli), "bench", "serve", *flags]
    before = scrape(server.base_url)
    log = work / f"{tag}.bench.log"
    rc = _run_bench(args, cmd, flags, log=log, timeout_s=max(1.0, min(BENCH_TIMEOUT_S, budget.left())))
    if rc != 0 or not result.exists():
        raise ServeError(f"`vllm bench serve` exited with code {rc}: see {log}")
    bench = json.loads(result.read_text())
    return {
        "bench": {k: v for k, v in bench.items() if not isinstance(v, list)},
        "spec": spec_delta(before, scrape(server.base_url)),
        "command": cmd,
    }


def _run_bench(args: argparse.Namespace, cmd: list[str], flags: list[str], *, log: Path, timeout_s: float) -> int:
    """One run's exit code: through the driver's in-process worker (``args.bench_client``, ``flags``) while it works,
    else the CLI (``cmd``). A run the worker fails goes through the CLI, and so do the rest (the worker retired, its
    log kept beside)."""
    client = getattr(args, "bench_client", None)
    if client is not None and client.usable:
        if client.run(flags, log=log, timeout_s=timeout_s) == 0:
            return 0
        log.rename(log.with_suffix(".in-process.log"))
        client.retire()
    with open(log, "w") as fh:
        try:
            return subprocess.run(cmd, check=False, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            raise ServeError(f"`vllm bench serve` ran past the time budget: see {log}") from None


@contextlib.contextmanager
def serving(args: argparse.Namespace, method: str, tag: str) -> Iterator[Server]:
    spec = spec_config(method, args.draft_model)
    port = args.port or free_port()
    server = Server(
        args.model,
        port=port,
        log=Path(args.out_dir) / f"server-{method}-{tag}.log",
        spec=spec,
        server_args=args.server_args,
        cli=args.vllm_cli,
        env=getattr(args, "lane_env", None),  # a lane's GPU (serve_bench --lanes)
    )
    try:
        server.start(args.health_timeout_s)
        if args.warmup_prompts:
            bench_once(
                args,
                server,
                dataset=args.datasets[0],
                slice_index=WARMUP_SLICE,
                rate="inf",
                budget=Budget(BENCH_TIMEOUT_S),
                num=args.warmup_prompts,
            )
        yield server
    finally:
        server.stop()


def find_saturation(args: argparse.Namespace, server: Server, budget: Budget) -> dict[str, Any]:
    """Per dataset: capacity C = request throughput with every request at once; then the ladder C x
    SATURATION_LADDER from the top down, until a rate falls short. R = the smallest ladder rate whose output
    tokens/s reach (1 - tol) of the all-at-once figure, else C. A dataset that fails or runs out of time is recorded
    with its error (the others keep their rates)."""
    out: dict[str, Any] = {}
    for dataset in args.datasets:
        if budget.left() <= 0:
            out[dataset] = {"error": "not measured: the time budget ran out"}
            continue
        try:
            out[dataset] = _saturate(args, server, dataset, budget)
        except ServeError as exc:
            out[dataset] = {"error": str(exc)}
    return out


def _saturate(args: argparse.Namespace, server: Server, dataset: str, budget: Budget) -> dict[str, Any]:
    first, second = SATURATION_SLICES
    top = bench_once(args, server, dataset=dataset, slice_index=first, rate="inf", budget=budget)
    cap, tput = top["bench"]["request_throughput"], top["bench"]["output_throughput"]
    floor = (1 - args.saturation_tol) * tput
    ladder = []
    for i, f in enumerate(SATURATION_LADDER):
        if budget.left() <= 0:
            break
        # the ladder alternates between its two slices: it measures output tokens/s, which a prefix-cache hit on a
        # prompt seen two runs earlier barely changes
        run = bench_once(args, server, dataset=dataset, slice_index=(second, first)[i % 2], rate=f * cap, budget=budget)
        ladder.append({"rate": f * cap, "output_throughput": run["bench"]["output_throughput"]})
        if ladder[-1]["output_throughput"] < floor:
            break
    return {
        "rate": saturation_rate(ladder, floor, cap),
        "capacity_req_s": cap,
        "inf_output_throughput": tput,
        "ladder": ladder,
    }


def saturation_rate(ladder: list[dict[str, float]], floor: float, capacity: float) -> float:
    """The smallest measured rate whose output tokens/s reach ``floor``, else ``capacity``."""
    reached = [p["rate"] for p in ladder if p["output_throughput"] >= floor]
    return min(reached) if reached else capacity
