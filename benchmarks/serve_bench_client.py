"""`vllm bench serve` kept running: one process imports vLLM's serving benchmark once and runs it for every rate.

A fresh `vllm bench serve` spends about half a minute importing vLLM on the GPU host, longer than most rates' runs
(serve_bench makes 5 per dataset and method). The worker reads one JSON line per run, ``{"flags": [...], "log": path}``
with the flags that follow `vllm bench serve` on its command line, runs vLLM's benchmark on them in this process with
stdout and stderr to ``log``, and answers one line ``serve_bench_client rc=0`` (or 1); a run that raises is rc 1 and
the worker stays up. ``--runner fake`` runs serve_fake's stand-in instead (the CPU tests)::

    python -m benchmarks.serve_bench_client [--runner vllm|fake]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

from benchmarks.serve_common import ServeError

RUNNERS = ("vllm", "fake")
ANSWER = "serve_bench_client rc="  # an answer line's start: other lines on the worker's stdout are not answers


def _vllm_runner() -> Callable[[list[str]], int]:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def run(flags: list[str]) -> int:
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        bench_main(parser.parse_args(flags))
        return 0

    return run


def _fake_runner() -> Callable[[list[str]], int]:
    from benchmarks.serve_fake_bench import bench

    return bench


def serve_requests(runner: str) -> int:
    """The worker: a run per stdin line, an answer per run on stdout."""
    run = _vllm_runner() if runner == "vllm" else _fake_runner()
    answers = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        rc = 1
        try:
            fh = open(req["log"], "w")  # noqa: SIM115 - closed below; a log that cannot be opened fails the run only
        except OSError:
            traceback.print_exc(file=sys.stderr)
        else:
            with fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
                try:
                    rc = run(list(req["flags"]))
                except (Exception, SystemExit):  # argparse exits on bad flags: a failed run, not a dead worker
                    traceback.print_exc(file=fh)
        answers.write(f"{ANSWER}{int(rc or 0)}\n")
        answers.flush()
    return 0


class BenchClient:
    """The driver's side: the worker started once, a run sent per rate, its answer awaited with a timeout (a worker
    past it is killed and the run raises ServeError; the next run starts a new worker). ``retire()``: its runs go
    through the CLI from then on (``usable`` False), for every copy of the driver's arguments that holds it."""

    def __init__(self, runner: str = "vllm") -> None:
        self.runner = runner
        self.proc: subprocess.Popen[str] | None = None
        self.usable = True

    def retire(self) -> None:
        self.usable = False
        self.close()

    def _start(self) -> subprocess.Popen[str]:
        if self.proc is None or self.proc.poll() is not None:
            cmd = [sys.executable, "-m", "benchmarks.serve_bench_client", "--runner", self.runner]
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self.proc

    def run(self, flags: list[str], *, log: Path, timeout_s: float) -> int:
        proc = self._start()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"flags": flags, "log": str(log)}) + "\n")
        proc.stdin.flush()
        answer: list[str] = []

        def read() -> None:
            for line in proc.stdout:  # up to the answer; the rest of the stream is the next run's
                if line.startswith(ANSWER):
                    answer.append(line)
                    return
            answer.append("")  # the worker exited

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not answer:
            self.close()
            raise ServeError(f"`vllm bench serve` (in-process) ran past the time budget: see {log}")
        if not answer[0]:
            self.proc = None
            raise ServeError(f"the `vllm bench serve` worker exited (code {proc.wait()}): see {log}")
        return int(answer[0][len(ANSWER) :])

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            self.proc.wait()
            self.proc = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runner", choices=RUNNERS, default="vllm")
    return serve_requests(ap.parse_args(argv).runner)


if __name__ == "__main__":
    sys.exit(main())
