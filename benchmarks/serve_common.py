"""Shared pieces of the served-path drivers (serve_bench, serve_features, serve_soak): starting and stopping
`vllm serve` on loopback, waiting for /health, reading Prometheus text from /metrics, the method table, versions.

Every failure a user can cause (a server that dies or never answers, an unreachable URL, an unknown method, a
dataset without prompts) raises ``ServeError`` with one line naming the thing, the value and the fix; the drivers'
``main`` prints that line and exits 2.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Self

HOST = "127.0.0.1"
HEALTH_TIMEOUT_S = 900.0  # an 8B-shaped target loads and compiles in a few minutes
HEALTH_POLL_S = 1.0
SHUTDOWN_WAIT_S = 60.0
HTTP_TIMEOUT_S = 10.0
VLLM_CLI_ENV = "SPECDEC_VLLM_CLI"  # overrides the vLLM command line (the CPU tests point it at serve_fake)
SPEC_PREFIX = "vllm:spec_decode_num_"
SPECDEC_PREFIX = "specdec"  # the plugin's own metrics (its endpoint, metrics_port; vLLM's /metrics has none)
MARGIN_S = 30.0  # kept from a driver's --time-budget-s for stopping its servers and writing results

# method name -> vLLM speculative config (None: no speculation). "hybrid" gets draft_model filled in.
METHODS: dict[str, dict[str, Any] | None] = {
    "nospec": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix"},
    "specdec": {"method": "specdec"},
    "hybrid": {"method": "specdec", "drafter": ["suffix", "model"]},
}


MODES = ("thread", "schedule")  # the plugin's async_mode values the serving drivers run, one server each


class ServeError(RuntimeError):
    """A one-line, user-fixable failure of a served-path driver."""


class Budget:
    """A driver's ``--time-budget-s``: what is left of it, less ``MARGIN_S`` (no new work once it is <= 0)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic() - MARGIN_S


def spec_config(method: str, draft_model: str = "") -> dict[str, Any] | None:
    """The ``--speculative-config`` of ``method`` (None for no speculation)."""
    if method not in METHODS:
        raise ServeError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    cfg = METHODS[method]
    if cfg is None:
        return None
    cfg = dict(cfg)
    if method == "hybrid":
        if not draft_model:
            raise ServeError("method 'hybrid' needs --draft-model (the draft model folder)")
        cfg["draft_model"] = draft_model
    return cfg


def parse_methods(text: str) -> list[str]:
    """A comma-separated method list, each checked against METHODS before any server starts."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise ServeError("--methods is empty: name at least one of " + ", ".join(METHODS))
    for m in methods:
        spec_config(m, draft_model="-")
    return methods


def parse_names(text: str, valid: Any, *, what: str) -> list[str]:
    """A comma-separated list of names (features, modes), each checked against ``valid`` before anything starts."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in valid:
            raise ServeError(f"unknown {what} {n!r}: use one of {', '.join(valid)}")
    return names


def vllm_cli(override: str = "") -> list[str]:
    """The `vllm` command: ``override``, else $SPECDEC_VLLM_CLI, else this Python's vLLM CLI module (the `vllm`
    console script is absent when vLLM comes through PYTHONPATH, as on the GPU machine)."""
    text = override or os.environ.get(VLLM_CLI_ENV, "")
    return shlex.split(text) if text else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def pinned(cli: str, cpus: list[int]) -> str:
    """``cli`` run on ``cpus`` (taskset) where there is a share to pin to and taskset exists."""
    if not cpus or not shutil.which("taskset"):
        return cli
    return f"taskset -c {','.join(map(str, cpus))} {cli}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = HTTP_TIMEOUT_S) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def check_reachable(base_url: str) -> None:
    """Raise a one-line ServeError unless ``base_url``/health answers 200."""
    try:
        status, _ = http_get(f"{base_url}/health")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServeError(f"cannot reach {base_url}/health ({reason}): start the server or fix --base-url") from None
    if status != 200:
        raise ServeError(f"{base_url}/health answered {status}: the server is not ready")


