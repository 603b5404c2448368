"""The classes of bad input of issue 43, each fed exactly: non-finite numbers, unchecked choices and sizes, vLLM option
shapes and conflicts, what the library used to guess, silent last-wins, prompts past the target's positions, live's
tokenizer. Each answers in one line naming the key, the value and the fix (exit status 2 / ``ConfigError``) before
any long work, or runs. The table of answers is docs/bad-input.md."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import signal

import numpy as np
import pytest

from bad_input_support import fails, trace_file
from specdec.config import ConfigError
from specdec.drafters import registry
from specdec.drafters.suffix import SuffixDrafter, native_available
from specdec.eval.cli import main

pytestmark = pytest.mark.usefixtures("toys")  # the toy drafter and a fresh trace cache, every test

BACKENDS = ["python"] + (["native"] if native_available() else [])
NAN, INF = float("nan"), float("inf")


def replay_args(tmp_path: pathlib.Path, *flags: str, cmd: str = "replay") -> list[str]:
    return [cmd, str(trace_file(tmp_path)), "--drafter", "toy", *flags, "--out", str(tmp_path / "o")]


# ------------------------------------------------------------------------------------------- 1. non-finite numbers
@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--verify-ms", "nan"], "--verify-ms nan is not a finite number"),
        (["--verify-ms", "inf"], "--verify-ms inf is not a finite number"),
        (["--verify-ms-per-token=-inf"], "--verify-ms-per-token -inf is not a finite number"),
        (["--verify-table", "1:5,9:nan"], "--verify-table ms=nan is not a finite number"),
        (["--verify-table", "1:5,1:6"], "--verify-table gives n=1 twice"),
        (["--verify-ms", "0"], "--verify-ms 0.0 is out of range: must be in (0.0, 60000.0]"),
        (["--option", "toy.max_n=.nan"], "max_n=nan has the wrong type: expected int"),
    ],
)
def test_non_finite_numbers_on_the_command_line(tmp_path, capsys, no_replay, flags, needle) -> None:
    assert needle in fails(replay_args(tmp_path, *flags), capsys)


@pytest.mark.parametrize("key", ["max_spec_factor", "min_token_prob", "leaf_prior", "max_spec_offset"])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_non_finite_drafter_options_refused_on_both_backends(key, value) -> None:
    for backend in BACKENDS:
        with pytest.raises(ConfigError, match=f"{key}={value!r} is not a finite number: must be in"):
            SuffixDrafter(backend=backend, **{key: value})


@pytest.mark.parametrize("key, value", [("temperature", NAN), ("top_p", INF), ("temperature", -INF)])
def test_non_finite_sampling_is_refused_before_any_forward(key, value) -> None:
    from core_support import tiny_llama
    from specdec.generation import SpecGenerator
    from specdec.sampling import SamplingParams

    with pytest.raises(ConfigError, match=f"{key}={value!r} is not a finite number"):
        SpecGenerator(tiny_llama(), None, **{key: value})
    with pytest.raises(ConfigError, match=f"{key}={value!r}"):
        SamplingParams(**{key: value})


# ------------------------------------------------------------------------------------------- 2. choices and sizes
@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--device", "tpu"], "--device tpu is not a torch device; this torch"),
        (["--threads", "100000"], "--threads 100000 is more than this machine runs"),
        (["--threads", "257"], "--threads 257 is more than this machine runs"),
        (["--max-seconds", "nan"], "--max-seconds nan is not a finite number"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0 is out of range"),
        (["--baselines", "hf-greed"], "--baselines: unknown peer 'hf-greed'"),
        (["--limit", "1.5"], "argument --limit: invalid int value: '1.5'"),
    ],
)
def test_live_choices_and_sizes_checked_before_any_model(tmp_path, capsys, flags, needle) -> None:
    from test_eval_live import tiny_models

    paths = tiny_models(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1 w2"}) + "\n")
    base = ["live", str(prompts), "--target", str(paths["target"]), "--draft-model", str(paths["draft"])]
    assert needle in fails([*base, *flags, "--out", str(tmp_path / "o")], capsys)


def test_cuda_on_a_cpu_only_torch_is_refused(capsys, tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    line = fails(["live", "humaneval", "--device", "cuda", "--out", str(tmp_path / "o")], capsys)
    assert "--device cuda: no cuda device on this machine" in line and "offers: cpu" in line


def test_threads_above_the_cpus_warn_once_and_far_above_stop(caplog) -> None:
    from specdec.drafters.cpu_info import OVERSUBSCRIBE, check_threads, usable_cpus

    cpus = usable_cpus()
    with caplog.at_level(logging.WARNING, logger="specdec.drafters.model"):
        assert check_threads(cpus + 1, key="--threads") == cpus + 1
    assert sum("more than the" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ConfigError, match=f"num_threads={OVERSUBSCRIBE * cpus + 1} is more than this machine runs"):
        from specdec.drafters.model import ModelDrafterConfig

        ModelDrafterConfig(num_threads=OVERSUBSCRIBE * cpus + 1)


def test_a_library_device_this_torch_lacks_is_refused() -> None:
    from core_support import tiny_llama
    from specdec.generation import SpecGenerator

    with pytest.raises(ConfigError, match="device='tpu' is not a torch device"):
        SpecGenerator(tiny_llama(), None, device="tpu")


# ------------------------------------------------------------------------------------------- 3. vLLM options
@pytest.mark.parametrize(
    "spec, needle",
    [
        ({"drafter_options": "suffix"}, "drafter_options='suffix' has the wrong type: expected dict"),
        ({"drafter_options": ["suffix"]}, "drafter_options=['suffix'] has the wrong type"),
        ({"drafter_options": {"suffix": 5}}, "drafter_options['suffix']=5 must be a dict of that drafter's options"),
        ({"drafter": []}, "drafter=[] names no drafter"),
        ({"drafter": [{"max_depth": 3}]}, "holds {'max_depth': 3}"),
        ({"async": False, "async_drafting": True}, "'async' and 'async_drafting' both set async_drafting"),
        ({"draft_timeout_ms": NAN}, "draft_timeout_ms=nan is not a finite number"),
        ({"log_every_s": NAN}, "log_every_s=nan is not a finite number"),
        ({"drafter_options": {"suffix": {"max_spec_factor": NAN}}}, "max_spec_factor=nan is not a finite number"),
    ],
)
def test_vllm_options_checked_at_configuration_time(spec, needle) -> None:
    from specdec.vllm_plugin.entry.options import split_speculative_config
    from specdec.vllm_plugin.entry.validation import validate_for_serving

    with pytest.raises(ConfigError) as err:
        _, options = split_speculative_config({"method": "specdec", **spec})
        validate_for_serving(options)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


# ------------------------------------------------------------------------------------------- 4. the library guesses
@pytest.mark.parametrize(
    "prompts, kw, error, needle",
    [
        (b"def f():", {}, TypeError, "prompts is bytes (b'def f():'...), not text or token ids"),
        ([b"def f():"], {}, TypeError, "prompts[0] is bytes"),
        ([5.7, 3], {}, TypeError, "prompts[0][0]=5.7 is not a token id"),
        ([[3, 4.0]], {}, TypeError, "prompts[0][1]=4.0 is not a token id"),
        (np.array([3.0, 4.0]), {}, TypeError, "prompts[0][0]=3.0 is not a token id"),
        ([[3, -1]], {}, ValueError, "prompts[0][1]=-1 is a negative token id"),
        ([3, 4], {"max_new_tokens": 10.5}, ConfigError, "max_new_tokens=10.5 has the wrong type: expected int"),
        ([3, 4], {"eos_token_id": -1}, ConfigError, "eos_token_id=-1 is out of range: must be in [0, 95]"),
        ([3, 4], {"budget": 2.7}, ConfigError, "budget=2.7 has the wrong type: expected int in [0, 1024]"),
    ],
)
def test_the_library_refuses_what_it_would_guess(prompts, kw, error, needle) -> None:
    import specdec
    from core_support import tiny_llama

    with pytest.raises(error) as err:
        specdec.generate(tiny_llama(), prompts, max_new_tokens=kw.pop("max_new_tokens", 4), **kw)
    assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "call, error",
    [
        (lambda d: d.draft("r", 2.7), ConfigError),
        (lambda d: d.draft("r", True), ConfigError),
        (lambda d: d.draft("r", "3"), ConfigError),
        (lambda d: d.draft("r", -1), ConfigError),
        (lambda d: d.start("x", [5.7, 3]), TypeError),
        (lambda d: d.start("x", [True, 2]), TypeError),
        (lambda d: d.start("x", b"abc"), TypeError),
        (lambda d: d.start("x", "abc"), TypeError),
        (lambda d: d.start("x", np.array([1.0, 2.0])), ValueError),
        (lambda d: d.extend("r", [1, 2.5]), TypeError),
        (lambda d: d.start("x", [1, -2]), ValueError),
        (lambda d: d.start("x", [2**64]), ValueError),
    ],
)
def test_both_suffix_backends_refuse_the_same_inputs(backend, call, error) -> None:
    """The native and the Python engine of the suffix drafter refuse (and accept) exactly the same inputs."""
    d = SuffixDrafter(backend=backend)
    d.start("r", [1, 2, 3, 1, 2])
    with pytest.raises(error):
        call(d)
    assert d.active_requests() == ["r"] and d.draft("r", np.int64(3)).tokens.tolist() == [3, 1, 2]


@pytest.mark.parametrize("name", ["ngram", "toy"])
def test_other_drafters_refuse_fractional_budgets_and_float_ids(name) -> None:
    d = registry.build_drafter(name)
    d.start("r", [1, 2, 3, 1, 2])
    with pytest.raises(ConfigError, match="budget=2.7 has the wrong type"):
        d.draft("r", 2.7)
    if name == "ngram":
        with pytest.raises(TypeError, match="got 5.7"):
            d.start("x", [5.7, 3])


# ------------------------------------------------------------------------------------------- 5. silent last-wins
@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--grid", "budget=8,16", "--grid", "budget=4"], "--grid budget is given twice"),
        (["--grid", "budget=8", "--budget", "16"], "--grid budget=8 and --budget 16 both set budget"),
        (["--grid", "tree=true", "--no-tree"], "--grid tree=true and --no-tree both set tree"),
        (["--grid", "toy.max_n=3,4", "--option", "toy.max_n=2"], "both set toy.max_n"),
        (["--budget", "8", "--budget", "16"], "--budget is given twice"),
        (["--option", "toy.max_n=3", "--option", "toy.max_n=4"], "--option toy.max_n is given twice"),
        (["--limit", "1", "--limit", "2"], "--limit is given twice"),
        (["--option", "toy.max_n={a: 1, a: 2}"], "key 'a' is given twice"),
    ],
)
def test_silent_last_wins_is_refused(tmp_path, capsys, no_replay, flags, needle) -> None:
    assert needle in fails(replay_args(tmp_path, *flags, cmd="sweep"), capsys)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("budget: 8\ntree: false\nbudget: 16\n", "key 'budget' is given twice (lines 1 and 3)"),
        ("budget: 8\ngrid: {budget: [4, 16]}\n", "budget is set by both 'budget' and 'grid'; keep one"),
        ("options: {toy: {max_n: 3}}\ngrid: {toy.max_n: [2, 4]}\n", "toy.max_n is set by both"),
        ("grid: [budget, 8]\n", "grid=['budget', 8] must be a mapping"),
        ("budget: .nan\n", "budget=nan must be an integer or a list of them"),
    ],
)
def test_presets_refuse_duplicate_and_conflicting_keys(tmp_path, capsys, no_replay, text, needle) -> None:
    preset = tmp_path / "p.yaml"
    preset.write_text(text)
    assert needle in fails(
        ["sweep", str(trace_file(tmp_path)), "--config", str(preset), "--out", str(tmp_path / "o")], capsys
    )


def test_a_flag_overrides_what_the_preset_sweeps(tmp_path) -> None:
    from specdec.eval.settings import build_settings

    preset = tmp_path / "p.yaml"
    preset.write_text("drafters: [toy]\ngrid: {budget: [4, 8]}\n")
    got = build_settings(drafters=None, budgets=[16], tree=None, preset=str(preset))
    assert [s.budget for s in got] == [16]


# ------------------------------------------------------------------------------------------- 6. prompt lengths
def test_a_prompt_past_the_positions_is_refused_or_truncated() -> None:
    import specdec
    from core_support import tiny_llama

    model = tiny_llama()  # 512 positions
    with pytest.raises(ConfigError) as err:
        specdec.generate(model, [3] * 600, max_new_tokens=4)
    msg = str(err.value)
    assert "prompts[0] has 600 tokens" in msg and "the target's 512" in msg and "truncate_prompts=True" in msg
    long = [3 + i % 50 for i in range(600)]
    cut = specdec.generate(model, long, max_new_tokens=4, truncate_prompts=True)
    assert cut.tokens == specdec.generate(model, long[-508:], max_new_tokens=4).tokens


def test_live_refuses_a_prompt_past_the_positions_and_truncates_on_request(tmp_path, capsys) -> None:
    from test_eval_live import WORDS, tiny_models

    paths = tiny_models(tmp_path)  # 256 positions
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": " ".join(WORDS * 5)}) + "\n")
    base = ["live", str(prompts), "--target", str(paths["target"]), "--draft-model", str(paths["draft"])]
    base += ["--max-new-tokens", "8", "--baselines", "hf-greedy", "--drafter", "toy", "--no-plots", "--threads", "1"]
    line = fails([*base, "--out", str(tmp_path / "o")], capsys)
    assert "prompt 0 of set 'long' has 30" in line and "target's 256" in line and "--truncate-prompts" in line
    assert main([*base, "--truncate-prompts", "--out", str(tmp_path / "ok"), "--no-progress"]) == 0
    doc = json.loads((tmp_path / "ok" / "results.json").read_text())
    assert doc["results"][0]["per_prompt"][0]["prompt_tokens"] == 256 - 8


# ------------------------------------------------------------------------------------------- 7. live's tokenizer
@pytest.mark.parametrize("tokenizer", ["/no/such/folder", "gpt2", "bytes"])
def test_live_tokenizer_must_be_a_local_folder(tmp_path, capsys, tokenizer) -> None:
    line = fails(["live", "humaneval", "--tokenizer", tokenizer, "--out", str(tmp_path / "o")], capsys)
    assert f"--tokenizer {tokenizer}: no such folder" in line


# ------------------------------------------------------------------------------------------- SIGTERM
def test_sigterm_leaves_no_staging_folder(tmp_path, capsys, monkeypatch) -> None:
    from eval_toys import LookupDrafter

    class Stopping(LookupDrafter):
        def draft_batch(self, requests):
            os.kill(os.getpid(), signal.SIGTERM)
            return super().draft_batch(requests)

    monkeypatch.setattr(registry, "build_drafter", lambda spec, options=None: Stopping())
    before = signal.getsignal(signal.SIGTERM)
    assert main(replay_args(tmp_path, "--no-progress")) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM; nothing written" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not [p for p in tmp_path.iterdir() if ".staging-" in p.name]
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back
