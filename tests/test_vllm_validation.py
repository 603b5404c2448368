"""Configuration-time errors (``specdec.vllm_plugin.entry.validation``, run by the speculative-config rewrite before
vLLM loads any weight): one message naming the key, the value and the fix."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
from types import SimpleNamespace

import pytest

from specdec.config import ConfigError
from specdec.vllm_plugin.entry.options import USER_KEYS, split_speculative_config
from specdec.vllm_plugin.entry.rewrite import rewrite_engine_args


def tokenizer_folder(path, vocab: dict[str, int]):
    """A model folder holding only a tokenizer.json (a word-level tokenizer over ``vocab``)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    path.mkdir()
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    return path


def engine_args(served: str = "", **spec):
    return SimpleNamespace(
        speculative_config={"method": "specdec", **spec},
        additional_config=None,
        model=served,
        tokenizer=None,
        compilation_config=None,
        enforce_eager=True,
    )


VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "def": 3, "return": 4}


@pytest.mark.parametrize(
    "spec, needles",
    [
        ({"drafter": "sufix"}, ["drafter='sufix'", "suffix"]),
        ({"drafter": ["suffix", {"name": "ngrm"}]}, ["drafter='ngrm'"]),
        ({"drafter_options": {"suffix": {"max_depht": 3}}}, ["max_depht", "suffix"]),
        ({"drafter_options": {"model": {"num_threads": 2}}}, ["drafter_options", "'model'"]),
        ({"num_speculative_tokens": 0}, ["num_speculative_tokens=0"]),
        ({"draft_timeout_ms": -5}, ["draft_timeout_ms=-5"]),
        ({"async_mode": "overlap"}, ["async_mode='overlap'"]),
        ({"narrow_slots": 6}, ["'narrow_slots'", "valid keys", "narrow_graphs"]),
    ],
)
def test_bad_options_stop_the_rewrite_with_the_key_and_the_fix(spec, needles):
    with pytest.raises(ConfigError) as err:
        rewrite_engine_args(engine_args(**spec))
    assert all(n in str(err.value) for n in needles), str(err.value)
    assert "\n" not in str(err.value)


def test_a_missing_draft_model_folder_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="draft_model=.*nowhere.*is not a folder"):
        rewrite_engine_args(engine_args(drafter="model", draft_model=str(tmp_path / "nowhere")))
    with pytest.raises(ConfigError, match="drafter 'model' needs \"draft_model\""):
        rewrite_engine_args(engine_args(drafter=["suffix", "model"]))
    with pytest.raises(ConfigError, match="draft_model=.* is set but drafter='suffix'"):
        rewrite_engine_args(engine_args(draft_model=str(tmp_path)))


def test_a_draft_model_with_another_tokenizer_is_refused_before_any_weight(tmp_path):
    served = tokenizer_folder(tmp_path / "served", VOCAB)
    same = tokenizer_folder(tmp_path / "same", dict(VOCAB))
    other = tokenizer_folder(tmp_path / "other", {**VOCAB, "def": 4, "return": 3})  # same size, ids swapped
    ea = engine_args(str(served), drafter=["suffix", "model"], draft_model=str(same))
    assert rewrite_engine_args(ea) and ea.additional_config["specdec"]["draft_model"] == str(same)
    with pytest.raises(ConfigError, match="different tokenizers") as err:
        rewrite_engine_args(engine_args(str(served), drafter=["suffix", "model"], draft_model=str(other)))
    assert f"draft_model={str(other)!r}" in str(err.value) and "'def'" in str(err.value)


def test_user_options_are_few_and_internal_settings_are_not_among_them():
    assert len(USER_KEYS) <= 20
    for internal in ("deadline_mode", "native_step", "thread_spin_us", "matrix_step", "min_path_prob"):
        with pytest.raises(ConfigError, match=f"'{internal}'"):
            split_speculative_config({"method": "specdec", internal: 1})


def test_metrics_options_travel_to_the_proposer_and_bad_ones_stop_the_start():
    from specdec.vllm_plugin.entry.options import options_from_vllm_config

    ea = engine_args(metrics_port=9464, metrics_host="0.0.0.0")
    assert rewrite_engine_args(ea)
    ours = ea.additional_config["specdec"]
    assert (ours["metrics_port"], ours["metrics_host"]) == (9464, "0.0.0.0")
    cfg = SimpleNamespace(additional_config=ea.additional_config, speculative_config=None)
    opts = options_from_vllm_config(cfg)
    assert (opts.metrics_port, opts.metrics_host) == (9464, "0.0.0.0")
    with pytest.raises(ConfigError, match="metrics_port=-1 is out of range"):
        rewrite_engine_args(engine_args(metrics_port=-1))


