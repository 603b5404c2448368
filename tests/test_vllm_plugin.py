"""CPU tests of the plugin's config rewrite and option validation (vLLM-free), plus the real vLLM hooks when
vLLM is importable (scripts/test.sh runs them against each vLLM in src/specdec/vllm_plugin/versions.py)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from patch_support import patch, wrap_unchecked
from specdec.config import ConfigError
from specdec.vllm_plugin.attrs import WRAPPED
from specdec.vllm_plugin.entry import register as plugin
from specdec.vllm_plugin.entry import rewrite
from specdec.vllm_plugin.entry.options import (
    ADDITIONAL_CONFIG_KEY,
    PROPOSER_PATH,
    SpecdecOptions,
    options_from_vllm_config,
    split_speculative_config,
)
from specdec.vllm_plugin.patches.features import Feature
from specdec.vllm_plugin.patches.table import TABLE, PatchReport

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_split_rewrites_to_custom_class_and_keeps_our_options():
    theirs, opts = split_speculative_config(
        {
            "method": "specdec",
            "drafter": ["suffix", "model"],
            "num_speculative_tokens": 12,
            "draft-timeout-ms": 7,
            "async": True,
        }
    )
    assert theirs == {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": 12}
    assert opts.drafter == ["suffix", "model"] and opts.draft_timeout_ms == 7.0 and opts.async_drafting
    assert opts.num_speculative_tokens == 12


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"draft_timeout": 5}, "'draft_timeout'"),
        ({"draft_timeout_ms": -1}, "draft_timeout_ms=-1"),
        ({"num_speculative_tokens": 500}, "num_speculative_tokens=500"),
        ({"draft_slots": "some"}, "draft_slots='some'"),
        ({"deadline_mode": "thread"}, "'deadline_mode'"),  # an internal setting, not a user option
        ({"model": "meta/llama"}, "draft_model"),
        ({"drafter": 3}, "drafter=3"),
    ],
)
def test_bad_options_name_the_key_and_the_fix(bad, needle):
    with pytest.raises(ConfigError) as err:
        split_speculative_config({"method": "specdec", **bad})
    assert needle in str(err.value)
    if "draft_timeout" in bad:
        assert "valid keys" in str(err.value) and "draft_timeout_ms" in str(err.value)


def test_rewrite_engine_args_in_place_and_leaves_other_methods_alone():
    ea = SimpleNamespace(
        speculative_config={"method": "specdec", "drafter": "ngram", "num_speculative_tokens": 4},
        additional_config=None,
    )
    assert rewrite.rewrite_engine_args(ea)
    assert ea.speculative_config["method"] == "custom_class"
    assert ea.additional_config[ADDITIONAL_CONFIG_KEY]["drafter"] == "ngram"
    # what the proposer reads back inside vLLM
    cfg = SimpleNamespace(
        additional_config=ea.additional_config, speculative_config=SimpleNamespace(num_speculative_tokens=4)
    )
    assert options_from_vllm_config(cfg).drafter == "ngram"
    other = SimpleNamespace(speculative_config={"method": "ngram", "num_speculative_tokens": 3}, additional_config=None)
    assert not rewrite.rewrite_engine_args(other)
    assert other.speculative_config["method"] == "ngram" and other.additional_config is None
    clash = SimpleNamespace(
        speculative_config={"method": "specdec"}, additional_config={"specdec": {"drafter": "model"}}
    )
    with pytest.raises(ConfigError, match="one place only"):
        rewrite.rewrite_engine_args(clash)


def test_pipeline_parallelism_is_served_without_speculation_and_said_once(plugin_log):
    """vLLM reads its drafter on every pipeline stage but builds it on the last one only: PP > 1 starts plainly."""
    pp2 = SimpleNamespace(
        speculative_config={"method": "specdec", "num_speculative_tokens": 8},
        additional_config=None,
        pipeline_parallel_size=2,
    )
    assert not rewrite.rewrite_engine_args(pp2)
    assert pp2.speculative_config is None and pp2.additional_config is None
    warned = [r.getMessage() for r in plugin_log() if "pipeline_parallel_size=2" in r.getMessage()]
    assert len(warned) == 1 and "without speculation" in warned[0]
    bad = SimpleNamespace(speculative_config={"method": "specdec", "drafter": "sufix"}, pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="sufix"):  # bad input is still refused first
        rewrite.rewrite_engine_args(bad)
    one = SimpleNamespace(speculative_config={"method": "specdec"}, additional_config=None, pipeline_parallel_size=1)
    assert rewrite.rewrite_engine_args(one) and one.speculative_config["method"] == "custom_class"


def _args(**kw):
    base = dict(
        speculative_config={"method": "specdec", "num_speculative_tokens": 16},
        additional_config=None,
        enforce_eager=False,
        max_num_seqs=64,
        max_cudagraph_capture_size=None,
        cudagraph_capture_sizes=None,
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=None, cudagraph_capture_sizes=None),
    )
    return SimpleNamespace(**{**base, **kw})


def test_rewrite_raises_the_cudagraph_capture_limit_unless_the_user_set_one():
    ea = _args()
    rewrite.rewrite_engine_args(ea)
    assert ea.max_cudagraph_capture_size == 64 * 17  # batch 64 x (k + 1) verify tokens stay in graphs
    big = _args(max_num_seqs=None)  # vLLM's default (256-1024): batches of at most 64 requests x 17 in graphs
    rewrite.rewrite_engine_args(big)
    assert big.max_cudagraph_capture_size == rewrite.AUTO_CUDAGRAPH_MAX_REQUESTS * 17 == 1088
    wide = _args(max_num_seqs=1024, speculative_config={"method": "specdec", "num_speculative_tokens": 64})
    rewrite.rewrite_engine_args(wide)  # 64 x 65 tokens: capped
    assert wide.max_cudagraph_capture_size == rewrite.AUTO_CUDAGRAPH_MAX_TOKENS
    small = _args(max_num_seqs=8)  # 8 x 17 = 136: vLLM's default (512) already covers it
    rewrite.rewrite_engine_args(small)
    assert small.max_cudagraph_capture_size is None
    for user in (
        _args(max_cudagraph_capture_size=256),
        _args(enforce_eager=True),
        _args(compilation_config={"cudagraph_capture_sizes": [1, 2, 4]}),
        _args(speculative_config={"method": "specdec", "cudagraph_max_tokens": 0}),
    ):
        before = user.max_cudagraph_capture_size
        rewrite.rewrite_engine_args(user)
        assert user.max_cudagraph_capture_size == before
    fixed = _args(speculative_config={"method": "specdec", "cudagraph_max_tokens": 4096})
    rewrite.rewrite_engine_args(fixed)
    assert fixed.max_cudagraph_capture_size == 4096


def test_rewrite_replaces_full_cudagraph_mode_which_breaks_verification():
    as_dict = _args(compilation_config={"cudagraph_mode": "FULL"})
    rewrite.rewrite_engine_args(as_dict)
    assert as_dict.compilation_config["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    for mode in (None, "PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "NONE"):
        kept = _args(compilation_config={"cudagraph_mode": mode})
        rewrite.rewrite_engine_args(kept)
        assert kept.compilation_config["cudagraph_mode"] == mode


def test_the_method_row_is_idempotent_and_rewrites_before_the_original():
    seen = []

    class FakeEngineArgs:
        def __init__(self, spec):
            self.speculative_config, self.additional_config = spec, {}

        def create_speculative_config(self, target_model_config, target_parallel_config):
            seen.append(dict(self.speculative_config))
            return "built"

    assert patch(FakeEngineArgs, Feature.METHOD).on(Feature.METHOD)
    first = FakeEngineArgs.create_speculative_config
    assert patch(FakeEngineArgs, Feature.METHOD).on(Feature.METHOD)
    assert FakeEngineArgs.create_speculative_config is first  # not wrapped twice
    ea = FakeEngineArgs({"method": "specdec", "drafter": "suffix", "num_speculative_tokens": 8})
    assert ea.create_speculative_config(None, None) == "built"
    assert seen == [{"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": 8}]
    assert ea.additional_config["specdec"]["drafter"] == "suffix"


def test_runner_patch_binds_the_input_batch_before_propose():
    from specdec.vllm_plugin.proposer import SpecdecProposer

    class FakeRunner:
        def __init__(self, drafter):
            self.drafter, self.input_batch = drafter, SimpleNamespace(req_ids=["r1"])

        def propose_draft_token_ids(self, scheduler_output, sampled, *rest):
            return self.drafter._input_batch

    cfg = SimpleNamespace(
        additional_config={"specdec": {"draft_timeout_ms": 0}},
        speculative_config=SimpleNamespace(num_speculative_tokens=2),
        model_config=SimpleNamespace(max_model_len=32),
    )
    from test_vllm_proposer import OracleDrafter

    prop = SpecdecProposer(cfg, drafter=OracleDrafter(), patch_runner=False)
    assert patch(FakeRunner, Feature.REQUEST_IDS).on(Feature.REQUEST_IDS)
    first = FakeRunner.propose_draft_token_ids
    assert patch(FakeRunner, Feature.REQUEST_IDS).on(Feature.REQUEST_IDS)
    assert FakeRunner.propose_draft_token_ids is first  # not wrapped twice
    runner = FakeRunner(prop)
    assert runner.propose_draft_token_ids(SimpleNamespace(), [[1]]).req_ids == ["r1"]

    class OddRunner:
        def propose_draft_token_ids(self, sampled):
            return None

    assert not patch(OddRunner, Feature.REQUEST_IDS).on(Feature.REQUEST_IDS)  # unexpected signature: left alone
    assert "propose_draft_token_ids" in vars(OddRunner) and not hasattr(OddRunner.propose_draft_token_ids, WRAPPED)


def test_thread_mode_defers_drafts_to_take_draft_token_ids():
    """propose() submits to the drafter's thread and returns placeholders; take_draft_token_ids() swaps the drafts
    in."""
    import numpy as np

    from specdec.vllm_plugin.proposer import SpecdecProposer

    class FakeRunner:
        def __init__(self, drafter):
            self.drafter, self._draft_token_ids = drafter, None
            self.input_batch = SimpleNamespace(req_ids=["r1"], num_prompt_tokens=np.array([8]))

        def propose_draft_token_ids(self, scheduler_output, sampled, *rest):
            toks = np.zeros((1, 64), np.int32)
            toks[0, :9] = [1, 2, 3, 1, 2, 3, 1, 2, 3]
            self._draft_token_ids = self.drafter.propose(sampled, np.array([9]), toks)
            return self._draft_token_ids

        def _get_draft_token_ids_cpu(self):
            return self._draft_token_ids, self.input_batch.req_ids

        def take_draft_token_ids(self):
            return self._get_draft_token_ids_cpu()

    cfg = SimpleNamespace(
        additional_config={
            "specdec": {"async": True, "async_mode": "thread", "adaptive": False, "draft_timeout_ms": 0}
        },
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
        model_config=SimpleNamespace(max_model_len=64),
    )
    prop = SpecdecProposer(
        cfg,
        patch_runner=False,
        patches=PatchReport("test", {r.name: "" for r in TABLE if r.feature is Feature.THREAD_HAND_OFF}),
    )
    assert prop.threaded and prop.patches.on(Feature.THREAD_HAND_OFF)
    assert wrap_unchecked(FakeRunner, Feature.REQUEST_IDS, Feature.THREAD_HAND_OFF) == 2  # (no execute_model here)
    runner = FakeRunner(prop)
    try:
        assert runner.propose_draft_token_ids(SimpleNamespace(), [[3]]) == [[]]  # placeholder
        drafts, req_ids = runner.take_draft_token_ids()
        assert req_ids == ["r1"] and drafts == [[1, 2, 3]]  # the suffix drafter's continuation of 1 2 3 ...
        assert prop.stats()["steps"] == 1
    finally:
        prop.close()


def test_options_defaults_are_valid_and_described():
    opts = SpecdecOptions.from_dict({})
    assert opts.num_speculative_tokens == 16 and opts.draft_timeout_ms > 0 and opts.adaptive
    assert "draft_timeout_ms" in SpecdecOptions.describe()


# ----------------------------------------------------------------------------- real vLLM (CPU import only)
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm not importable (scripts/test.sh has vLLM)")


@needs_vllm
def test_real_engine_args_rewrite_builds_a_custom_class_speculative_config():
    from vllm.engine.arg_utils import EngineArgs

    plugin.register()
    plugin.register()  # idempotent
    assert getattr(EngineArgs.create_speculative_config, "_specdec_wrapped", False)
    ea = EngineArgs(
        model="unused",
        speculative_config={
            "method": "specdec",
            "drafter": "suffix",
            "num_speculative_tokens": 6,
            "draft_timeout_ms": 9,
        },
    )
    rewrite.rewrite_engine_args(ea)
    assert ea.speculative_config["model"] == PROPOSER_PATH
    assert ea.additional_config["specdec"]["draft_timeout_ms"] == 9.0
    from vllm.config import CUDAGraphMode

    assert ea.compilation_config.cudagraph_mode is None  # vLLM's default stays
    full = EngineArgs(
        model="unused", speculative_config={"method": "specdec"}, compilation_config={"cudagraph_mode": "FULL"}
    )
    rewrite.rewrite_engine_args(full)
    assert full.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    from vllm.config import SpeculativeConfig

    fields = getattr(SpeculativeConfig, "__dataclass_fields__", {})
    assert set(ea.speculative_config) <= set(fields)  # only keys vLLM accepts go through


@needs_vllm
def test_real_custom_class_hook_and_runner_signature():
    import inspect

    from vllm.v1.spec_decode import custom_class_proposer  # noqa: F401 - the hook we rely on exists
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    params = list(inspect.signature(GPUModelRunner.propose_draft_token_ids).parameters)
    assert params[:2] == ["self", "scheduler_output"]
    # thread mode collects in take_draft_token_ids; custom_class drafts are kept as a list there
    assert list(inspect.signature(GPUModelRunner.take_draft_token_ids).parameters) == ["self"]
    src = inspect.getsource(GPUModelRunner._get_draft_token_ids_cpu)
    assert "isinstance(self._draft_token_ids, list)" in src
    # thread mode stops and starts requests as a step begins executing
    assert list(inspect.signature(GPUModelRunner.execute_model).parameters)[:2] == ["self", "scheduler_output"]
    from dataclasses import fields

    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    assert {"scheduled_new_reqs", "finished_req_ids"} <= {f.name for f in fields(SchedulerOutput)}
    assert {"req_id", "prompt_token_ids"} <= {f.name for f in fields(NewRequestData)}


@needs_vllm
def test_real_create_speculative_config_through_the_entry_point():
    from specdec.paths import TARGET_MODEL, model_path

    path = model_path(TARGET_MODEL)
    if not (path / "config.json").exists():
        pytest.skip(f"shared model not at {path}")
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # our entry point (pyproject: vllm.general_plugins) wraps EngineArgs
    mc = ModelConfig(model=str(path), max_model_len=2048)
    ea = EngineArgs(
        model=str(path),
        speculative_config={"method": "specdec", "drafter": "suffix", "num_speculative_tokens": 8, "async": True},
    )
    sc = ea.create_speculative_config(mc, ParallelConfig())
    assert (sc.method, sc.model, sc.num_speculative_tokens) == ("custom_class", PROPOSER_PATH, 8)
    assert ea.additional_config["specdec"]["async_drafting"] is True
    bad = EngineArgs(model=str(path), speculative_config={"method": "specdec", "drafter_timeout": 3})
    with pytest.raises(ConfigError, match="drafter_timeout"):
        bad.create_speculative_config(mc, ParallelConfig())


def test_yaml_presets_turn_into_valid_speculative_config_json():
    import json

    from specdec.vllm_plugin.entry.options import preset_json

    for name in ("vllm_specdec", "vllm_specdec_hybrid"):
        data = json.loads(preset_json(name))
        theirs, opts = split_speculative_config(data)
        assert theirs["model"] == PROPOSER_PATH and opts.num_speculative_tokens == 16
