"""Property tests (hypothesis, derandomized) of what users set: option dicts (the vLLM plugin's, every drafter's, the
library's) and ``specdec-eval`` flags, at the configuration stage only (no trace replayed, no model loaded).

Every generated input either runs or is refused in one line (``ConfigError`` / exit status 2), never a traceback, a
crash or a silent default: an accepted option keeps the value given (ints widened to floats where the key is a float),
an accepted flag is in the parsed arguments as typed."""

from __future__ import annotations

import json
import math

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specdec.config import ConfigError  # noqa: E402
from specdec.drafters import registry  # noqa: E402
from specdec.eval.cli import main  # noqa: E402

PROPS = settings(
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
NUMBERS = st.sampled_from([0, 1, -1, 2, 16, 2**31, 2**63, 10**400, 0.5, 2.7, -0.0, 1e-9]) | st.floats()
VALUES = (
    NUMBERS
    | st.booleans()
    | st.none()
    | st.sampled_from(["", "auto", "suffix", "x", "nan", "1"])
    | st.lists(st.sampled_from(["suffix", "ngram", 1, None]), max_size=3)
    | st.dictionaries(st.sampled_from(["suffix", "ngram", "name", "max_depth", 3]), NUMBERS | st.text(max_size=3))
)


def _good(cls: type, key: str) -> st.SearchStrategy:
    """Values a config field of ``cls`` accepts (its choices, its type within its range), to mix with bad ones."""
    import dataclasses
    import typing

    field = {f.name: f for f in dataclasses.fields(cls)}.get(key)
    if field is None:
        return st.nothing()
    meta, typ = field.metadata, typing.get_type_hints(cls)[key]
    lo, hi = meta.get("lo"), meta.get("hi")
    if meta.get("choices"):
        return st.sampled_from(meta["choices"])
    if typ is bool:
        return st.booleans()
    if typ is int:
        return st.integers(int(lo if lo is not None else -5), int(hi if hi is not None else 1000))
    if typ is float:
        return st.floats(lo if lo is not None else -5.0, hi if hi is not None else 1000.0, allow_nan=False)
    default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    return st.just(default)


def _options(cls: type, keys: list[str]) -> st.SearchStrategy[dict]:
    """Dicts over ``keys``: each value a good one for its field or any of ``VALUES``."""
    key = st.sampled_from(keys)
    return st.lists(key.flatmap(lambda k: st.tuples(st.just(k), _good(cls, k) | VALUES)), max_size=4).map(dict)


def _one_line(exc: BaseException) -> None:
    assert isinstance(exc, ConfigError), repr(exc)
    assert "\n" not in str(exc) and str(exc), str(exc)


def _same(given: object, kept: object) -> bool:
    """``kept`` is ``given`` as the config stores it (an int given for a float key is kept as that float)."""
    if isinstance(given, bool) or isinstance(kept, bool):
        return given is kept
    if isinstance(given, (int, float)) and isinstance(kept, (int, float)):
        return float(given) == float(kept) and (not math.isnan(float(given)))
    if isinstance(given, tuple):
        return list(given) == kept
    return given == kept


# ------------------------------------------------------------------------------------------- option dicts
def _vllm_keys() -> list[str]:
    from specdec.vllm_plugin.entry.options import USER_KEYS

    keys = sorted(USER_KEYS) + ["async", "draft-timeout-ms", "narrow_slots", "method"]
    return keys


def _vllm_options() -> st.SearchStrategy[dict]:
    from specdec.vllm_plugin.entry.options import SpecdecOptions

    return _options(SpecdecOptions, _vllm_keys())


@PROPS
@given(data=_vllm_options())
def test_vllm_option_dicts_run_or_are_refused_in_one_line(data) -> None:
    from specdec.vllm_plugin.entry.options import KEY_ALIASES, split_speculative_config
    from specdec.vllm_plugin.entry.validation import validate_for_serving

    spec = {**data, "method": "specdec"}
    try:
        theirs, options = split_speculative_config(spec)
        validate_for_serving(options)
    except ConfigError as exc:
        _one_line(exc)
        event("refused")
        return
    event("accepted")
    kept = options.to_dict()
    for key, value in data.items():
        name = KEY_ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        if name in kept and key != "method":
            assert _same(value, kept[name]), (key, value, kept[name])  # no silent default


@pytest.mark.parametrize("name", ["suffix", "ngram", "model", "toy"])
@PROPS
@given(data=st.data())
def test_drafter_option_dicts_run_or_are_refused_in_one_line(monkeypatch, name, data) -> None:
    import dataclasses

    monkeypatch.setitem(registry._CLASSES, "toy", "eval_toys:LookupDrafter")
    cls = registry.drafter_class(name).Config
    keys = [f.name for f in dataclasses.fields(cls)] + ["max_dept"]
    opts = data.draw(_options(cls, keys))
    try:
        cfg = cls.from_dict(opts, where=f"drafter {name!r}: ")
    except ConfigError as exc:
        _one_line(exc)
        event("refused")
        return
    event("accepted")
    for key, value in opts.items():
        assert _same(value, getattr(cfg, key)), (key, value, getattr(cfg, key))


def _generate_options() -> st.SearchStrategy[dict]:
    from specdec.generation import GenerateConfig

    return _options(GenerateConfig, ["budget", "temperature", "top_p", "top_k", "seed", "device", "eos_token_id"])


@PROPS
@given(data=_generate_options())
def test_generate_options_run_or_are_refused_in_one_line(data) -> None:
    from specdec.generation import GenerateConfig

    try:
        cfg = GenerateConfig.from_dict(data)
    except ConfigError as exc:
        _one_line(exc)
        event("refused")
        return
    event("accepted")
    for key, value in data.items():
        assert _same(value, getattr(cfg, key)), (key, value)


# ------------------------------------------------------------------------------------------- CLI flags
class Configured(Exception):  # noqa: N818 - a signal, not an error
    """The configuration stage ended: the run would now replay or load models."""

    def __init__(self, parsed: object) -> None:
        super().__init__()
        self.parsed = parsed


TEXT = st.sampled_from(["0", "1", "-1", "3", "16", "2.5", "nan", "inf", "-inf", "1e400", "abc", "", "8,16", "[4, 8]"])
GRID = st.sampled_from(["8,16", "true,false", "", "3", "abc", "[4, 8]", "nan", "2.5", "4,,8", "{a: 1, a: 2}"])
REPLAY_FLAGS = [
    ("--limit", TEXT),
    ("--batch-size", TEXT),
    ("--budget", TEXT),
    ("--verify-ms", TEXT),
    ("--verify-ms-per-token", TEXT),
    ("--verify-table", st.sampled_from(["1:5,9:5.2", "1:nan", "0:5", "1:5,1:6", "x", "9:5"])),
    ("--option", st.tuples(st.sampled_from(["toy.max_n", "toy.min_n", "toy.max_x", "tyo.max_n", "max_n"]), TEXT)),
    ("--grid", st.tuples(st.sampled_from(["budget", "tree", "toy.max_n", "bogus"]), GRID)),
    ("--tree", st.none()),
    ("--no-tree", st.none()),
    ("--format", st.sampled_from(["generic", "openhands", "nope"])),
]
LIVE_FLAGS = [
    ("--limit", TEXT),
    ("--offset", TEXT),
    ("--max-new-tokens", TEXT),
    ("--max-seconds", TEXT),
    ("--threads", TEXT),
    ("--device", st.sampled_from(["cpu", "cuda", "cuda:3", "tpu", "meta", "", "cpu:0"])),
    ("--budget", TEXT),
    ("--baselines", st.sampled_from(["", "hf-greedy", "hf-greedy,nope", "specdec-greedy"])),
    ("--tokenizer", st.sampled_from(["bytes", "gpt2", "/nowhere"])),
]


def _flags(table: list) -> st.SearchStrategy[list[str]]:
    def render(picks: list) -> list[str]:
        argv: list[str] = []
        for (flag, _), value in picks:
            if value is None:
                argv.append(flag)
            elif isinstance(value, tuple):  # --option / --grid KEY=VALUE
                argv.append(f"{flag}={value[0]}={value[1]}")
            else:
                argv.append(f"{flag}={value}")
        return argv

    one = st.sampled_from(table).flatmap(lambda fv: st.tuples(st.just(fv), fv[1]))
    return st.lists(one, max_size=4).map(render)


def _outcome(argv: list[str], capsys) -> object:
    """Runs ``main(argv)`` to the end of its configuration stage: the parsed arguments if it got there, else None
    after checking that it answered with exit status 2 and one line."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except Configured as done:
        event("configured")
        return done.parsed
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, (argv, rc, err)
    event("exit 2")
    assert len(err) == 1 and err[0].startswith("specdec-eval: error: "), (argv, err)
    return None


@pytest.fixture
def stop_at_configured(monkeypatch, tmp_path):
    monkeypatch.setitem(registry._CLASSES, "toy", "eval_toys:LookupDrafter")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDEC_DATA", raising=False)

    def stop(job, settings, args, *rest, **kw):
        raise Configured(args)

    monkeypatch.setattr("specdec.eval.run_replay._run_dataset", stop)
    monkeypatch.setattr("specdec.eval.live.Live", lambda args, tok: (_ for _ in ()).throw(Configured(args)))
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"prompt_ids": [1, 2, 3, 1, 2], "response_ids": [3, 1, 2, 3]}) + "\n")
    return trace


@PROPS
@given(flags=_flags(REPLAY_FLAGS), sweep=st.booleans())
def test_replay_and_sweep_flags_run_or_exit_2_in_one_line(stop_at_configured, tmp_path, capsys, flags, sweep) -> None:
    cmd = "sweep" if sweep else "replay"
    if not sweep:
        flags = [f for f in flags if not f.startswith("--grid")]
    argv = [cmd, str(stop_at_configured), "--drafter", "toy", *flags, "--out", str(tmp_path / "o"), "--no-progress"]
    args = _outcome(argv, capsys)
    if args is not None:
        for flag in flags:  # an accepted count is the one typed, never a default in its place
            if flag.startswith(("--limit=", "--batch-size=")):
                key, text = flag[2:].split("=", 1)
                assert getattr(args, key.replace("-", "_")) == int(text)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_eval_live import tiny_models

    return tiny_models(tmp_path_factory.mktemp("models"))


@PROPS
@given(flags=_flags(LIVE_FLAGS))
def test_live_flags_run_or_exit_2_in_one_line(stop_at_configured, tiny_pair, tmp_path, capsys, flags) -> None:
    paths = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1 w2"}) + "\n")
    argv = ["live", str(prompts), "--target", str(paths["target"]), "--draft-model", str(paths["draft"])]
    args = _outcome([*argv, "--drafter", "toy", *flags, "--out", str(tmp_path / "o"), "--no-progress"], capsys)
    if args is not None:
        for flag in flags:
            if flag.startswith(("--max-new-tokens=", "--offset=")):
                key, text = flag[2:].split("=", 1)
                assert getattr(args, key.replace("-", "_")) == int(text)
