"""A stand-in for the `vllm` CLI, for testing the served-path drivers on the CPU (no vLLM, no GPU).

    python -m benchmarks.serve_fake serve MODEL --host 127.0.0.1 --port P [--speculative-config JSON] [...]
    python -m benchmarks.serve_fake bench serve --port P --dataset-name custom --dataset-path F ... --result-dir D
    python -m benchmarks.serve_fake --fail-start serve ...        # prints an error and exits 1 (a dying server)

``serve`` answers /health, /v1/models, /v1/completions (streaming or not, ``n``, ``stop``, ``logprobs``,
``max_tokens``; "tokens" are words chosen from the prompt's hash, or at random with temperature > 0) and /metrics
(vLLM's spec-decode counter names when a speculative config is given). A specdec config with ``metrics_port`` also
gets the plugin's own endpoint there (the plugin's ``MetricsServer``, fed fake statistics that follow the traffic).
It stops by itself after IDLE_EXIT_S without a request, when the process that started it exits, or on SIGINT.
``bench serve`` (``benchmarks.serve_fake_bench``) reads the flags the drivers pass to `vllm bench serve`, sends the
dataset's requests (streaming) and writes a result JSON with the keys vLLM 0.26's `vllm bench serve` writes.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from benchmarks.serve_fake_bench import WORDS, bench
from specdec.vllm_plugin.faults import FAULTS_ENV, Faults

IDLE_EXIT_S = 900.0  # the fake server exits after this long without a request (a round's servers wait their turn)
DRAFT_K = 4  # fake drafting: per generated token one draft of DRAFT_K tokens, half accepted
GREEDY_TOP_P = 0.1  # top_p below this keeps one candidate (the fake's top word holds more): greedy
FAKE_CACHE_CAP = (64, 4096)  # the fake drafter's global cache caps: responses, tokens
FAKE_BYTES_PER_TOKEN = 1024
FAKE_STEP_S = 0.004  # the inter-token latency the fake reports for every decoding step
FAKE_ITL_EDGES = ("0.01", "0.025", "0.05", "0.075", "0.1")  # vLLM's first inter-token latency bucket edges
FAKE_SEED = 20261129  # the sampled words' generator (no-speculation fake: this; spec fake: this + 1)
FAKE_SURE_UP_TO = 3  # completions of at most this many tokens (the sampling check's) are the prompt's but the last
FAKE_WEIGHTS = (0.5, 0.2, 0.12, 0.08, 0.05, 0.03, 0.015, 0.005)  # sampled words' probabilities, reported as logprobs


class FakeState:
    def __init__(self, model: str, spec: bool, *, cache_requests: int = FAKE_CACHE_CAP[0], faults: Any = None) -> None:
        """``faults``: the plugin's ``Faults`` (SPECDEC_TEST_FAULTS): every n-th fake drafting call (one per request
        that drafts) fails or runs late, counted and logged once per kind as the plugin does."""
        self.model, self.spec = model, spec
        self.cache_requests, self.faults = cache_requests, faults
        self.handled = {"draft_errors": 0, "draft_timeouts": 0}
        self.steps = 0  # decoding steps (a token after each choice's first): the inter-token latency observations
        self.lock = threading.Lock()
        self.counters = {
            "generation_tokens": 0,
            "spec_decode_num_drafts": 0,
            "spec_decode_num_draft_tokens": 0,
            "spec_decode_num_accepted_tokens": 0,
            "spec_decode_num_accepted_tokens_per_pos": [0] * (DRAFT_K // 2),
            "request_success": 0,
            "num_preemptions": 0,
        }
        self.running = 0
        self.last_request = time.monotonic()
        self.sampler = random.Random(FAKE_SEED + int(spec))  # sampled words: seeded, a fixed run of draws

    def count(self, tokens: int, *, drafted: int) -> None:
        """``tokens`` generated, ``drafted`` of them by a decoding step (the first of each choice is prefill's)."""
        with self.lock:
            self.counters["generation_tokens"] += tokens
            self.steps += drafted
            if self.spec and drafted and self.faults is not None:
                self._fault()
            if self.spec and drafted:
                tokens = drafted
                self.counters["spec_decode_num_drafts"] += tokens
                self.counters["spec_decode_num_draft_tokens"] += DRAFT_K * tokens
                self.counters["spec_decode_num_accepted_tokens"] += DRAFT_K // 2 * tokens
                self.counters["spec_decode_num_accepted_tokens_per_pos"] = [
                    v + tokens for v in self.counters["spec_decode_num_accepted_tokens_per_pos"]
                ]

    def _fault(self) -> None:
        """One fake drafting call: a due fault (the plugin's ``Faults.due``) counted as handled and logged once per
        kind, as the plugin does (no sleep)."""
        fault = self.faults.due()
        if fault == "raise":
            self.handled["draft_errors"] += 1
            if self.faults.raised == 1:
                print(f"drafter fake failed for request(s) r{self.faults.calls}: InjectedFault()", flush=True)
        elif fault == "sleep":
            self.handled["draft_timeouts"] += 1
            if self.faults.slept == 1:
                print("specdec: drafting 1 request(s) took longer than draft_timeout_ms=50.0", flush=True)

    def plugin_stats(self) -> dict[str, Any]:
        """Statistics shaped like the proposer's (``SpecdecProposer.stats``), following the traffic."""
        with self.lock:
            c = dict(self.counters)
        requests = min(c["request_success"], self.cache_requests)
        tokens = min(c["generation_tokens"], FAKE_CACHE_CAP[1])
        return {
            "steps": c["spec_decode_num_drafts"],
            "drafted_tokens": c["spec_decode_num_draft_tokens"],
            "accepted_tokens": c["spec_decode_num_accepted_tokens"],
            **self.handled,
            **(self.faults.as_dict() if self.faults is not None else {}),
            "resyncs": 0,
            "drafter_state": {
                "memory_bytes": FAKE_BYTES_PER_TOKEN * tokens,
                "global_cache_requests": requests,
                "global_cache_tokens": tokens,
                "global_cache_max_requests": self.cache_requests,
                "global_cache_max_tokens": FAKE_CACHE_CAP[1],
            },
        }

    def metrics_text(self) -> str:
        lines = []
        for name, value in self.counters.items():
            if name.startswith("spec_decode") and not self.spec:
                continue
            lines.append(f"# TYPE vllm:{name}_total counter")
            for pos, v in enumerate(value) if isinstance(value, list) else [(None, value)]:
                label = f'model_name="{self.model}"' + (f',position="{pos}"' if pos is not None else "")
                lines.append(f"vllm:{name}_total{{{label}}} {v}.0")
        lines.append(f'vllm:num_requests_running{{model_name="{self.model}"}} {self.running}.0')
        lines.append("# TYPE vllm:inter_token_latency_seconds histogram")  # every fake step takes FAKE_STEP_S
        for edge in (*FAKE_ITL_EDGES, "+Inf"):
            count = self.steps if edge == "+Inf" or float(edge) >= FAKE_STEP_S else 0
            lines.append(f'vllm:inter_token_latency_seconds_bucket{{le="{edge}",model_name="{self.model}"}} {count}.0')
        return "\n".join(lines) + "\n"


def _words(body: dict[str, Any], sampler: random.Random) -> list[str]:
    """One choice's words: greedy ones from the prompt alone (every choice the same), sampled ones from
    ``sampler`` (the server's seeded generator: a run draws the same samples whatever the requests' order)."""
    prompt = body.get("prompt", "")
    seed = hashlib.sha256(json.dumps(prompt).encode()).digest()
    greedy = not body.get("temperature", 1.0) or body.get("top_k") == 1 or body.get("top_p", 1.0) < GREEDY_TOP_P
    rng = random.Random(seed) if greedy else sampler
    out, text = [], ""
    # the first token is the prompt's, sampled or not (a near-certain one); so are all but the last of a completion
    # as short as the sampling check's (its prompts are picked so: near-certain up to the tested position)
    limit = int(body.get("max_tokens", 16))
    sure = random.Random(seed).choices(WORDS, k=limit - 1 if limit <= FAKE_SURE_UP_TO else 1)
    for i in range(limit):
        word = sure[i] if i < len(sure) else rng.choice(WORDS) if greedy else rng.choices(WORDS, FAKE_WEIGHTS)[0]
        out.append(word + " ")
        text += out[-1]
        if any(s and s in text for s in body.get("stop") or []):
            break
    return out


def _choice(words: list[str], index: int, body: dict[str, Any]) -> dict[str, Any]:
    done = "length" if len(words) == int(body.get("max_tokens", 16)) else "stop"
    logprobs = None
    ids = [WORDS.index(w[:-1]) for w in words]
    name = (lambda i: f"token_id:{i}") if body.get("return_tokens_as_token_ids") else (lambda i: WORDS[i] + " ")
    if body.get("logprobs") is not None:
        top = sorted(range(len(WORDS)), key=lambda i: -FAKE_WEIGHTS[i])[: int(body["logprobs"])]
        logprobs = {
            "tokens": [name(i) for i in ids],
            "token_logprobs": [math.log(FAKE_WEIGHTS[i]) for i in ids],
            "top_logprobs": [{name(i): math.log(FAKE_WEIGHTS[i]) for i in top} for _ in ids],
            "text_offset": list(range(len(words))),
        }
    out = {"index": index, "text": "".join(words), "finish_reason": done, "logprobs": logprobs}
    if body.get("return_token_ids"):
        out["token_ids"] = ids
    return out


class Handler(BaseHTTPRequestHandler):
    state: FakeState

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, payload: str, ctype: str = "application/json") -> None:
        data = payload.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.state.last_request = time.monotonic()
        if self.path == "/health":
            self._send(200, "")
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": self.state.model, "object": "model"}]}))
        elif self.path == "/metrics":
            self._send(200, self.state.metrics_text(), "text/plain")
        else:
            self._send(404, json.dumps({"error": f"no route {self.path}"}))

    def do_POST(self) -> None:
        self.state.last_request = time.monotonic()
        if self.path != "/v1/completions":
            self._send(404, json.dumps({"error": f"no route {self.path}"}))
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        with self.state.lock:  # one request's choices at a time from the server's generator
            choices = [_words(body, self.state.sampler) for _ in range(int(body.get("n", 1)))]
            self.state.running += 1
        # counted before answering, as a server counts its steps even for a client that goes away midway
        self.state.count(sum(map(len, choices)), drafted=sum(max(0, len(c) - 1) for c in choices))
        try:
            if body.get("stream"):
                self._stream(choices, body)
            else:
                out = [_choice(w, i, body) for i, w in enumerate(choices)]
                n_out = sum(map(len, choices))
                self._send(
                    200,
                    json.dumps(
                        {
                            "id": "cmpl-fake",
                            "object": "text_completion",
                            "model": self.state.model,
                            "choices": out,
                            "usage": {"prompt_tokens": 1, "completion_tokens": n_out, "total_tokens": 1 + n_out},
                        }
                    ),
                )
            with self.state.lock:
                self.state.counters["request_success"] += 1
        except (BrokenPipeError, ConnectionResetError):  # a client that cancelled midway
            pass
        finally:
            with self.state.lock:
                self.state.running -= 1

    def _stream(self, choices: list[list[str]], body: dict[str, Any]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, words in enumerate(choices):
            for j, w in enumerate(words):
                done = _choice(words, i, body)["finish_reason"] if j == len(words) - 1 else None
                chunk = {"index": i, "text": w, "finish_reason": done, "logprobs": None}
                event = {"id": "cmpl-fake", "object": "text_completion", "model": self.state.model, "choices": [chunk]}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="serve_fake serve")
    ap.add_argument("model")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--speculative-config", default="")
    args, _ = ap.parse_known_args(argv)
    spec = json.loads(args.speculative_config or "{}")
    cap = spec.get("drafter_options", {}).get("suffix", {}).get("max_cached_requests", FAKE_CACHE_CAP[0])
    faults = Faults.parse(os.environ.get(FAULTS_ENV, ""), timeout_ms=50.0) if spec else None
    Handler.state = FakeState(args.model, spec=bool(spec), cache_requests=cap, faults=faults)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    plugin = _plugin_endpoint(spec, Handler.state)

    parent = os.getppid()

    def watchdog() -> None:  # a server its driver left behind (the driver died) does not outlive it
        while time.monotonic() - Handler.state.last_request < IDLE_EXIT_S and os.getppid() == parent:
            time.sleep(0.5)
        server.shutdown()

    threading.Thread(target=watchdog, daemon=True).start()
    # stop on SIGINT as vLLM's server does, even when started from a shell that ignores it (a background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"fake server on {args.host}:{args.port}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    server.server_close()
    if plugin is not None:
        plugin.close()
    return 0


def _plugin_endpoint(spec: dict[str, Any], state: FakeState) -> Any:
    """The plugin's metrics endpoint where ``spec`` asks for it (as the proposer does: a busy port is reported, not
    fatal)."""
    from specdec.vllm_plugin.metrics.server import MetricsServer

    if spec.get("method") != "specdec" or not spec.get("metrics_port"):
        return None
    try:
        return MetricsServer(state.plugin_stats, host="127.0.0.1", port=int(spec["metrics_port"]))
    except OSError as exc:
        print(f"fake server: metrics not served ({exc})", flush=True)
        return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--fail-start":
        print("fake server: CUDA out of memory (simulated start-up failure)", flush=True)
        return 1
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    if argv[:2] == ["bench", "serve"]:
        return bench(argv[2:])
    print("usage: serve_fake {serve MODEL ... | bench serve ...}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
