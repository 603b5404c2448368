"""Property tests (hypothesis) of what users feed specdec: trace files of random bytes, truncated and malformed
records; every drafter's lifecycle in random orders with unknown and repeated request ids and extreme token ids.

No crash and no traceback: a loader answers with a TraceError (one line naming the file) or records; a drafter
answers a lifecycle call on an unknown request with KeyError (extend) or nothing (stop, draft), never another
exception. Model-free drafters never draft a token that is neither in the request's context nor in tokens they
were fed; the draft model never drafts an id outside its vocabulary. Examples are few (CI runs on 2 cores)."""

from __future__ import annotations

import gzip
import io
import json
import tarfile

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specdec.drafters.base import DraftRequest  # noqa: E402
from specdec.eval.loaders import TraceError, load_traces  # noqa: E402

EXAMPLES = 30
PROPS = settings(
    deadline=None,
    max_examples=EXAMPLES,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".tar.gz")


# ------------------------------------------------------------------------------------------- loaders
def _load(path) -> None:
    try:
        _, records = load_traces(str(path), tokenizer="bytes", use_cache=False)
    except TraceError as exc:
        msg = str(exc)
        assert "\n" not in msg and str(path) in msg, msg
    else:
        assert records and all(r.response_ids.ndim == 1 for r in records)


@PROPS
@given(data=st.binary(max_size=400), suffix=st.sampled_from(SUFFIXES))
def test_random_bytes_never_crash_a_loader(tmp_path_factory, data, suffix) -> None:
    f = tmp_path_factory.mktemp("rb") / f"t{suffix}"
    f.write_bytes(data)
    _load(f)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=12,
)
KEYS = st.sampled_from(
    [
        "prompt",
        "response",
        "prompt_ids",
        "response_ids",
        "id",
        "group",
        "instruction",
        "output",
        "input",
        "question_id",
        "choices",
        "question",
        "175b_finetuning",
    ]
)
RECORDS = st.dictionaries(KEYS, JSON_VALUES | st.lists(st.integers(-5, 2**40), max_size=6), max_size=5)


@PROPS
@given(rows=st.lists(RECORDS, min_size=1, max_size=4), cut=st.integers(0, 400), gz=st.booleans())
def test_malformed_and_truncated_jsonl_records(tmp_path_factory, rows, cut, gz) -> None:
    d = tmp_path_factory.mktemp("js")
    text = "".join(json.dumps(r) + "\n" for r in rows)
    raw = text.encode()[: max(cut, 1)] if cut < len(text) else text.encode()
    f = d / ("t.jsonl.gz" if gz else "t.jsonl")
    f.write_bytes(gzip.compress(raw) if gz else raw)
    (d / "question.jsonl").write_text(json.dumps({"question_id": 1, "turns": ["q"]}) + "\n")
    _load(f)


@PROPS
@given(rows=st.lists(RECORDS, min_size=1, max_size=4))
def test_malformed_json_list_records(tmp_path_factory, rows) -> None:
    f = tmp_path_factory.mktemp("jl") / "t.json"
    f.write_text(json.dumps([{"instruction": "i", "output": "o"}] + rows))
    _load(f)


@PROPS
@given(members=st.lists(JSON_VALUES | RECORDS, min_size=1, max_size=3), cut=st.integers(0, 2000))
def test_malformed_openhands_tarballs(tmp_path_factory, members, cut) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for i, m in enumerate(members):
            data = json.dumps(m).encode()
            info = tarfile.TarInfo(f"run/llm_completions/inst{i % 2}/call{i}.json")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    f = tmp_path_factory.mktemp("oh") / "agent.tar.gz"
    f.write_bytes(raw[:cut] if cut < len(raw) else raw)
    _load(f)


# ------------------------------------------------------------------------------------------- drafters
VOCAB = 97  # the tiny draft model's vocabulary (tests/core_support.SAVED_VOCAB)
IDS = st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, 2**31 - 1, 2**31, 2**32 + 5, 2**40]) | st.integers(0, 12)
OPS = st.lists(
    st.tuples(
        st.sampled_from(["start", "extend", "draft", "stop"]),
        st.sampled_from("abc"),
        st.lists(IDS, max_size=6),
        st.integers(0, 9),
        st.booleans(),
    ),
    min_size=1,
    max_size=25,
)


