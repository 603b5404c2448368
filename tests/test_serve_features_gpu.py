"""Feature parity of `vllm serve` with specdec vs without, through the `openai` client (GPU, vLLM 0.26).

Each test runs one benchmarks.serve_features feature against module-scoped servers (no speculation, and specdec in
each mode with a small KV cache for preemption; float32, the shared 53M target) and requires identical greedy outputs
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


def _args(out_dir: str) -> argparse.Namespace:
    from specdec.paths import TARGET_MODEL, model_path

    return argparse.Namespace(
        model=str(model_path(TARGET_MODEL)),
        spec={"method": "specdec"},
        features=list(sf.FEATURES),
        server_args=os.environ.get("SPECDEC_SERVE_ARGS", "").split(),
        health_timeout_s=600.0,
        vllm_cli="",
        out_dir=out_dir,
    )


def _stop(stack: list[Server]) -> None:
    codes = {srv.log.stem: srv.stop() for srv in stack}
    assert all(c is not None for c in codes.values()), codes  # every server stopped on SIGINT


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[argparse.Namespace, Server]]:
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    if not PROMPTS.exists():
        pytest.skip(f"{PROMPTS} missing: run `python -m benchmarks.serve_bench prepare` and carry device_inputs/")
    args = _args(str(os.environ.get("OUT", tmp_path_factory.mktemp("serve"))))
    stack: list[Server] = []
    try:
        yield args, sf.start_server(args, stack, "ref", None, [])
    finally:
        _stop(stack)


@pytest.fixture(scope="module", params=sf.MODES)
def ctx(request: pytest.FixtureRequest, ref: tuple[argparse.Namespace, Server]) -> Iterator[sf.Ctx]:
    args, ref_server = ref
    spec = {**args.spec, "async_mode": request.param}
    stack: list[Server] = []
    try:
        servers = {"ref": ref_server, "spec": sf.start_server(args, stack, f"spec-{request.param}", spec, sf.SMALL_KV)}
        yield sf.make_ctx(args, servers, sf.load_prompts(PROMPTS), mode=request.param)
    finally:
        _stop(stack)


@pytest.mark.parametrize("feature", [f for f in sf.FEATURES if f != "sampling"])
def test_feature_matches_no_speculation_with_its_own_drafts(ctx: sf.Ctx, feature: str) -> None:
    out = sf.run_feature(ctx, feature)
    if feature != "max_tokens_1":  # one token from prefill: no step to draft for
        assert out["spec"]["accepted_tokens"] > 0, out  # the feature's own requests had drafts accepted
    assert out["ok"], out


def test_sampling_keeps_the_target_distribution_where_drafts_are_accepted(ctx: sf.Ctx) -> None:
    out = sf.run_feature(ctx, "sampling")
    for r in out["per_prompt"]:
        assert min(r["samples"]) >= sf.SAMPLES
        assert r["accepted_share"] >= 0.3, r  # drafts accepted at the tested position
        assert r["p"] > sf.P_MIN and r["p_control"] > sf.P_MIN, r  # spec's samples fit the target's distribution
        assert r["p_biased"] <= sf.P_MIN and r["power"] >= 0.99, r  # the test can tell a 3% bias
    assert out["ok"], out
