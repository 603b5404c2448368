"""Golden drafts: what the plugin's drafting core hands vLLM, recorded once and compared on every later commit.

A re-layout of ``specdec/vllm_plugin`` must not change behaviour. This test drives the proposer's core on each of
its step paths (the Python engine, the native lane, schedule mode's token-matrix step) over a fake engine whose
rows move every step (new requests, partial prefills, finished and aborted ones, a context jump, a forced resync),
with the options that change what is drafted (adaptive on and off, padding, lane threads) and on low-acceptance
text (the back-off withholding drafts), and compares a digest of every step's drafts and the core's counters with
``tests/golden/drafts.json``. After a deliberate change of behaviour, rewrite the file with
``SPECDEC_UPDATE_GOLDEN=1 python -m pytest tests/test_golden_drafts.py`` and say why in the commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import pytest

from specdec.drafters.suffix import native_available
from test_vllm_lane import STAT_KEYS, FakeEngine, through_the_matrix, twins

pytestmark = pytest.mark.skipif(not native_available(), reason="native suffix core not built")

GOLDEN = Path(__file__).parent / "golden" / "drafts.json"
UPDATE_ENV = "SPECDEC_UPDATE_GOLDEN"
STEPS = 160
LOW_VOCAB = (20, 32)  # low-acceptance text: random tokens over a few ids (the drafter keeps finding wrong matches)
CONFIGS = {
    "default": {},
    "pad-on": {"pad_drafts": "on"},
    "adaptive-off": {"adaptive": False, "min_path_prob": 0.3},
    "lane-threads-3": {"lane_threads": 3, "min_path_prob": 0.2},
}
BACKOFF_KEYS = ("backoff_requests_backed_off", "backoff_withheld_tokens", "backoff_shadow_checks")


class LowEngine(FakeEngine):
    """Every request decodes random tokens over a few ids: drafts are mostly rejected, requests back off."""

    def add(self) -> None:
        super().add()
        r = self.reqs[f"r{self.next_id - 1}"]
        rng = random.Random(self.next_id)
        r["target"] = [rng.randrange(*LOW_VOCAB) for _ in range(len(r["target"]))]
        r["seq"] = r["target"][: r["prompt"]]


def run(engine_cls: type[FakeEngine], opts: dict) -> dict[str, dict]:
    """Each path's digest of its drafts per step and its counters."""
    eng = engine_cls(seed=4)
    python, lane = twins(eng.clock, **opts)
    matrix = twins(eng.clock, **opts)[1]
    through_the_matrix(matrix)
    cores = {"python": python, "lane": lane, "matrix": matrix}
    digests = {name: hashlib.sha256() for name in cores}
    drafts: dict[str, list[int]] = {}
    for step in range(STEPS):
        eng.churn(step)
        if step == 50:  # a context jump (preemption + recompute)
            rid = next(iter(eng.reqs))
            eng.reqs[rid]["seq"] += eng.reqs[rid]["target"][len(eng.reqs[rid]["seq"]) :][:5]
        if step == 90:
            for core in cores.values():
                core.force_resync(next(iter(eng.reqs)))
        drafts = eng.step(list(cores.values()), drafts)  # asserts every path drafted the same
        for d in digests.values():
            d.update(json.dumps(sorted(drafts.items())).encode())
    out = {}
    for name, core in cores.items():
        stats = core.stats_dict()
        counters = {k: stats[k] for k in (*STAT_KEYS, *BACKOFF_KEYS)}
        out[name] = {"drafts": digests[name].hexdigest()[:16], "counters": counters}
    return out


def recorded() -> dict[str, dict]:
    return {
        **{name: run(FakeEngine, opts) for name, opts in CONFIGS.items()},
        "low-acceptance": run(LowEngine, {}),
    }


def test_drafts_match_the_golden_file():
    now = recorded()
    assert now["low-acceptance"]["lane"]["counters"]["backoff_withheld_tokens"] > 0  # the back-off is covered
    assert now["default"]["lane"]["counters"]["accepted_tokens"] > 50
    if os.environ.get(UPDATE_ENV):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    for config, paths in golden.items():
        for path, want in paths.items():
            assert now[config][path] == want, f"{config} / {path}: drafts or counters changed (see the docstring)"
