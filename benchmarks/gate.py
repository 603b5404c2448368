"""The GPU gate (issue 41): the plugin's default path against no speculation and vLLM's own ``suffix``, a verdict
per cell, under vLLM's default engine arguments on the shared target inflated to an 8B shape.

    python -m benchmarks.gate_prompts --before-commit BASE        # CPU: device_inputs/ (prompts, base tree)
    bash scripts/gpu_gate.sh --tp 1 --part cells                  # GPU: installs, then this driver
    bash scripts/gpu_gate.sh --tp 2 --part cells --methods nospec,suffix --sets agentic,code
    bash scripts/gpu_gate.sh --part serve
    python -m benchmarks.gate_report OUT1.json OUT2.json ...      # merge and re-render

``--part cells``: each method's engine in a worker process of its own (``gate_worker``). Where the machine has
GPUs for more than one engine (two GPUs at TP=1, four at TP=2 or TP=1), the methods run in lanes at once, up to
``MAX_LANES``, each with its engine's GPUs and their NUMA node's cores (else an equal share: ``gpu_cores``; lane
i: every n-th method from the i-th; with two lanes nospec then specdec on the first, suffix then specdec-before on
the second); otherwise one after another. ``--max-wall-s`` bounds the whole call: no engine starts that could not
also run a cell before the deadline, no cell starts that would pass it, and whatever finished is written (marked
partial). ``--part serve``: ``gate_serve``. Results: ``<date>_<device>_gate_tp<N>_<commit7>.json`` (+ .md, + the
engines' logs) in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import gate_report as report
from benchmarks.gate_args import DEFAULT_METHODS, SETS, check_args, parser
from benchmarks.gate_env import device_info, gpu_names, load_inputs, prepare_model, pythonpath, versions
from benchmarks.gate_metrics import log_phases
from benchmarks.gate_worker import REFERENCE_METHOD, base_method
from benchmarks.gpu_cores import PCI_ORDER, gpu_lane_cores, span

KILL_GRACE_S = 20.0  # a worker still running this long past the deadline is killed (its finished cells kept)
ENGINE_START_EST_S = 150.0  # an 8B-shaped engine under vLLM's defaults starts in ~2-2.5 min (a cold machine)
START_EST_MARGIN = 1.25  # an engine started earlier on this machine (compile cache warm): its start x this
MIN_CELLS_S = 30.0  # an engine is started only if this much cell time would be left after its start
MAX_LANES = 4  # engines at once (4 GPUs at TP=1: one per method; at TP=2: two lanes of two)
LOG_TAIL_CHARS = 200_000  # of each engine's log copied into the call's log file


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    args = ap.parse_args(argv)
    check_args(ap, args)
    if args.part == "prepare":
        print(f"gate: model ready: {prepare_model(args)[0]}", flush=True)
    elif args.part == "serve":
        from benchmarks.gate_serve import run_serve

        run_serve(args)
    else:
        run_cells(args)


def lanes(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Lanes of engines run at once: as many as the GPUs hold engines of ``args.tp`` GPUs (at most ``MAX_LANES``
    and one per method), lane i taking every n-th method from the i-th, its engine's GPUs and their NUMA node's
    cores where the host says which, else an n-th of the cores (``gpu_cores``); one lane (all cores) where only one
    engine fits."""
    gpus = args.gpus or len(gpu_names(args.fake)) or 1
    n = max(1, min(MAX_LANES, gpus // args.tp, len(args.methods)))
    cores, how = gpu_lane_cores(n, sorted(os.sched_getaffinity(0)), per_lane=args.tp)
    return [
        {
            "methods": args.methods[i::n],
            "gpus": ",".join(str(g) for g in range(i * args.tp, (i + 1) * args.tp)),
            "cpus": cores[i] if n > 1 else [],
            "placed": how if n > 1 else "",
        }
        for i in range(n)
    ]


def gate_key(tp: int, inputs: dict[str, Any]) -> str:
    """The results' key of a cells call: ``tp<N>``, ``tp<N>_mml<M>`` on the near-end inputs (their own engines
    and work folder: no speculation's cells there are not the default inputs')."""
    mml = inputs.get("max_model_len")
    return f"tp{tp}_mml{mml}" if mml else f"tp{tp}"


class CellsRun:
    """One ``--part cells`` call: its lanes, the engines they finished, the results written after each."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.inputs = load_inputs(args.inputs, args.before_path)
        self.key = gate_key(args.tp, self.inputs)
        self.work = Path(args.work_dir) / self.key
        self.work.mkdir(parents=True, exist_ok=True)
        self.engines: dict[str, Any] = {}
        self.skipped: list[str] = []
        self.lock = threading.Lock()
        self.model, self.label = prepare_model(args)
        self.reference = self._reference()
        self.path = bench_path(self.work)
        self.source = self._source()

    def _reference(self) -> str:
        """No speculation's worker file the specdec engines' re-runs compare with: this call's own, else an earlier
        call's on this machine, else the nospec engine of ``--reference`` (a results file)."""
        path = self.work / f"{REFERENCE_METHOD}.json"
        if REFERENCE_METHOD in self.args.methods:
            path.unlink(missing_ok=True)
        elif self.args.reference:
            gate = json.loads(Path(self.args.reference).read_text())["gates"].get(self.key, {})
            path.write_text(json.dumps({**gate["engines"][REFERENCE_METHOD], "partial": False}))
        if REFERENCE_METHOD in self.args.methods:
            return str(path)
        if not path.exists():
            print(f"gate: no {REFERENCE_METHOD} engine in this call or before it: no re-runs", flush=True)
            return ""
        print(f"gate: reference {REFERENCE_METHOD} from an earlier call: {path}", flush=True)
        self.engines[REFERENCE_METHOD] = {**json.loads(path.read_text()), "earlier_call": True}
        return str(path)

    def _source(self) -> dict[str, Any]:
        a = self.args
        return {
            "part": f"cells {self.key}",
            "command": os.environ.get("GATE_COMMAND")
            or " ".join([sys.executable, "-m", "benchmarks.gate", *sys.argv[1:]]),
            "device": device_info(a),
            "versions": versions(self.inputs),
            "commit": self.inputs.get("commit", ""),
            "dirty": self.inputs.get("dirty"),
            "before_commit": (self.inputs.get("before") or {}).get("commit"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(a.t0)),
            "max_wall_s": a.max_wall_s,
            "lanes": lanes(a),
            "settings": {
                "model": self.label,
                "engine_args": "vLLM defaults: model, dtype=bfloat16, speculative_config, tensor_parallel_size "
                "(and disable_log_stats=False: the counters get_metrics() reads)"
                + (f"; max_model_len {self.inputs['max_model_len']}" if self.inputs.get("max_model_len") else ""),
                "sets": a.sets,
                "batch": self.inputs.get("batch"),
                "prompts_policy": self.inputs.get("policy"),
                "greedy": "every cell but the sampled one (temperature 0.8, per-request seeds)",
                "nospec_repeats": 2,
                "detokenize": False,
                "fake": a.fake,
            },
        }

    def run(self) -> dict[str, Any]:
        threads = [threading.Thread(target=self._lane, args=(lane,)) for lane in lanes(self.args)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.write()

    def _lane(self, lane: dict[str, Any]) -> None:
        for m in lane["methods"]:
            res = None
            try:
                if time.time() + self.start_estimate() + MIN_CELLS_S > self.args.deadline:
                    print(f"gate: {m} not started: it would not finish within --max-wall-s", flush=True)
                else:
                    res = self._engine(m, lane)
            finally:  # whatever happened: the engines that wait for the reference stop waiting once it ended
                if m == REFERENCE_METHOD:
                    self._close_reference()
                with self.lock:
                    if res is not None:
                        self.engines[m] = res
                    else:
                        self.skipped.append(m)
                    self.write()

    def start_estimate(self) -> float:
        """Seconds an engine start is budgeted: ``START_EST_MARGIN`` x the slowest start of the engines this machine
        ran before (their worker files under the work dir, either TP size: vLLM's compile cache is warm then), else
        ``ENGINE_START_EST_S``."""
        starts = []
        for path in Path(self.args.work_dir).glob("tp*/*.json"):
            try:
                starts.append(float(json.loads(path.read_text())["start_s"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return min(ENGINE_START_EST_S, START_EST_MARGIN * max(starts)) if starts else ENGINE_START_EST_S

    def _close_reference(self) -> None:
        """Mark no speculation's worker file final (written empty if its engine left none)."""
        path = Path(self.reference)
        try:
            ref = json.loads(path.read_text())
        except (OSError, ValueError):
            ref = {"cells": {}}
        path.write_text(json.dumps({**ref, "partial": False}))

    def _engine(self, method: str, lane: dict[str, Any]) -> dict[str, Any] | None:
        """One worker under the deadline; its result (partial if it was cut short), or None if it has none."""
        out, log = self.work / f"{method}.json", self.work / f"{method}.log"
        if method != REFERENCE_METHOD:
            out.unlink(missing_ok=True)
        # the installed specdec (the before engine: its own tree first), never ./specdec of the working directory
        before = [self.args.before_path] if base_method(method) == "specdec-before" else []
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": lane["gpus"], **PCI_ORDER, "PYTHONSAFEPATH": "1"}
        env["PYTHONPATH"] = pythonpath(*before, self.path)
        cmd = [sys.executable, "-m", "benchmarks.gate_worker", "--inputs", self.args.inputs, "--method", method]
        cmd += ["--sets", ",".join(self.args.sets), "--out", str(out), "--model", self.model, "--tp", str(self.args.tp)]
        cmd += ["--deadline", str(self.args.deadline), "--reference", self.reference]
        cmd += ["--cpus", ",".join(map(str, lane["cpus"]))] if lane["cpus"] else []
        cmd += ["--fake"] if self.args.fake else []
        cpus = f", cores {span(lane['cpus'])} ({lane['placed']})" if lane["cpus"] else ""
        print(f"=== {method} on GPU {lane['gpus']}{cpus} ===", flush=True)
        t0 = time.time()
        rc = run_process(cmd, env=env, log=log, timeout_s=self.args.deadline + KILL_GRACE_S - time.time())
        print(f"=== {method} rc={rc} in {time.time() - t0:.0f} s ===", flush=True)
        try:
            res = json.loads(out.read_text())
        except (OSError, ValueError):
            print(f"gate: {method} left no result (rc {rc}); its log: {log}", flush=True)
            return None
        text = log.read_text(errors="replace") if log.exists() else ""
        return {**res, "rc": rc, "partial": res.get("partial") or rc != 0, "log": log_phases(text)}

    def write(self) -> dict[str, Any]:
        doc = self.doc()
        name = report.results_name(doc, self.key)
        if self.args.methods != list(DEFAULT_METHODS) or self.args.sets != list(SETS):  # a subset: its own name
            name += "_" + "-".join(self.args.methods) + "_" + "-".join(self.args.sets)  # "+" does not travel back
        report.write(doc, Path(self.args.out_dir), name)
        self._logs(Path(self.args.out_dir) / f"{name}_engines.log")
        return doc

    def doc(self) -> dict[str, Any]:
        partial = bool(self.skipped) or any(e.get("partial") for e in self.engines.values())
        gate = {
            "engines": dict(self.engines),
            "skipped": [m for m in self.args.methods if m in self.skipped],  # the methods' order
            "model": self.label,
            "sets": self.args.sets,
        }
        src = {**self.source, "partial": partial, "wall_s": time.time() - self.args.t0}
        return {"kind": report.KIND, "schema": 1, "gates": {self.key: gate}, "serve": {}, "sources": [src]}

    def _logs(self, path: Path) -> None:
        """Every engine's log (its last LOG_TAIL_CHARS, progress bars left out) in one file beside the results."""
        parts = []
        for m in self.args.methods:
            log = self.work / f"{m}.log"
            if log.exists():
                text = "\n".join(ln for ln in log.read_text(errors="replace").splitlines() if "it/s]" not in ln)
                parts.append(f"===== {m} =====\n{text[-LOG_TAIL_CHARS:]}")
        path.write_text("\n".join(parts) + "\n")


def bench_path(work: Path) -> str:
    """A folder holding only a link to this ``benchmarks`` package: on a worker's path, ``python -m
    benchmarks.gate_worker`` is found while ``import specdec`` is not taken from the working directory."""
    folder = work / "path"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "benchmarks"
    if not link.exists():
        link.symlink_to(Path(__file__).resolve().parent)
    return str(folder)


def run_process(cmd: list[str], *, env: dict[str, str], log: Path, timeout_s: float) -> int:
    """``cmd`` in a process group of its own, output to ``log``; its exit code, or 124 once past ``timeout_s``. The
    whole group is killed on the way out: an engine core outliving its worker would hold the GPU."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            return 124
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_cells(args: argparse.Namespace) -> None:
    doc = CellsRun(args).run()
    print(report.render(doc), flush=True)


if __name__ == "__main__":
    main()
