"""Feature parity of `vllm serve` with specdec vs without, through the `openai` client (GPU, vLLM 0.26).

Each test runs one benchmarks.serve_features feature against module-scoped servers (no speculation, specdec, and
specdec with a small KV cache for preemption; float32, the shared 53M target) and requires identical greedy outputs
and tokens accepted during it. ``SPECDEC_SERVE_ARGS`` adds `vllm serve` arguments to every server (e.g.
"--enforce-eager" to start faster). Needs device_inputs/serve_prompts.json (`serve_bench prepare`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import serve_features as sf
from benchmarks.serve_common import Server

pytestmark = pytest.mark.gpu
PROMPTS = Path("device_inputs/serve_prompts.json")


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sf.Ctx]:
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    if not PROMPTS.exists():
        pytest.skip(f"{PROMPTS} missing: run `python -m benchmarks.serve_bench prepare` and carry device_inputs/")
    from specdec.paths import TARGET_MODEL, model_path

    args = argparse.Namespace(
        model=str(model_path(TARGET_MODEL)),
        spec={"method": "specdec"},
        features=list(sf.FEATURES),
        server_args=os.environ.get("SPECDEC_SERVE_ARGS", "").split(),
        health_timeout_s=600.0,
        vllm_cli="",
        out_dir=str(os.environ.get("OUT", tmp_path_factory.mktemp("serve"))),
    )
    stack: list[Server] = []
    try:
        servers = sf.start_servers(args, stack)
        yield sf.make_ctx(args, servers, sf.load_prompts(PROMPTS))
    finally:
        codes = {srv.log.stem: srv.stop() for srv in stack}
        assert all(c is not None for c in codes.values()), codes  # every server stopped on SIGINT


@pytest.mark.parametrize("feature", [f for f in sf.FEATURES if f != "sampling"])
def test_feature_matches_no_speculation_while_drafting(ctx: sf.Ctx, feature: str) -> None:
    out = sf.run_feature(ctx, feature)
    assert out["spec"]["accepted_tokens"] > 0, out  # drafts were verified and accepted during the feature
    assert out["ok"], out


def test_sampling_first_tokens_match_by_chi_square(ctx: sf.Ctx) -> None:
    out = sf.run_feature(ctx, "sampling")
    for r in out["per_prompt"]:
        assert min(r["samples"]) >= sf.SAMPLES
        assert r["p"] > sf.P_MIN, r  # spec's samples: the same distribution as no speculation's
        assert r["p_biased"] <= sf.P_MIN, r  # the test can tell: a biased sampler fails it
    assert out["spec"]["accepted_tokens"] > 0 and out["ok"], out
