"""Overlapped drafting (``"async": true``): the proposer's work runs in a helper process, off vLLM's critical path.

In vLLM 0.26's synchronous engine loop a step is: ``execute_model`` -> ``sample_tokens`` (which calls
``propose``) -> ``scheduler.update_from_output`` -> ``post_step``, whose ``take_draft_token_ids`` hands the
drafts to the scheduler. The GPU idles from the end of the step until the next launch, and a CPU drafter
running inside ``propose`` lengthens that gap by its full drafting time.

``OverlapCore`` moves the whole ``ProposerCore`` (bookkeeping, adaptive control, the drafter) into a helper
process. ``submit`` (called from ``propose``) sends the step's new tokens and returns at once; the helper
drafts *while* the engine thread runs the scheduler's output processing; ``collect`` (called from
``take_draft_token_ids``, via the runner patch) picks the drafts up. A separate process, not a thread:
drafting is mostly Python, and a thread would only take turns with the scheduler on the GIL.

What crosses the pipe per step: per row the request id, the sampled tokens and the context length; a row
whose context does not follow from what was sent before (a new request, a preemption) carries its full
context once. ``collect`` waits at most the drafting deadline; a late reply is dropped when it arrives
(sequence numbers), that step has no drafts and the miss is counted and logged once. If the helper dies,
drafting stops for good (generation goes on without speculation), counted and logged once.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, Sequence

import numpy as np

from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.options import SpecdecOptions

logger = logging.getLogger(LOGGER_NAME)

CHILD_MODULE = "specdec.vllm_plugin.overlap"
START_TIMEOUT_S = 60.0  # the helper imports specdec and builds the drafter (a draft model loads its weights)
STATS_TIMEOUT_S = 5.0
Row = tuple  # (request id, sampled tokens, context length, full context or None, prompt length)


class RowStore:
    """Stands in for vLLM's ``token_ids_cpu`` inside the helper: only rows that carried a context are read."""

    def __init__(self, contexts: dict[int, list[int]]) -> None:
        self.contexts = contexts

    def __getitem__(self, index: tuple[int, slice]) -> np.ndarray:
        row, cols = index
        return np.asarray(self.contexts[row], dtype=np.int64)[cols]


class OverlapCore:
    """Main-process side: submit a step, collect its drafts later (see the module docstring)."""

    def __init__(self, options: SpecdecOptions, *, max_model_len: int, target_params: float = 0.0,
                 target_tokenizer: str = "") -> None:
        self.options = options
        self.timeout_s = options.draft_timeout_ms / 1e3 if options.draft_timeout_ms > 0 else None
        self.known: dict[str, int] = {}  # request id -> context length the helper has seen
        self.seq = 0  # last submitted step
        self.pending: tuple[int, int] | None = None  # (seq, rows) submitted and not collected yet
        self.dead = False
        self.counters = {"steps": 0, "late": 0, "dropped_replies": 0, "wait_seconds": 0.0, "submit_seconds": 0.0,
                         "contexts_sent": 0}
        self._late_logged = False
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        config = {"options": options.to_dict(), "max_model_len": max_model_len, "target_params": target_params,
                  "target_tokenizer": target_tokenizer}
        self.proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE, str(child_r), str(child_w)],
                                     pass_fds=(child_r, child_w), close_fds=True)
        os.close(child_r)
        os.close(child_w)
        self.rx = Connection(parent_r, writable=False)
        self.tx = Connection(parent_w, readable=False)
        self.tx.send(config)
        if not self.rx.poll(START_TIMEOUT_S):
            self._die("the drafting helper did not start within %.0f s" % START_TIMEOUT_S)
            return
        hello = self.rx.recv()
        if not (isinstance(hello, tuple) and hello[0] == "ready"):
            self._die(f"the drafting helper failed to start: {hello!r}")

    # ----------------------------------------------------------------- the step
    def submit(self, req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]],
               num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray, *,
               num_prompt_tokens: np.ndarray | None = None, k: int | None = None) -> None:
        """Send one step (vLLM's arrays, see ``ProposerCore.step``); returns without waiting."""
        if self.dead:
            self.pending = (self.seq, len(sampled_token_ids))  # collect answers empty drafts
            return
        t0 = time.perf_counter()
        # propose ran again without take (no drafts were read): forget that step; its reply is dropped by its
        # sequence number when it arrives
        self.pending = None
        n_rows = len(sampled_token_ids)
        rows: list[Row] = []
        present = set()
        for i in range(n_rows):
            rid, sampled, n = req_ids[i], sampled_token_ids[i], int(num_tokens_no_spec[i])
            present.add(rid)
            if not sampled:
                rows.append((rid, [], n, None, 0))
                continue
            if self.known.get(rid, -1) + len(sampled) == n:
                rows.append((rid, list(sampled), n, None, 0))
            else:  # new or out of step: the helper restarts it from the full context
                prompt = int(num_prompt_tokens[i]) if num_prompt_tokens is not None else n - len(sampled)
                rows.append((rid, list(sampled), n, np.asarray(token_ids_cpu[i, :n]).tolist(), prompt))
                self.counters["contexts_sent"] += 1
            self.known[rid] = n
        for rid in [r for r in self.known if r not in present]:
            del self.known[rid]
        self.seq += 1
        try:
            self.tx.send(("step", self.seq, rows, k))
        except (OSError, EOFError, pickle.PicklingError) as exc:
            self._die(f"sending to the drafting helper failed: {exc!r}")
            self.pending = (self.seq, n_rows)
            return
        self.pending = (self.seq, n_rows)
        self.counters["steps"] += 1
        self.counters["submit_seconds"] += time.perf_counter() - t0

    def collect(self) -> list[list[int]] | None:
        """The drafts of the last submitted step ([] rows past the deadline); None if nothing is pending."""
        if self.pending is None:
            return None
        seq, n_rows = self.pending
        self.pending = None
        if self.dead:
            return [[] for _ in range(n_rows)]
        t0 = time.perf_counter()
        deadline = None if self.timeout_s is None else t0 + self.timeout_s
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.perf_counter())
                if not self.rx.poll(left):
                    self._on_late()
                    return [[] for _ in range(n_rows)]
                kind, got, payload = self.rx.recv()
                if kind == "error":
                    self._die(f"the drafting helper failed: {payload}")
                    return [[] for _ in range(n_rows)]
                if kind == "reset":  # the helper lost its request state: send full contexts again
                    self.known.clear()
                if got == seq:
                    return payload if kind == "drafts" else [[] for _ in range(n_rows)]
                self.counters["dropped_replies"] += 1  # a late reply of an earlier step
        except (OSError, EOFError) as exc:
            self._die(f"the drafting helper is gone: {exc!r}")
            return [[] for _ in range(n_rows)]
        finally:
            self.counters["wait_seconds"] += time.perf_counter() - t0

    # ----------------------------------------------------------------- failure paths
    def _on_late(self) -> None:
        self.counters["late"] += 1
        if not self._late_logged:
            self._late_logged = True
            logger.warning("specdec: overlapped drafting missed draft_timeout_ms=%.1f; that step goes on without "
                           "drafts (counted as late; not logged again)", self.options.draft_timeout_ms)

    def _die(self, why: str) -> None:
        if not self.dead:
            logger.warning("specdec: %s; drafting is off from now on, generation continues without speculation",
                           why)
        self.dead = True
        self.known.clear()

    # ----------------------------------------------------------------- reporting, shutdown
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters, dead=self.dead, mode="overlap")
        if self.dead or self.pending is not None:
            return out
        try:
            self.tx.send(("stats", 0, None, None))
            deadline = time.perf_counter() + STATS_TIMEOUT_S
            while self.rx.poll(max(0.0, deadline - time.perf_counter())):
                kind, _seq, payload = self.rx.recv()
                if kind == "stats":
                    out.update(payload)
                    break
        except (OSError, EOFError):
            pass
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.tx.send(("close", 0, None, None))
                self.proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - best effort
                self.proc.kill()
        self.dead = True


