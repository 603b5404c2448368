"""The GPU gate's serving part (``gate --part serve``): the low-acceptance serving check and the served start-up.

* ``tpot-53m`` / ``tpot-8b``: `vllm serve` of the shared target (and of it inflated to the 8B shape) without
  speculation and with ``{"method": "specdec"}``, each driven by `vllm bench serve --backend vllm --dataset-name random
  --random-input-len 256 --random-output-len 128 --request-rate 20`, 600 requests seen as three windows of 200
  (after a warm-up of ``WARMUP_PROMPTS`` on another seed); the gate is specdec's median TPOT over none's, the median
  of the three windows' ratios. With several GPUs the
  servers start at once (one per GPU, up to ``MAX_SERVE_ROUND``, an equal share of the cores each) and are measured
  one after the other. The specdec server also answers one completion: the served start-up at TP=1.
* ``start-8b-tp2``: `vllm serve` of the 8B shape with specdec at its defaults at TP=2 starts and answers.
Each server runs with vLLM's defaults (only the model, the speculative config and the tensor-parallel size).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import gate_report as report
from benchmarks.bench_vllm_methods import NO_DRAFT_SUFFIX
from benchmarks.gate_args import REQUEST_RATE, in_flight
from benchmarks.gate_env import device_info, gpu_names, load_inputs, prepare_model, pythonpath, versions
from benchmarks.gate_metrics import bench_windows, plugin_line, read_bench
from benchmarks.gpu_cores import PCI_ORDER, gpu_lane_cores, span
from benchmarks.serve_common import (
    HOST,
    VLLM_CLI_ENV,
    ServeError,
    Server,
    free_port,
    pinned,
    scrape,
    spec_delta,
)

SPECDEC = {"method": "specdec"}
# --serve-methods: (speculative config, extra environment); "before" in the environment: the base tree first on the path
SERVE_SPECS: dict[str, tuple[dict[str, Any] | None, dict[str, str]]] = {
    "nospec": (None, {}),
    "specdec": (SPECDEC, {}),
    "nospec-v1": (None, {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    "specdec-before": (SPECDEC, {"before": "1"}),
    "specdec-schedule": ({**SPECDEC, "async_mode": "schedule"}, {}),
    # the default, logging its drafting statistics every LOG_EVERY_S (steps, plain steps, drafted / accepted tokens,
    # back-offs) into the server log, which the call keeps: what a TPOT ratio is made of
    "specdec-log": ({**SPECDEC, "log_every_s": 2.0}, {}),
    # the default's whole machinery (schedule or thread mode, its graphs, the suffix trie fed every step) with drafts
    # of depth 0: what the plugin costs on steps that verify no draft, apart from what its drafted steps cost
    "specdec-nodraft": ({**SPECDEC, "drafter_options": {"suffix": NO_DRAFT_SUFFIX}}, {}),
}
RANDOM_FLAGS = ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128"]
NUM_PROMPTS, SEED = 200, 0  # the rate: gate_args.REQUEST_RATE
# the measured run per server: BENCH_WINDOWS x NUM_PROMPTS requests at REQUEST_RATE in one `vllm bench serve`
# (--save-detailed), cut into BENCH_WINDOWS consecutive windows of NUM_PROMPTS requests ("bench_runs"); the report pairs
# each window with the same window of its call's no speculation (same seed: the same requests) and takes the median
# of the ratios. Three: a server's outputs are sampled (the server's temperature), so how much it drafts moves over
# time, and one stretch of a server's traffic can read well apart from the rest; the median of three leaves one such
# window out. One run, not three: each `vllm bench serve` start imports vLLM, which takes longer than a window
BENCH_WINDOWS = 3
# a window at ``cN`` (at most N in flight): CONCURRENCY_WINDOW_WAVES x N requests, not NUM_PROMPTS. A window of
# NUM_PROMPTS requests holds only NUM_PROMPTS / N generations of requests at large N, too few for its median to
# settle; whole waves of N keep the run short, since N requests in flight finish a wave in one request's decoding time
CONCURRENCY_WINDOW_WAVES = 6
WARMUP_PROMPTS, WARMUP_SEED = 20, 1  # another seed: no prompt of the measured run is seen before it
START_EST_S = {"53m": 120.0, "8b": 130.0}  # vllm serve under vLLM's defaults to /health: a fresh compile, no cache
BENCH_EST_S = 35.0  # a `vllm bench serve` besides its arrivals: its start (vLLM's import), the last answers, the result
INF_ARRIVALS_EST_S = 15.0  # the measured run's requests all at once: their decoding, past what BENCH_EST_S holds
WAVE_EST_S = 3.0  # with at most N in flight: each N requests' decoding (128 tokens of an 8B shape, N ~ 100)
BENCH_TIMEOUT_S = 300.0
ANSWER_EST_S = 20.0  # one completion and the server's shutdown
ANSWER_PROMPT, ANSWER_TOKENS = "def fibonacci(n):", 16
LOG_TAIL_CHARS = 100_000
MAX_SERVE_ROUND = 4  # servers started at once, one per GPU
# a later round's estimate is the round before it as measured (same model, rates and machine), times this: the
# constants above are a fresh machine's cold start, longer than a warm machine's later rounds
ROUND_EST_MARGIN = 1.1


def cli_base(fake: bool) -> str:
    """The `vllm` command line (the fake CLI on a dry run)."""
    if fake:
        return f"{sys.executable} -m benchmarks.serve_fake"
    return os.environ.get(VLLM_CLI_ENV) or f"{sys.executable} -m vllm.entrypoints.cli.main"


class ServeRun:
    """One ``--part serve`` call: its checks, in order, within the budget; results written after each."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work_dir) / "serve"
        self.work.mkdir(parents=True, exist_ok=True)
        self.gpus = args.gpus or len(gpu_names(args.fake)) or 1
        inputs = load_inputs(args.inputs, args.before_path)
        shape = args.shape
        args.shape = ""
        self.models = {"53m": prepare_model(args)}
        args.shape = shape
        self.models["8b"] = prepare_model(args)
        self.checks: dict[str, Any] = {}
        before = (inputs.get("before") or {}).get("commit")
        self.source = {
            "part": "serve",
            "command": os.environ.get("GATE_COMMAND")
            or " ".join([sys.executable, "-m", "benchmarks.gate", *sys.argv[1:]]),
            "device": device_info(args),
            "versions": versions(inputs),
            "commit": inputs.get("commit", ""),
            "before_commit": before if "specdec-before" in args.serve_methods else None,
            "settings": {
                "bench": "vllm bench serve --backend vllm " + " ".join(RANDOM_FLAGS) + f" --num-prompts "
                f"{BENCH_WINDOWS} x W --request-rate R --seed {SEED} --save-detailed (temperature: the server's "
                f"default); its requests in {BENCH_WINDOWS} windows of W = {NUM_PROMPTS} (at cN: "
                f"{CONCURRENCY_WINDOW_WAVES} x N); R: "
                + ", ".join(args.serve_rates)
                + " (each a check, on the same servers)",
                "warmup": f"{WARMUP_PROMPTS} prompts, seed {WARMUP_SEED}",
                "server_args": "vLLM defaults: model, --speculative-config, --tensor-parallel-size",
                "fake": args.fake,
            },
        }

    def run(self) -> dict[str, Any]:
        for name in self.args.checks:
            size = name.split("-")[1]
            tp = 2 if name.endswith("tp2") else 1
            keys = [check_key(name, r) for r in self.args.serve_rates] if name.startswith("tpot") else [name]
            if tp > self.gpus:
                self.checks[name] = {"kind": "start", "skipped": f"needs {tp} GPUs, {self.gpus} here"}
            elif (need := self._need_s(size, name)) > (left := self.args.deadline - time.time()):
                kind = "tpot" if name.startswith("tpot") else "start"
                skipped = time_skip(need, left)
                print(f"gate: {name} not run: {skipped}", flush=True)
                self.checks.update({k: {"kind": kind, "skipped": skipped} for k in keys})
            elif name.startswith("tpot"):
                self.checks.update(zip(keys, self._tpot(size)))
            else:
                self.checks[name] = self._start(size, tp)
            self.write()
        return self.write()

    def _need_s(self, size: str, name: str) -> float:
        """The estimated seconds the check's servers need to start and be measured (a TPOT check's two servers
        start at once on two GPUs, one after the other on one)."""
        if name.startswith("start"):
            return START_EST_S[size] + ANSWER_EST_S
        return START_EST_S[size] * (1 if self.gpus >= 2 else 2) + 2 * self._bench_est()

    def _bench_est(self) -> float:
        """One server's warm-up and measured runs, one per ``--serve-rate``."""
        return BENCH_EST_S + sum(BENCH_EST_S + arrivals_s(r) for r in self.args.serve_rates)

    def _tpot(self, size: str) -> list[dict[str, Any]]:
        """The check's servers (``--serve-methods``, nospec and specdec first) in rounds of one per GPU: a round's
        servers start at once (one GPU each and its cores: ``gpu_cores``, the GPU's NUMA node's where the host says),
        then each is benchmarked in turn, at each ``--serve-rate`` (one check each, in that order, on the same
        servers). A round that could not finish before the deadline is skipped (its servers recorded as such)."""
        model, label = self.models[size]
        checks = [{"kind": "tpot", "model": label, "tp": 1, "rate": r, "servers": {}} for r in self.args.serve_rates]
        check = checks[0]  # the starts and skips are recorded here, and copied to the others
        methods = list(self.args.serve_methods)
        per_round = max(1, min(self.gpus, MAX_SERVE_ROUND))
        cores = sorted(os.sched_getaffinity(0))
        last: RoundTime | None = None  # the latest round, measured: the next round's estimate
        for first in range(0, len(methods), per_round):
            names = methods[first : first + per_round]
            need = last.need_s(len(names)) if last else START_EST_S[size] + self._bench_est() * len(names)
            if first and need > (left := self.args.deadline - time.time()):
                skipped = time_skip(need, left)
                print(f"gate: servers {', '.join(names)} not run: {skipped}", flush=True)
                for c in checks:
                    c["servers"].update({k: {"skipped": skipped} for k in names})
                continue
            lanes, how = gpu_lane_cores(len(names), cores) if len(names) > 1 else ([[]], "")
            servers = {k: self._server(model, k, *SERVE_SPECS[k], str(i), lanes[i]) for i, k in enumerate(names)}
            t0 = time.time()
            threads = [threading.Thread(target=self._start_one, args=(s, check, k)) for k, s in servers.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            started = time.time() - t0
            for i, k in enumerate(names):  # beside the GPUs each start recorded: the cores
                check["servers"][k]["cores"] = f"{how}: {span(lanes[i])}" if how else "all"
            for k, s in servers.items():
                self._measure(s, checks, k, model)
            last = RoundTime(start_s=started, bench_s=(time.time() - t0 - started) / len(names))
        return checks

    def _start(self, size: str, tp: int) -> dict[str, Any]:
        model, label = self.models[size]
        key = f"specdec-tp{tp}"
        check: dict[str, Any] = {"kind": "start", "model": label, "tp": tp, "servers": {}}
        s = self._server(model, key, SPECDEC, {}, ",".join(map(str, range(tp))), [], tp=tp)
        self._start_one(s, check, key)
        try:
            if s.proc is not None and "error" not in check["servers"][key]:
                check["servers"][key]["answered"] = answer(s.base_url, model)
        finally:
            s.stop()
        return check

    def _server(
        self, model: str, key: str, spec: Any, extra: dict[str, str], gpus: str, cpus: list[int], *, tp: int = 1
    ) -> Server:
        args = ["--tensor-parallel-size", str(tp)] if tp > 1 else []
        log = self.work / f"{key}-{Path(model).name}.log"
        env = {"CUDA_VISIBLE_DEVICES": gpus, **PCI_ORDER, **{k: v for k, v in extra.items() if k != "before"}}
        if extra.get("before"):  # the base commit's tree first on the path (gpu_gate.sh installed it there)
            env["PYTHONPATH"] = pythonpath(self.args.before_path)
        return Server(
            model,
            port=free_port(),
            log=log,
            spec=spec,
            server_args=args,
            cli=pinned(cli_base(self.args.fake), cpus),
            env=env,
        )

    def _start_one(self, server: Server, check: dict[str, Any], key: str) -> None:
        rec = check["servers"].setdefault(key, {"gpus": (server.env or {}).get("CUDA_VISIBLE_DEVICES")})
        t0 = time.time()
        try:
            server.start(max(1.0, self.args.deadline - time.time()))
            rec["start_s"] = time.time() - t0
        except ServeError as exc:
            rec["error"] = str(exc)[:300]
            server.proc = None

    def _measure(self, server: Server, checks: list[dict[str, Any]], key: str, model: str) -> None:
        """Warm-up, then per check (one per ``--serve-rate``) the measured run at its rate: its figures, its
        ``BENCH_WINDOWS`` windows' as ``bench_runs``, the spec-decode counters around it; one answered completion;
        stopped. The first check's record also holds the start and the plugin's totals since the start."""
        recs = [c["servers"].setdefault(key, {}) for c in checks]
        for rec in recs[1:]:
            rec.update({k: v for k, v in recs[0].items() if k in ("gpus", "start_s", "error")})
        try:
            if server.proc is None:
                return
            fake, rate0 = self.args.fake, checks[0]["rate"]
            bench(
                server, model, self.work / f"{key}-warmup", num=WARMUP_PROMPTS, seed=WARMUP_SEED, rate=rate0, fake=fake
            )
            for check, rec in zip(checks, recs):
                before = scrape(server.base_url)
                stem = self.work / f"{key}-run@{check['rate']}"
                rec["bench"], rec["bench_runs"] = bench(
                    server,
                    model,
                    stem,
                    num=window_prompts(check["rate"]) * BENCH_WINDOWS,
                    seed=SEED,
                    rate=check["rate"],
                    fake=fake,
                    windows=BENCH_WINDOWS,
                )
                rec["spec"] = spec_delta(before, scrape(server.base_url))
            recs[0]["answered"] = answer(server.base_url, model)
        except (ServeError, OSError, subprocess.SubprocessError) as exc:
            for rec in recs:
                rec["error"] = str(exc)[:300]
        finally:
            server.stop()
            totals = plugin_line(server.log.read_text(errors="replace")) if server.log.exists() else None
            if totals:  # the plugin's totals: its last line (engine idle after the answer, or exit)
                recs[0]["plugin"] = totals

    def write(self) -> dict[str, Any]:
        partial = any("skipped" in c or "error" in json.dumps(c) for c in self.checks.values())
        src = {**self.source, "partial": partial}
        doc = {"kind": report.KIND, "schema": 1, "gates": {}, "serve": dict(self.checks), "sources": [src]}
        name = report.results_name(doc, "serve")
        report.write(doc, Path(self.args.out_dir), name)
        logs = [
            f"===== {p.name} =====\n{p.read_text(errors='replace')[-LOG_TAIL_CHARS:]}"
            for p in sorted(self.work.glob("*.log"))
        ]
        (Path(self.args.out_dir) / f"{name}_servers.log").write_text("\n".join(logs) + "\n")
        return doc


@dataclass(frozen=True)
class RoundTime:
    """A round of servers as it ran: their start (at once) and each server's measured runs (one after another)."""

    start_s: float
    bench_s: float  # per server

    def need_s(self, servers: int) -> float:
        """The next round's estimate: this one's start and runs for ``servers`` servers, with a margin."""
        return (self.start_s + self.bench_s * servers) * ROUND_EST_MARGIN


def window_prompts(rate: str) -> int:
    """The requests of one of a measured run's ``BENCH_WINDOWS`` windows at ``rate``."""
    n = in_flight(rate)
    return NUM_PROMPTS if n is None else max(NUM_PROMPTS, CONCURRENCY_WINDOW_WAVES * n)


def arrivals_s(rate: str) -> float:
    """How long the measured run's requests take to arrive at ``rate`` (``inf``: at once, then decoded; ``cN``:
    decoded N at a time)."""
    total, n = window_prompts(rate) * BENCH_WINDOWS, in_flight(rate)
    if n is not None:
        return WAVE_EST_S * -(-total // n)
    return INF_ARRIVALS_EST_S if rate == "inf" else total / float(rate)


def rate_flags(rate: str) -> list[str]:
    """`vllm bench serve`'s flags for a ``--serve-rate``: ``cN`` is all at once with at most N in flight."""
    n = in_flight(rate)
    return ["--request-rate", rate] if n is None else ["--request-rate", "inf", "--max-concurrency", str(n)]


def time_skip(need_s: float, left_s: float) -> str:
    """Why a check or a round did not run, in the serve table's 33 characters: its estimate against the seconds
    left of ``--max-wall-s`` (what a later call's ``--max-wall-s`` must cover)."""
    return f"time: {need_s:.0f} s > {max(left_s, 0):.0f} s left"


def check_key(name: str, rate: str) -> str:
    """A check's key in the results: its name, and ``@rate`` past a TPOT check's at another rate than the issue's
    (``--serve-rate``), so that a merge keeps both."""
    return name if not name.startswith("tpot") or rate == str(REQUEST_RATE) else f"{name}@{rate}"


def bench(
    server: Server, model: str, stem: Path, *, num: int, seed: int, rate: str, fake: bool, windows: int = 0
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """One `vllm bench serve` run of the random low-acceptance traffic: its kept figures, and with ``windows`` its
    requests' per-request detail kept (``--save-detailed``) and cut into that many windows (``bench_windows``)."""
    result, log = stem.with_suffix(".result.json"), stem.with_suffix(".bench.log")
    result.unlink(missing_ok=True)
    cmd = [*shlex.split(cli_base(fake)), "bench", "serve", "--backend", "vllm", "--model", model]
    cmd += ["--host", HOST, "--port", str(server.port), *RANDOM_FLAGS, "--num-prompts", str(num)]
    cmd += [*rate_flags(rate), "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl"]
    cmd += ["--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    cmd += ["--save-detailed"] if windows else []
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=BENCH_TIMEOUT_S, check=False).returncode
    out = read_bench(result, log)
    if rc != 0 or not out:
        raise ServeError(f"`vllm bench serve` exited with code {rc} and no median TPOT: see {log}")
    detail = json.loads(result.read_text()) if windows and result.exists() else None
    return out, bench_windows(detail, windows)


def answer(base_url: str, model: str) -> bool:
    """Whether the server answers one completion with at least one token."""
    body = {"model": model, "prompt": ANSWER_PROMPT, "max_tokens": ANSWER_TOKENS, "temperature": 0}
    req = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())
    return bool(out.get("choices") and out["choices"][0].get("text"))


def run_serve(args: argparse.Namespace) -> None:
    doc = ServeRun(args).run()
    print(report.render(doc), flush=True)