class Server:
    """`vllm serve` in its own process group on loopback; ``stop`` sends SIGINT to the group (SIGKILL after
    SHUTDOWN_WAIT_S). Use as a context manager so the server never outlives the driver."""

    def __init__(
        self,
        model: str,
        *,
        port: int,
        log: Path,
        spec: dict[str, Any] | None = None,
        server_args: list[str] | None = None,
        cli: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        """``env``: variables set for the server process on top of this process's environment."""
        self.model, self.port, self.log = model, port, log
        self.env = {**os.environ, **env} if env else None
        self.base_url = f"http://{HOST}:{port}"
        self.cmd = [*vllm_cli(cli), "serve", model, "--host", HOST, "--port", str(port)]
        if spec is not None:
            self.cmd += ["--speculative-config", json.dumps(spec)]
        self.cmd += list(server_args or [])
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None

    def start(self, timeout_s: float = HEALTH_TIMEOUT_S) -> Server:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(
                self.cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
            )
        self.wait_health(timeout_s)
        return self

    def wait_health(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise ServeError(
                    f"server exited with code {rc} before /health answered: see {self.log} ({failure_line(self.log)})"
                )
            try:
                if http_get(f"{self.base_url}/health", timeout=HEALTH_POLL_S * 5)[0] == 200:
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(HEALTH_POLL_S)
        self.stop()
        raise ServeError(f"server not healthy after {timeout_s:.0f} s: see {self.log}; raise --health-timeout-s")

    def pids(self) -> list[int]:
        """The server's processes (its process group: API server, engine core, workers)."""
        if self.proc is None:
            return []
        return process_group(self.proc.pid)

    def stop(self) -> int | None:
        """SIGINT to the process group; the exit code, or None if it had to be killed."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=SHUTDOWN_WAIT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                self.exit_code = None
                return None
            except ProcessLookupError:
                self.proc.wait()
        self.exit_code = self.proc.returncode
        return self.exit_code

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# an exception line of a dying server's log: "...ValueError: Free memory on device ..." (vLLM prefixes each line
# with its process and logger fields)
EXCEPTION_LINE = re.compile(r"\b(\w+(?:Error|Exception): .*)")
WRAPPER_ERROR = "Engine core initialization failed"  # vLLM's API server re-raising its engine's error
NOT_ERRORS = re.compile(r"\b(WARNING|INFO|DEBUG)\b")  # log lines that may quote an exception (vLLM's ulimit note)


def failure_line(path: Path) -> str:
    """What a dying server's log says went wrong, cut to 300 characters: the first exception line that is not
    vLLM's wrapper of its engine core's failure (the root cause, e.g. too little free GPU memory), else the last
    non-empty line."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for ln in lines:
        m = EXCEPTION_LINE.search(ln)
        if m and WRAPPER_ERROR not in ln and not NOT_ERRORS.search(ln):
            return m.group(1).strip()[:300]
    return lines[-1].strip()[:300] if lines else "empty log"


def process_group(pgid: int) -> list[int]:
    """PIDs whose process group is ``pgid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": state ppid pgrp ...
        if int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


def rss_mib(pids: list[int]) -> float:
    """Summed resident set size of ``pids`` in MiB (processes that ended count 0)."""
    total_kib = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
        except OSError:
            continue
    return total_kib / 1024


def _gpu0_query(query: str, fmt: str) -> str | None:
    """GPU 0's line of ``nvidia-smi --query-gpu=QUERY --format=FMT``, stripped (None without a GPU or nvidia-smi)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", f"--format={fmt}"],
            capture_output=True,
            text=True,
            timeout=HTTP_TIMEOUT_S,
            check=True,
        ).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def gpu_memory_mib() -> float | None:
    """Used memory of GPU 0 from nvidia-smi (None without one)."""
    line = _gpu0_query("memory.used", "csv,noheader,nounits")
    try:
        return None if line is None else float(line)
    except ValueError:
        return None


# --------------------------------------------------------------------------- /metrics
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name (labels dropped): value summed over label sets}; comments skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def by_label(text: str, metric: str, label: str) -> dict[str, float]:
    """Prometheus text -> {value of ``label``: ``metric`` summed over its other label sets} (lines of ``metric``
    without that label skipped)."""
    pattern = re.compile(rf'(?:^|[{{,]){re.escape(label)}="([^"]*)"')
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            found = pattern.search(line.partition("{")[2])
            if found:
                out[found.group(1)] = out.get(found.group(1), 0.0) + float(line.rpartition(" ")[2])
    return out


def scrape(base_url: str) -> dict[str, float]:
    return parse_metrics(http_get(f"{base_url}/metrics")[1])


def spec_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """vLLM's spec-decode counters over a window: drafts, draft tokens, accepted tokens, acceptance (accepted /
    drafted) and emitted tokens per drafting step (1 + accepted / drafts); zeros without speculation."""

    def d(key: str) -> float:
        name = f"{SPEC_PREFIX}{key}_total"
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts, drafted, accepted = d("drafts"), d("draft_tokens"), d("accepted_tokens")
    return {
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance": accepted / drafted if drafted else 0.0,
        "emitted_per_step": 1.0 + accepted / drafts if drafts else 0.0,
    }


def plugin_counters(metrics: dict[str, float]) -> dict[str, float]:
    """The plugin's own counters where /metrics carries them (names starting with ``specdec``)."""
    return {k: v for k, v in metrics.items() if k.startswith(SPECDEC_PREFIX)}


def with_metrics_port(spec: dict[str, Any] | None, port: int) -> tuple[dict[str, Any] | None, int]:
    """``spec`` with the plugin's metrics endpoint on (``metrics_port``) where it is a specdec config: its own
    port if it names one, else ``port`` (-1: a free one; 0: leave it off). Returns (spec, the port or 0)."""
    if not spec or spec.get("method") != "specdec" or port == 0 and "metrics_port" not in spec:
        return spec, 0
    spec = dict(spec)
    spec.setdefault("metrics_port", free_port() if port < 0 else port)
    return spec, int(spec["metrics_port"])


def scrape_plugin(url: str) -> tuple[dict[str, float], str]:
    """The plugin's own endpoint (``metrics_port``): (its metrics, '') or ({}, why not); never raises (the plugin
    serves it on a best-effort basis: a busy port leaves it off)."""
    if not url:
        return {}, ""
    try:
        return parse_metrics(http_get(url)[1]), ""
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return {}, f"{url}: {getattr(exc, 'reason', exc)}"


# --------------------------------------------------------------------------- provenance
def device_name() -> str:
    return _gpu0_query("name,memory.total", "csv,noheader") or "no GPU (nvidia-smi absent)"


def write_json(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)