# --------------------------------------------------------------------------- the helper process
def _child(rx: Connection, tx: Connection) -> None:
    from specdec.vllm_plugin.core import ProposerCore
    from specdec.vllm_plugin.proposer import build_proposer_drafter

    config = rx.recv()
    try:
        # the engine enforces the deadline (collect); here drafting runs inline, without a worker thread
        options = SpecdecOptions.from_dict({**config["options"], "async_drafting": False, "draft_timeout_ms": 0})
        drafter = build_proposer_drafter(options, target_tokenizer=config["target_tokenizer"])
        core = ProposerCore(drafter, options, max_model_len=config["max_model_len"],
                            target_params=config["target_params"])
    except Exception as exc:  # noqa: BLE001 - reported to the engine, which drafts nothing
        tx.send(("error", repr(exc)))
        return
    tx.send(("ready", os.getpid()))
    while True:
        try:
            kind, seq, rows, k = rx.recv()
        except EOFError:
            return
        if kind == "close":
            core.close()
            return
        if kind == "stats":
            tx.send(("stats", seq, core.stats_dict()))
            continue
        try:
            tx.send(("drafts", seq, _child_step(core, rows, k)))
        except Exception as exc:  # noqa: BLE001 - ProposerCore absorbs drafter errors; this is a bookkeeping bug
            core.reset()
            tx.send(("reset", seq, None))
            logger.warning("specdec helper: step failed (%r); every request restarts from its context", exc)


def _child_step(core: Any, rows: list[Row], k: int | None) -> list[list[int]]:
    req_ids = [r[0] for r in rows]
    sampled = [r[1] for r in rows]
    n = np.fromiter((r[2] for r in rows), dtype=np.int64, count=len(rows))
    prompts = np.fromiter((r[4] for r in rows), dtype=np.int64, count=len(rows))
    contexts = {i: r[3] for i, r in enumerate(rows) if r[3] is not None}
    for i in contexts:  # a row that carried its context must restart, whatever the helper knew before
        core.force_resync(req_ids[i])
    return core.step(req_ids, sampled, n, RowStore(contexts), num_prompt_tokens=prompts, k=k)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    rx = Connection(int(args[0]), writable=False)
    tx = Connection(int(args[1]), readable=False)
    _child(rx, tx)


if __name__ == "__main__":
    main()