# ----------------------------------------------------------------------------- shapes, conflicts, non-finite numbers
@pytest.mark.parametrize(
    "spec, needles",
    [
        ({"drafter": []}, ["drafter=[] names no drafter"]),
        ({"drafter": ""}, ["drafter=''"]),
        ({"drafter": ["suffix", []]}, ["holds []"]),
        ({"drafter": {"max_depth": 3}}, ["drafter={'max_depth': 3}", "'name'"]),
        ({"drafter": 5}, ["drafter=5"]),
        ({"drafter_options": "suffix"}, ["drafter_options='suffix' has the wrong type"]),
        ({"drafter_options": ["suffix"]}, ["drafter_options=['suffix'] has the wrong type"]),
        ({"drafter_options": {"suffix": 5}}, ["drafter_options['suffix']=5 must be a dict"]),
        ({"async": False, "async_drafting": True}, ["'async' and 'async_drafting' both set async_drafting"]),
        ({"draft-model": "/a", "draft_model": "/b"}, ["'draft-model' and 'draft_model'"]),
        ({"draft_timeout_ms": float("nan")}, ["draft_timeout_ms=nan is not a finite number"]),
        ({"log_every_s": float("inf")}, ["log_every_s=inf is not a finite number"]),
        ({"num_speculative_tokens": 4.0}, ["num_speculative_tokens=4.0 has the wrong type"]),
        ({"drafter_options": {"suffix": {"max_spec_factor": float("nan")}}}, ["max_spec_factor=nan"]),
        ({"drafter": ["suffix", "suffix"]}, ["drafter: 'suffix' is listed twice", "list each drafter once"]),
        ({"drafter": ["suffix", {"name": "suffix", "max_depth": 32}]}, ["'suffix' is listed twice"]),
    ],
)
def test_shapes_conflicts_and_non_finite_numbers_stop_the_rewrite(spec, needles):
    with pytest.raises(ConfigError) as err:
        rewrite_engine_args(engine_args(**spec))
    assert all(n in str(err.value) for n in needles), str(err.value)
    assert "\n" not in str(err.value)


def test_the_speculative_json_check_refuses_a_key_given_twice():
    from specdec.vllm_plugin.entry.rewrite import check_speculative_json

    text = '{"method": "specdec", "drafter": "suffix", "drafter": "ngram"}'
    with pytest.raises(ConfigError, match="key 'drafter' is given twice"):
        check_speculative_json(text, {"method": "specdec", "drafter": "ngram"})
    check_speculative_json('{"method": "ngram", "k": 1, "k": 2}', {"method": "ngram", "k": 2})  # not ours


SERVE_CASES = [
    ('{"method": "specdec", "drafter": []}', "drafter=[] names no drafter"),
    ('{"method": "specdec", "drafter_options": {"suffix": 5}}', "drafter_options['suffix']=5"),
    ('{"method": "specdec", "async": false, "async_drafting": true}', "'async' and 'async_drafting'"),
    ('{"method": "specdec", "draft_timeout_ms": NaN}', "draft_timeout_ms=nan"),
    ('{"method": "specdec", "drafter": "suffix", "drafter": "ngram"}', "key 'drafter' is given twice"),
    ('{"method": "specdec", "drafter": "sufix"}', "drafter='sufix' is unknown"),
]


def _serve_parser(monkeypatch):
    """vLLM's own ``vllm serve`` parser (with the plugin loaded, as vLLM loads it before building the parser), on
    vLLM's CPU platform (this machine has no GPU for vLLM to infer)."""
    from vllm import platforms
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(platforms, "current_platform", CpuPlatform(), raising=False)
    handlers = list(logging.getLogger().handlers)  # a package vLLM 0.26's serve module imports sets their levels to
    levels = [h.level for h in handlers]  # ERROR, pytest's log capture among them: put them back
    import vllm.entrypoints.cli.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for handler, level in zip(handlers, levels):
        handler.setLevel(level)

    top = FlexibleArgumentParser(prog="vllm")
    serve.cmd_init()[0].subparser_init(top.add_subparsers(dest="subparser"))
    return top


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has vLLM)")
@pytest.mark.parametrize("text, needle", SERVE_CASES)
def test_vllm_serve_parser_answers_bad_options_in_one_line(monkeypatch, text, needle):
    parser = _serve_parser(monkeypatch)
    stderr = io.StringIO()  # not capsys: vLLM's log handlers would keep its stream after the test closed it
    with pytest.raises(SystemExit) as stop, contextlib.redirect_stderr(stderr):
        parser.parse_args(["serve", "m", "--speculative-config", text])
    err = [line for line in stderr.getvalue().splitlines() if line.strip()]
    assert stop.value.code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("vllm serve: error: argument --speculative-config") and needle in err[-1], err
    assert len(err) == 2 and err[0].startswith("usage: vllm serve")  # argparse's usage line, then the one error line
    good = parser.parse_args(["serve", "m", "--speculative-config", '{"method": "specdec", "drafter": "ngram"}'])
    assert good.speculative_config["drafter"] == "ngram"