def _model_free(name: str):
    from specdec.drafters.ngram import NgramDrafter
    from specdec.drafters.suffix import SuffixDrafter, native_available

    if name == "ngram":
        return NgramDrafter()
    if name == "suffix-native" and not native_available():
        pytest.skip("native suffix core not built")
    return SuffixDrafter(backend="native" if name == "suffix-native" else "python", max_depth=8)


def _run_ops(d, ops, *, vocab_cap: int | None = None) -> set[int]:
    """Applies the operations; returns every token the drafter was fed. Asserts the lifecycle contract."""
    ctx: dict[str, list[int]] = {}
    fed: set[int] = set()
    for op, rid, ids, budget, tree in ops:
        ids = [t % vocab_cap for t in ids] if vocab_cap else ids
        if op == "start":
            d.start(rid, ids)
            ctx[rid] = list(ids)
            fed.update(ids)
        elif op == "extend":
            if rid in ctx:
                d.extend(rid, ids)
                ctx[rid] += ids
                fed.update(ids)
            else:
                with pytest.raises(KeyError):
                    d.extend(rid, ids)
        elif op == "stop":
            d.stop(rid)
            ctx.pop(rid, None)
        elif rid in ctx:
            (t,) = d.draft_batch([DraftRequest(rid, budget, tree)])
            assert len(t) <= budget and (tree or t.is_chain())
            yield_check = set(t.tokens.tolist())
            assert yield_check <= fed, (yield_check - fed, rid)
            if vocab_cap:
                assert all(0 <= x < vocab_cap for x in yield_check)
    for rid in list(ctx):
        d.stop(rid)
    assert not d.active_requests()
    return fed


@pytest.mark.parametrize("name", ["suffix-python", "suffix-native", "ngram"])
@PROPS
@given(ops=OPS)
def test_model_free_lifecycle(name, ops) -> None:
    d = _model_free(name)
    try:
        _run_ops(d, ops)
    finally:
        d.close()


@PROPS
@given(ops=OPS)
def test_both_suffix_engines_draft_alike(ops) -> None:
    from specdec.drafters.suffix import SuffixDrafter, native_available

    if not native_available():
        pytest.skip("native suffix core not built")
    drafters = [SuffixDrafter(backend=b, max_depth=8) for b in ("python", "native")]
    live: set[str] = set()
    for op, rid, ids, budget, tree in ops:
        if op == "start":
            live.add(rid)
        elif op == "stop":
            live.discard(rid)
        if op == "extend" and rid not in live:
            continue
        outs = []
        for d in drafters:
            if op == "draft":
                outs.append(d.draft(rid, budget, tree=tree).tokens.tolist() if rid in live else None)
            else:
                getattr(d, op)(rid, *([ids] if op != "stop" else []))
        assert not outs or outs[0] == outs[1], (op, outs)


@pytest.fixture(scope="module")
def model_drafter(tmp_path_factory):
    pytest.importorskip("transformers")
    from core_support import SAVED_VOCAB, save_tiny_llama
    from specdec.drafters.model import ModelDrafter, ModelDrafterConfig

    assert SAVED_VOCAB == VOCAB
    path = save_tiny_llama(tmp_path_factory.mktemp("m") / "draft", seed=5, max_pos=64)
    d = ModelDrafter(ModelDrafterConfig(path=str(path), backend="eager", num_threads=1))
    yield d
    d.close()


@settings(deadline=None, max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_model_drafter_lifecycle_stays_in_its_vocabulary(model_drafter, ops) -> None:
    d = model_drafter
    ctx: dict[str, list[int]] = {}
    for op, rid, ids, budget, tree in ops:
        if op in ("start", "extend") and any(t >= VOCAB for t in ids) and (op == "start" or rid in ctx):
            with pytest.raises(ValueError, match="outside the draft model's vocabulary"):
                getattr(d, op)(rid, ids)  # an id the model has no embedding for: refused, state unchanged
            ids = [t % VOCAB for t in ids]
        if op == "start":
            d.start(rid, ids)
            ctx[rid] = ids
        elif op == "extend":
            if rid in ctx:
                d.extend(rid, ids)
            else:
                with pytest.raises(KeyError):
                    d.extend(rid, ids)
        elif op == "stop":
            d.stop(rid)
            ctx.pop(rid, None)
        elif rid in ctx:
            (t,) = d.draft_batch([DraftRequest(rid, budget, tree)])
            assert len(t) <= budget and all(0 <= x < VOCAB for x in t.tokens.tolist())
    for rid in list(ctx):
        d.stop(rid)
    assert not d.active_requests()
