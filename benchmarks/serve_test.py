"""Real-server test on the GPU: `vllm serve` with the specdec plugin vs a no-spec server, greedy, concurrent.

    python -m benchmarks.serve_test --prompts device_inputs/prompts.json --out $OUT/serve_test.json

Starts two servers on loopback (no-spec and ``--speculative-config '{"method": "specdec", ...}'``), sends the same
concurrent OpenAI-API completions (temperature 0) to both, compares the texts, reads the specdec server's
spec-decode counters from /metrics (proof that drafts were verified), then stops both servers with SIGINT and
checks they exit. Exit code 0 only if every completion matches and both servers shut down cleanly.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from specdec.paths import TARGET_MODEL, model_path

HOST = "127.0.0.1"
SHUTDOWN_WAIT_S = 60
SERVER_START_TIMEOUT_S = 300


def start_server(model: str, port: int, dtype: str, spec: dict | None, log: Path) -> subprocess.Popen:
    # `python -m vllm.entrypoints.cli.main` = the `vllm` console script (absent when vLLM comes via PYTHONPATH)
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        model,
        "--host",
        HOST,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--seed",
        "0",
        "--max-model-len",
        "2048",
        "--gpu-memory-utilization",
        "0.25",
        "--enforce-eager",
    ]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    with open(log, "w") as fh:  # the server writes to its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def wait_ready(proc: subprocess.Popen, port: int, timeout_s: float) -> bool:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            return False
        try:
            if _get(f"http://{HOST}:{port}/health")[0] == 200:
                return True
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(1.0)
    return False


def complete(port: int, model: str, prompt: list[int], max_tokens: int) -> str:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}).encode()
    req = urllib.request.Request(
        f"http://{HOST}:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["text"]


def spec_metrics(port: int) -> dict[str, float]:
    out = {}
    for line in _get(f"http://{HOST}:{port}/metrics")[1].splitlines():
        if line.startswith("vllm:spec_decode_num") and "{" in line:
            name = line.split("{")[0].replace("vllm:spec_decode_num_", "").replace("_total", "")
            if "per_pos" not in name:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def stop_server(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=SHUTDOWN_WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="device_inputs/prompts.json")
    ap.add_argument("--model", default=str(model_path(TARGET_MODEL)))
    ap.add_argument("--spec", default='{"method": "specdec", "drafter": "suffix", "num_speculative_tokens": 16}')
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--port", type=int, default=18100)
    ap.add_argument("--out", default="serve_test.json")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.prompts).read_text())["datasets"]
    prompts = (data["code"]["bs64"] + data["agentic"]["bs64"])[: args.num_prompts]
    logdir = Path(args.out).parent
    ports = {"nospec": args.port, "specdec": args.port + 1}
    specs = {"nospec": None, "specdec": json.loads(args.spec)}
    servers: dict[str, subprocess.Popen] = {}
    result: dict[str, Any] = {
        "spec": json.loads(args.spec),
        "dtype": args.dtype,
        "prompts": len(prompts),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
    }
    try:
        ready = {}
        for name in ports:  # one after the other: a server profiling its memory while another one starts
            # attributes the other's allocations to itself ("No available memory for the cache blocks")
            servers[name] = start_server(args.model, ports[name], args.dtype, specs[name], logdir / f"serve_{name}.log")
            ready[name] = wait_ready(servers[name], ports[name], SERVER_START_TIMEOUT_S)
            if not ready[name]:
                break
        result["ready"] = ready
        if len(ready) == len(ports) and all(ready.values()):
            texts, walls = {}, {}
            for name, port in ports.items():
                t0 = time.perf_counter()
                send = functools.partial(complete, port, args.model, max_tokens=args.max_tokens)  # to this server
                with cf.ThreadPoolExecutor(args.concurrency) as pool:
                    texts[name] = list(pool.map(send, prompts))
                walls[name] = time.perf_counter() - t0
            same = sum(a == b for a, b in zip(texts["nospec"], texts["specdec"]))
            result.update(
                identical=same,
                compared=len(prompts),
                wall_s=walls,
                specdec_metrics=spec_metrics(ports["specdec"]),
                first_mismatch=next(
                    (i for i, (a, b) in enumerate(zip(texts["nospec"], texts["specdec"])) if a != b), None
                ),
            )
    finally:
        result["exit_codes"] = {k: stop_server(p) for k, p in servers.items()}
    ok = (
        result.get("identical") == len(prompts)
        and result.get("specdec_metrics", {}).get("accepted_tokens", 0) > 0
        and all(c is not None for c in result["exit_codes"].values())
    )
    result["ok"] = ok
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
