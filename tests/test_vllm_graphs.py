"""FULL CUDA graphs for narrow verify batches (``specdec.vllm_plugin.patches.graphs``) and the narrow slot schedule.

The dispatcher tests run vLLM's own ``CudagraphDispatcher`` (every tested vLLM on the CPU in CI; skipped where vLLM is
not importable) with our wrappers; the runner wrapper runs on a fake runner whose dispatch and capture record what
vLLM's would do; the slot book and the drafting's padding need no vLLM."""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from patch_support import wrap_unchecked
from specdec.drafters.suffix import SuffixDrafter
from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.core.proposer_core import ProposerCore
from specdec.vllm_plugin.entry.options import SpecdecOptions
from specdec.vllm_plugin.internal import InternalSettings
from specdec.vllm_plugin.modes.schedule import ScheduledDrafting
from specdec.vllm_plugin.modes.slots import PLACEHOLDER, SlotBook, narrow_widths
from specdec.vllm_plugin.patches import graphs, ragged_keys
from specdec.vllm_plugin.patches.features import Feature
from specdec.vllm_plugin.patches.graph_stats import dispatcher_stats, graph_stats_of
from specdec.vllm_plugin.patches.ragged_keys import PREFILL_TAG
from specdec.vllm_plugin.patches.table import DISPATCHER, RUNNER

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm not importable (scripts/test.sh has vLLM)")
K = 16  # vLLM's uniform graphs: 17 tokens per request
WIDTH = 6  # narrow graphs: 7 tokens per request
CAPTURE_SIZES = [17 * r for r in (1, 2, 4, 8, 16, 24, 32, 48, 64)]
RAGGED_SIZES = CAPTURE_SIZES[:7]  # below vLLM's second-largest FULL key (17 x 48): the profile ceiling
PREFILL = 256  # ragged_prefill_tokens  # vLLM's sizes rounded to multiples of 1 + k


# ----------------------------------------------------------------- options and the slot book
def test_narrow_widths_are_off_where_they_cannot_apply() -> None:
    assert narrow_widths(SpecdecOptions()) == (4, 6, 8)
    assert narrow_widths(SpecdecOptions(narrow_graphs=False)) == ()
    assert narrow_widths(SpecdecOptions(num_speculative_tokens=6)) == (4,)  # not narrower than k
    assert narrow_widths(SpecdecOptions(draft_slots="uniform")) == ()  # vLLM's k slots for every request
    book = SlotBook.policy(K)
    assert (book.narrow, book.high_width, book.large_width, book.narrow_rows) == (6, 8, 4, (16, 48))
    off = SlotBook.policy(K, narrow=False)
    assert (off.narrow, off.high_width, off.large_width) == (0, 0, 0) and off.growth == 1.0


def test_slot_book_narrow_schedules_give_every_request_the_width() -> None:
    book = SlotBook(K, growth=1.0, narrow=WIDTH, narrow_rows=(16, 48))
    book.note(["a", "b"], [2, 12])  # forecasts: 4 and 16 (growth 1)
    book.begin_schedule(running=8)  # below 16: per-request slots
    assert (book.width, book.slots("a", K), book.slots("b", K)) == (0, 4, 16)
    book.begin_schedule(running=32)  # narrow: the width for every request, whatever its draft
    assert (book.width, book.slots("a", K), book.slots("b", K), book.slots("new", K)) == (WIDTH, WIDTH, WIDTH, WIDTH)
    assert book.slots("a", 3) == 3  # never more than vLLM reserved
    book.begin_schedule(running=48)  # from 48: per-request slots again
    assert (book.width, book.slots("a", K)) == (0, 4)
    assert book.as_dict()["narrow_steps"] == 1
    assert SlotBook(K, narrow=K, narrow_rows=(16, 48)).narrow == 0  # a width of k is vLLM's own graphs: off


def test_large_batches_are_narrow_only_while_drafts_are_seldom_accepted() -> None:
    """From narrow_below requests on, the large-batch width applies while the tokens per request per step (an
    EMA of the notes' ``emitted``) stay at most the MAT limit; rows still prefilling (0 tokens) do not count."""
    book = SlotBook(K, narrow=WIDTH, narrow_rows=(16, 48), large=(4, 3.0))
    book.begin_schedule(running=64)
    assert book.width == 0  # no MAT measured yet: per-request slots
    book.note(["a", "b", "p"], [3, 3, -1], emitted=[2, 2, 0])  # MAT 2 (the prefilling row ignored)
    book.begin_schedule(running=64)
    assert (book.width, book.slots("a", K)) == (4, 4)
    book.begin_schedule(running=32)
    assert book.width == WIDTH  # mid-size batches keep their own width
    for _ in range(20):  # drafts now accepted often: the average climbs past 3
        book.note(["a", "b"], [12, 12], emitted=[9, 9])
    assert book.mat is not None and book.mat > 3.0
    book.begin_schedule(running=64)
    assert book.width == 0


def test_mid_size_narrow_steps_widen_while_drafts_are_often_accepted() -> None:
    """From 16 to 47 requests, the high-MAT width applies once the moving MAT reaches its floor and the normal
    width again once it falls below; large batches and batches below 16 are untouched; no MAT yet: the width."""
    book = SlotBook(K, narrow=WIDTH, narrow_rows=(16, 48), large=(4, 3.0), high=(8, 4.0))
    book.begin_schedule(running=32)
    assert book.width == WIDTH  # no MAT measured yet
    for _ in range(30):
        book.note(["a", "b"], [6, 6], emitted=[6, 7])  # MAT 6.5
    book.begin_schedule(running=32)
    assert (book.width, book.slots("a", K), book.slots("a", 5)) == (8, 8, 5)
    book.begin_schedule(running=64)
    assert book.width == 0  # large batch, MAT above 3: per-request slots
    book.begin_schedule(running=8)
    assert book.width == 0
    for _ in range(30):
        book.note(["a", "b"], [6, 6], emitted=[2, 3])  # MAT falls to ~2.5
    assert book.mat is not None and book.mat < 4.0
    book.begin_schedule(running=32)
    assert book.width == WIDTH
    assert book.as_dict()["high_mat_narrow_slots"] == 8
    d = book.as_dict()  # narrow schedules by width: the first and the last at 6, one at 8
    assert (d["narrow_steps"], d["narrow_steps_w6"], d["narrow_steps_w8"]) == (3, 2, 1)
    assert SlotBook(K, high=(8, 4.0)).high_width == 0  # no mid-size narrow steps: nothing to widen
    assert SlotBook(K, narrow=WIDTH, high=(16, 4.0)).high_width == 0  # k: vLLM's own graphs


def test_large_batches_are_narrow_while_drafts_are_seldom_accepted() -> None:
    """From 48 requests on: the low-MAT width while the moving MAT is at most its ceiling, per-request slots above
    it; mid-size batches keep their own rules."""
    book = SlotBook(K, narrow=WIDTH, narrow_rows=(16, 48), large=(4, 3.0), high=(8, 4.0))
    book.begin_schedule(running=64)
    assert book.width == 0  # no MAT measured yet
    for _ in range(30):
        book.note(["a", "b"], [6, 6], emitted=[6, 7])  # MAT 6.5
    book.begin_schedule(running=64)
    assert book.width == 0 and book.slots("a", K) == 6
    for _ in range(30):
        book.note(["a", "b"], [6, 6], emitted=[2, 2])  # MAT ~2
    book.begin_schedule(running=64)
    assert book.width == 4
    book.begin_schedule(running=32)
    assert book.width == WIDTH


def test_regrant_on_a_narrow_schedule_hands_out_width_placeholders() -> None:
    from specdec.vllm_plugin.patches.async_slots import regrant_placeholders

    book = SlotBook(K, narrow=WIDTH, narrow_rows=(2, 48))
    shared = [PLACEHOLDER] * K
    reqs = [SimpleNamespace(request_id=f"r{i}", spec_token_ids=shared, is_prefill_chunk=False) for i in range(3)]
    reqs.append(SimpleNamespace(request_id="p", spec_token_ids=[], is_prefill_chunk=True))  # a prompt chunk
    scheduler = SimpleNamespace(_spec_token_placeholders=shared, running=reqs)
    assert regrant_placeholders(scheduler, book) == 3
    assert [len(r.spec_token_ids) for r in reqs] == [WIDTH, WIDTH, WIDTH, 0]
    assert all(book.owns(r.spec_token_ids) for r in reqs[:3])


def test_narrow_step_drafts_every_row_to_the_width() -> None:
    """A narrow schedule's drafting pads each row with the drafter's chain to exactly the width, though
    pad_drafts is off and the cost model would cut the drafts shorter."""
    opts = SpecdecOptions(num_speculative_tokens=K, pad_drafts="off", draft_timeout_ms=0)
    python = InternalSettings(native_step=False)
    core = ProposerCore(SuffixDrafter(), opts, max_model_len=4096, internal=python, target_params=8e9)
    book = SlotBook(K, narrow=WIDTH, narrow_rows=(1, 48))
    sched = ScheduledDrafting(core, k=K, max_rows=4, device="cpu", slot_book=book)
    prompt = [5, 6, 7, 8] * 8
    widths = []
    for running in (2, 64):  # narrow, then not (64 >= 48)
        book.begin_schedule(running)
        rows = SimpleNamespace(
            req_ids=["a", "b"],
            sampled=[[9], [9]],
            lengths=[33, 33],
            contexts=torch.tensor([prompt + [9], prompt + [9]]).numpy(),
            prompt_lens=[32, 32],
            fillers=[9, 9],
        )
        drafts = core.step(
            StepBatch(rows.req_ids, rows.sampled, rows.lengths, rows.contexts, rows.prompt_lens, book.width or None),
            pad=True if book.width else None,
        )
        widths.append([len(d) for d in drafts])
        core.reset()
    assert widths[0] == [WIDTH, WIDTH]
    assert all(w <= K for w in widths[1])
    sched.close()


# ----------------------------------------------------------------- the dispatcher (vLLM's own class)
def _dispatcher(
    monkeypatch: pytest.MonkeyPatch,
    width: int = WIDTH,
    *,
    ragged: bool = False,
    mode: str = "FULL_AND_PIECEWISE",
    ours: bool = True,
    max_num_seqs: int = 64,
    prefill: int = 0,
) -> Any:
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    cls = type("Dispatcher", (CudagraphDispatcher,), {})  # wrap a subclass: vLLM's class stays as it was
    assert wrap_unchecked(cls, Feature.NARROW_GRAPHS, targets=(DISPATCHER,)) == 2
    monkeypatch.setattr(graphs, "narrow_widths", lambda config: (width,) if width else ())
    # our engine with ragged_graphs on, and its ragged_prefill_tokens (-1: not ours, or ragged_graphs off)
    monkeypatch.setattr(graphs, "ragged_prefill_tokens", lambda config: prefill if ours else -1)
    d = cls.__new__(cls)  # vLLM's __init__ needs a whole VllmConfig; set what the key and dispatch code read
    cc = SimpleNamespace(
        cudagraph_capture_sizes=list(CAPTURE_SIZES),
        max_cudagraph_capture_size=CAPTURE_SIZES[-1],
        compile_sizes=[],
        cudagraph_specialize_lora=False,
    )
    d.vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs), lora_config=None, num_speculative_tokens=K
    )
    d.compilation_config = cc
    d.uniform_decode_query_len = K + 1
    d.cudagraph_keys = {CUDAGraphMode.PIECEWISE: set(), CUDAGraphMode.FULL: set()}
    d.keys_initialized, d.specialize_lora_count, d.cudagraph_mode = False, False, CUDAGraphMode.NONE
    setattr(d, graphs.RAGGED_OK, ragged)  # what the runner's wrapper found in the attention backends
    d.initialize_cudagraph_keys(getattr(CUDAGraphMode, mode), K + 1)
    return d, CUDAGraphMode, BatchDescriptor


@needs_vllm
def test_dispatcher_adds_narrow_keys_beside_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    d, modes, _ = _dispatcher(monkeypatch)
    full = d.cudagraph_keys[modes.FULL]
    ours = {k for k in full if k.num_tokens == (WIDTH + 1) * k.num_reqs}
    theirs = full - ours
    assert sorted(k.num_reqs for k in ours) == sorted(k.num_reqs for k in theirs) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert all(k.num_tokens == (K + 1) * k.num_reqs and k.uniform for k in theirs)
    assert getattr(d, graphs.NARROW_KEYS) == {WIDTH + 1: [1, 2, 4, 8, 16, 24, 32, 48, 64]}
    capture = dict(d.get_capture_descs())[modes.FULL]  # vLLM's capture loop gets every key
    assert set(capture) == full


@needs_vllm
def test_dispatch_pads_a_narrow_batch_to_the_next_captured_request_count(monkeypatch: pytest.MonkeyPatch) -> None:
    d, modes, desc = _dispatcher(monkeypatch)
    setattr(d, graphs.NARROW_Q, WIDTH + 1)
    mode, got = d.dispatch(num_tokens=(WIDTH + 1) * 30, uniform_decode=True)
    assert (mode, got) == (modes.FULL, desc(num_tokens=(WIDTH + 1) * 32, num_reqs=32, uniform=True))
    mode, got = d.dispatch(num_tokens=(WIDTH + 1) * 30, uniform_decode=True, invalid_modes={modes.FULL})
    assert mode == modes.PIECEWISE and got.num_reqs is None  # cascade attention: vLLM's mixed-batch graphs
    mode, _ = d.dispatch(num_tokens=(WIDTH + 1) * 30, uniform_decode=True, valid_modes={modes.NONE})
    assert mode == modes.NONE  # a warm-up's eager run
    setattr(d, graphs.NARROW_Q, None)  # vLLM's own uniform batches dispatch as before
    mode, got = d.dispatch(num_tokens=(K + 1) * 30, uniform_decode=True)
    assert (mode, got) == (modes.FULL, desc(num_tokens=(K + 1) * 32, num_reqs=32, uniform=True))


@needs_vllm
def test_two_widths_get_their_own_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    d, modes, desc = _dispatcher(monkeypatch, width=0)
    monkeypatch.setattr(graphs, "narrow_widths", lambda config: (4, WIDTH))
    d.initialize_cudagraph_keys(modes.FULL_AND_PIECEWISE, K + 1)
    assert sorted(getattr(d, graphs.NARROW_KEYS)) == [5, WIDTH + 1]
    for q in (5, WIDTH + 1):
        setattr(d, graphs.NARROW_Q, q)
        assert d.dispatch(num_tokens=q * 20, uniform_decode=True) == (
            modes.FULL,
            desc(num_tokens=q * 24, num_reqs=24, uniform=True),
        )


@needs_vllm
def test_plain_keys_go_past_vllms_largest_spec_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    d, modes, desc = _dispatcher(monkeypatch, width=0, max_num_seqs=400)
    monkeypatch.setattr(graphs, "narrow_widths", lambda config: (0, WIDTH))
    d.compilation_config.cudagraph_capture_sizes = [*CAPTURE_SIZES, 17 * 80, 17 * 96]
    d.compilation_config.max_cudagraph_capture_size = 17 * 96
    d.cudagraph_keys = {modes.PIECEWISE: set(), modes.FULL: set()}
    d.initialize_cudagraph_keys(modes.FULL_AND_PIECEWISE, K + 1)
    ladder = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96]  # vLLM's request counts (k + 1 tokens each)
    # plain: no speculation's ladder (1, 2, 4, every 8 up to 256, every 16 from there) up to max_num_seqs (400), past
    # vLLM's largest speculative count; narrow widths keep vLLM's ladder
    plain = [1, 2, 4, *range(8, 256, 8), *range(256, 401, 16)]
    assert plain[-3:] == [368, 384, 400] and len(plain) == 44
    assert getattr(d, graphs.NARROW_KEYS) == {1: plain, WIDTH + 1: ladder}
    setattr(d, graphs.NARROW_Q, 1)
    # a plain batch of 130 requests pads to the next captured count; 401 (past max_num_seqs) finds none: vLLM's
    # mixed-batch graphs
    assert d.dispatch(num_tokens=130, uniform_decode=True) == (
        modes.FULL,
        desc(num_tokens=136, num_reqs=136, uniform=True),
    )
    mode, got = d.dispatch(num_tokens=401, uniform_decode=True)
    assert mode == modes.PIECEWISE and got.num_reqs is None


def test_plain_ladder_pads_as_no_speculation_up_to_512_then_sparsely() -> None:
    from specdec.vllm_plugin.patches.narrow_keys import plain_ladder

    assert plain_ladder(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 100]  # 100 rows: no padding
    assert plain_ladder(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    full = plain_ladder(1024)  # vllm serve's max_num_seqs
    assert full[33:37] == [248, 256, 272, 288] and full[-6:] == [496, 512, 640, 800, 1008, 1024] and len(full) == 55
    assert plain_ladder(3) == [1, 2, 3] and plain_ladder(1) == [1] and plain_ladder(0) == []


@needs_vllm
@pytest.mark.parametrize("max_num_seqs", [1024, 256, 100])
def test_plain_ladder_is_vllms_own_no_speculation_ladder(max_num_seqs: int) -> None:
    """Reference: the sizes vLLM itself captures for an engine without speculation (its default ladder, from its
    own ``VllmConfig._set_cudagraph_sizes`` on a stand-in config) are all in the plain ladder up to max_num_seqs, and
    the plain ladder adds none but max_num_seqs (vLLM 0.33 captures it too), so a plain step is padded as no
    speculation pads it."""
    from vllm.config import CUDAGraphMode, VllmConfig

    from specdec.vllm_plugin.patches.narrow_keys import plain_ladder

    cc = SimpleNamespace(
        max_cudagraph_capture_size=None,
        cudagraph_capture_sizes=None,
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        pass_config=SimpleNamespace(enable_sp=False),
        post_init_cudagraph_sizes=lambda: None,
    )
    config = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False),
        compilation_config=cc,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=16384),
        num_speculative_tokens=0,
        uniform_decode_query_len=1,  # vLLM 0.33 reads it (1 + the speculative tokens)
        performance_mode="balanced",
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    try:
        VllmConfig._set_cudagraph_sizes(config)
    except (AttributeError, TypeError) as exc:  # a vLLM whose method reads more of the config than this stand-in
        pytest.skip(f"vLLM's capture sizes need more of a config here ({exc!r})")
    theirs = list(cc.cudagraph_capture_sizes)
    assert theirs[:4] == [1, 2, 4, 8] and theirs[-1] == min(2 * max_num_seqs, 512)
    top = min(theirs[-1], max_num_seqs)  # our engine's plain graphs stop at max_num_seqs (and always hold it)
    ours = plain_ladder(top)
    assert {t for t in theirs if t <= top} <= set(ours) <= {*theirs, top}  # never coarser, nothing else added


@pytest.mark.parametrize(
    ("max_num_seqs", "capture_max", "ceiling", "limit"),
    [
        (1024, 512, 1000, 512),  # vllm serve's default max_num_seqs on a large GPU: the capture limit bounds it
        (256, 512, 1000, 256),  # the LLM class's default: max_num_seqs
        (256, 512, 200, 199),  # below the profile ceiling (our keys stay under vLLM's second-largest FULL key)
        (256, None, 1000, 0),  # no capture sizes: no plain key past vLLM's
    ],
)
def test_plain_request_limit_is_the_least_of_max_num_seqs_the_capture_limit_and_the_ceiling(
    max_num_seqs: int, capture_max: int | None, ceiling: int, limit: int
) -> None:
    from specdec.vllm_plugin.patches.narrow_keys import plain_request_limit

    d = SimpleNamespace(
        vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs)),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=capture_max),
    )
    assert plain_request_limit(d, ceiling) == limit


@needs_vllm
def test_no_narrow_keys_for_other_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    d, modes, _ = _dispatcher(monkeypatch, width=0)
    assert all(k.num_tokens == (K + 1) * k.num_reqs for k in d.cudagraph_keys[modes.FULL])
    assert getattr(d, graphs.NARROW_KEYS) == {}


# ----------------------------------------------------------------- the runner wrapper (a fake runner)
class FakeRunner:
    """Records how vLLM's runner would dispatch (force_uniform_decode, the dispatcher's narrow length) and
    capture (its uniform_decode_query_len at the time)."""

    def __init__(self, narrow: dict[int, list[int]]) -> None:
        self.cudagraph_dispatcher = SimpleNamespace(**{graphs.NARROW_KEYS: narrow, graphs.NARROW_Q: None})
        self.uniform_decode_query_len = K + 1
        self.calls: list[tuple[Any, Any]] = []

    def _determine_batch_execution_and_padding(
        self,
        num_tokens: int,
        num_reqs: int,
        num_scheduled_tokens_np: Any,
        max_num_scheduled_tokens: int,
        use_cascade_attn: bool,
        force_uniform_decode: bool | None = None,
    ) -> tuple[Any, Any]:
        q = getattr(self.cudagraph_dispatcher, graphs.NARROW_Q)
        self.calls.append((force_uniform_decode, q))
        return force_uniform_decode, q

    def _warmup_and_capture(self, desc: Any, cudagraph_runtime_mode: Any) -> int:
        return self.uniform_decode_query_len


def _runner() -> FakeRunner:
    cls = type("Runner", (FakeRunner,), {})
    wrap_unchecked(cls, Feature.NARROW_GRAPHS, Feature.GRAPH_LOG, targets=(RUNNER,))
    return cls({WIDTH + 1: [1, 2, 4, 8]})


def test_runner_dispatches_a_narrow_batch_as_uniform() -> None:
    r = _runner()
    q = WIDTH + 1
    assert r._determine_batch_execution_and_padding(
        num_tokens=q * 3, num_reqs=3, num_scheduled_tokens_np=None, max_num_scheduled_tokens=q, use_cascade_attn=False
    ) == (True, q)
    assert getattr(r.cudagraph_dispatcher, graphs.NARROW_Q) is None  # reset after the call
    mixed = r._determine_batch_execution_and_padding(
        num_tokens=q * 3 - 1,
        num_reqs=3,
        num_scheduled_tokens_np=None,
        max_num_scheduled_tokens=q,
        use_cascade_attn=False,
    )
    wide = r._determine_batch_execution_and_padding(
        num_tokens=(K + 1) * 3,
        num_reqs=3,
        num_scheduled_tokens_np=None,
        max_num_scheduled_tokens=K + 1,
        use_cascade_attn=False,
    )
    capture = r._determine_batch_execution_and_padding(q * 3, 3, None, q, False, force_uniform_decode=False)
    assert (mixed, wide, capture) == ((None, None), (None, None), (False, None))  # all left to vLLM


def test_capture_of_a_narrow_key_uses_its_query_length() -> None:
    r = _runner()
    narrow = SimpleNamespace(num_tokens=(WIDTH + 1) * 4, num_reqs=4, uniform=True)
    theirs = SimpleNamespace(num_tokens=(K + 1) * 4, num_reqs=4, uniform=True)
    mixed = SimpleNamespace(num_tokens=28, num_reqs=None, uniform=False)
    assert r._warmup_and_capture(narrow, "FULL") == WIDTH + 1
    assert [r._warmup_and_capture(d, "FULL") for d in (theirs, mixed)] == [K + 1, K + 1]
    assert r.uniform_decode_query_len == K + 1 and getattr(r.cudagraph_dispatcher, graphs.NARROW_Q) is None


# ----------------------------------------------------------------- ragged batches
@needs_vllm
def test_ragged_keys_one_per_capture_size_for_the_most_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    d, modes, desc = _dispatcher(monkeypatch, ragged=True)
    full = d.cudagraph_keys[modes.FULL]
    ragged = {k for k in full if not k.uniform}
    assert ragged == {desc(num_tokens=t, num_reqs=64, uniform=False) for t in RAGGED_SIZES}
    assert all(
        k.num_tokens == (K + 1) * k.num_reqs or k.num_tokens == (WIDTH + 1) * k.num_reqs for k in full - ragged
    )  # vLLM's uniform keys and the narrow ones, untouched
    assert getattr(d, graphs.RAGGED_KEYS) == (K + 1, 64, RAGGED_SIZES)
    assert ragged <= set(dict(d.get_capture_descs())[modes.FULL])  # vLLM's capture loop gets them


@needs_vllm
def test_ragged_keys_stop_at_what_the_uniform_dummy_batch_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Few requests (max_num_seqs 8, k = 16): capture sizes past 8 x 17 tokens get no ragged key, since vLLM's
    uniform dummy run of 8 requests of 17 tokens cannot hold them (the engine would fail to start); here vLLM's
    own keys (17, 34, 68, 136 tokens) also put the profile ceiling at 68."""
    d, modes, desc = _dispatcher(monkeypatch, ragged=True, max_num_seqs=8)
    ragged = {k for k in d.cudagraph_keys[modes.FULL] if not k.uniform}
    assert ragged == {desc(num_tokens=t, num_reqs=8, uniform=False) for t in (17, 34)}
    assert getattr(d, graphs.RAGGED_KEYS) == (K + 1, 8, [17, 34])
    assert graphs.ragged_key(d, num_tokens=30, num_reqs=8, max_query_len=K + 1) == (34, 8, K + 1)
    assert graphs.ragged_key(d, num_tokens=100, num_reqs=8, max_query_len=K + 1) is None


@needs_vllm
def test_prefill_carrying_family_keys_rules_and_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """ragged_prefill_tokens = P: a second family of keys, tagged by num_active_loras, for batches whose longest
    request (a prompt chunk) has at most P tokens; dispatched FULL with max query length P."""
    d, modes, desc = _dispatcher(monkeypatch, ragged=True, prefill=PREFILL)
    full = d.cudagraph_keys[modes.FULL]
    tagged = {k for k in full if k.num_active_loras == PREFILL_TAG}
    assert tagged == {
        desc(num_tokens=t, num_reqs=64, uniform=False, num_active_loras=PREFILL_TAG) for t in RAGGED_SIZES
    }
    assert getattr(d, graphs.RAGGED_PREFILL) == (PREFILL, 64, RAGGED_SIZES)
    assert {k for k in full if not k.uniform} - tagged == {desc(num_tokens=t, num_reqs=64) for t in RAGGED_SIZES}
    assert graphs.ragged_key(d, num_tokens=200, num_reqs=30, max_query_len=K + 1) == (272, 64, K + 1)  # decoding
    assert graphs.ragged_key(d, num_tokens=500, num_reqs=40, max_query_len=120) == (17 * 32, 64, PREFILL)
    assert graphs.ragged_key(d, num_tokens=600, num_reqs=40, max_query_len=120) is None  # at the profile ceiling
    assert graphs.ragged_key(d, num_tokens=PREFILL, num_reqs=1, max_query_len=PREFILL) == (17 * 16, 64, PREFILL)
    assert graphs.ragged_key(d, num_tokens=600, num_reqs=40, max_query_len=PREFILL + 1) is None  # a longer prompt
    assert graphs.ragged_key(d, num_tokens=2000, num_reqs=40, max_query_len=120) is None  # past the capture sizes
    assert dispatcher_stats(d).ragged_prefill_full == 0
    setattr(d, graphs.RAGGED_DESC, (17 * 32, 64, PREFILL))
    mode, got = d.dispatch(num_tokens=500, uniform_decode=False)
    assert (mode, got) == (modes.FULL, desc(num_tokens=17 * 32, num_reqs=64, num_active_loras=PREFILL_TAG))
    assert getattr(d, graphs.RAGGED_HIT) == PREFILL and dispatcher_stats(d).ragged_prefill_full == 1
    setattr(d, graphs.RAGGED_DESC, None)
    for prefill in (0, K + 1):  # off: 0, or not longer than the decoding family's q
        d, modes, _ = _dispatcher(monkeypatch, ragged=True, prefill=prefill)
        assert getattr(d, graphs.RAGGED_PREFILL) is None
        assert not any(k.num_active_loras for k in d.cudagraph_keys[modes.FULL])
        assert graphs.ragged_key(d, num_tokens=600, num_reqs=40, max_query_len=120) is None


@needs_vllm
def test_no_ragged_keys_without_full_support_or_in_full_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for kwargs in ({"ragged": False}, {"ragged": True, "mode": "FULL"}):  # a backend short of ALWAYS; FULL mode
        d, modes, _ = _dispatcher(monkeypatch, **kwargs)
        assert getattr(d, graphs.RAGGED_KEYS) is None
        if kwargs.get("mode") is None:
            assert all(k.uniform for k in d.cudagraph_keys[modes.FULL])
    d, modes, _ = _dispatcher(monkeypatch, ragged=True, ours=False)  # ragged_graphs off, or not our engine
    assert getattr(d, graphs.RAGGED_KEYS) is None and all(k.uniform for k in d.cudagraph_keys[modes.FULL])


@needs_vllm
def test_ragged_key_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    d, _, _ = _dispatcher(monkeypatch, ragged=True)
    assert graphs.ragged_key(d, num_tokens=200, num_reqs=30, max_query_len=K + 1) == (17 * 16, 64, K + 1)  # padded
    assert graphs.ragged_key(d, num_tokens=30, num_reqs=30, max_query_len=1) == (34, 64, K + 1)  # no drafts at all
    assert graphs.ragged_key(d, num_tokens=(K + 1) * 8, num_reqs=8, max_query_len=K + 1) is None  # vLLM's uniform
    assert graphs.ragged_key(d, num_tokens=200, num_reqs=30, max_query_len=K + 2) is None  # a prompt chunk
    assert graphs.ragged_key(d, num_tokens=200, num_reqs=65, max_query_len=4) is None  # more requests than captured
    assert graphs.ragged_key(d, num_tokens=17 * 64 + 1, num_reqs=64, max_query_len=K + 1) is None  # too many tokens


@needs_vllm
def test_dispatch_of_a_ragged_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    d, modes, desc = _dispatcher(monkeypatch, ragged=True)
    setattr(d, graphs.RAGGED_DESC, (17 * 16, 64, K + 1))
    assert d.dispatch(num_tokens=200, uniform_decode=False) == (modes.FULL, desc(num_tokens=272, num_reqs=64))
    assert getattr(d, graphs.RAGGED_HIT) == K + 1
    setattr(d, graphs.RAGGED_HIT, None)
    assert dispatcher_stats(d).ragged_piecewise == 0
    mode, got = d.dispatch(num_tokens=200, uniform_decode=False, invalid_modes={modes.FULL})  # cascade attention
    assert mode == modes.PIECEWISE and got.num_reqs is None and getattr(d, graphs.RAGGED_HIT) is None
    assert d.dispatch(num_tokens=200, uniform_decode=False, valid_modes={modes.NONE})[0] == modes.NONE
    assert dispatcher_stats(d).ragged_piecewise == 1  # the cascade step; a capture's eager warm-up is not counted
    setattr(d, graphs.RAGGED_DESC, None)  # any other batch: vLLM's dispatch, never to a ragged key (a prompt chunk
    mode, got = d.dispatch(num_tokens=200, uniform_decode=False)  # would find (272, 64) there)
    assert mode == modes.PIECEWISE and got.num_reqs is None and getattr(d, graphs.RAGGED_HIT) is None
    mode, got = d.dispatch(num_tokens=(K + 1) * 30, uniform_decode=True)  # vLLM's uniform batches as before
    assert (mode, got) == (modes.FULL, desc(num_tokens=(K + 1) * 32, num_reqs=32, uniform=True))


@dataclasses.dataclass(frozen=True)
class Desc:
    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    num_active_loras: int = 0


class FakeRaggedRunner:
    """Records what vLLM's runner would see: the dispatcher's ragged key during a dispatch or capture, the
    attention metadata's max query length, the backends' support handed to the key setup."""

    def __init__(self) -> None:
        self.cudagraph_dispatcher = SimpleNamespace(
            **{
                graphs.NARROW_KEYS: {},
                graphs.NARROW_Q: None,
                graphs.RAGGED_KEYS: (K + 1, 64, CAPTURE_SIZES),
                graphs.RAGGED_PREFILL: (PREFILL, 64, CAPTURE_SIZES),
            }
        )
        self.uniform_decode_query_len = K + 1
        self.vllm_config = None
        self.seen: list[Any] = []

    def _determine_batch_execution_and_padding(
        self,
        num_tokens: int,
        num_reqs: int,
        num_scheduled_tokens_np: Any,
        max_num_scheduled_tokens: int,
        use_cascade_attn: bool,
        force_uniform_decode: bool | None = None,
    ) -> Any:
        key = getattr(self.cudagraph_dispatcher, graphs.RAGGED_DESC, None)
        if key is not None and not use_cascade_attn:  # what the wrapped dispatcher does with it
            setattr(self.cudagraph_dispatcher, graphs.RAGGED_HIT, key[2])
        self.seen.append(key)
        return key

    def _warmup_and_capture(self, desc: Any, cudagraph_runtime_mode: Any) -> Any:
        self.captured_q = self.uniform_decode_query_len  # the dummy batch's tokens per request
        return desc, getattr(self.cudagraph_dispatcher, graphs.RAGGED_DESC, None)

    def _build_attention_metadata(self, num_tokens: int, num_reqs: int, max_query_len: int) -> int:
        return max_query_len

    def _check_and_update_cudagraph_mode(self, attention_backends: Any, kv_cache_groups: Any) -> bool:
        return getattr(self.cudagraph_dispatcher, graphs.RAGGED_OK)


def _ragged_runner() -> FakeRaggedRunner:
    cls = type("RaggedRunner", (FakeRaggedRunner,), {})
    wrap_unchecked(cls, Feature.NARROW_GRAPHS, Feature.GRAPH_LOG, Feature.RAGGED_GRAPHS, targets=(RUNNER,))
    return cls()


def test_runner_dispatches_a_ragged_batch_and_states_the_captured_query_length() -> None:
    r = _ragged_runner()
    assert r._determine_batch_execution_and_padding(
        200, 30, None, max_num_scheduled_tokens=9, use_cascade_attn=False
    ) == (272, 64, K + 1)
    assert getattr(r.cudagraph_dispatcher, graphs.RAGGED_DESC) is None  # reset after the call
    assert r._build_attention_metadata(num_tokens=200, num_reqs=30, max_query_len=9) == K + 1
    cascade = r._determine_batch_execution_and_padding(200, 30, None, max_num_scheduled_tokens=9, use_cascade_attn=True)
    assert cascade == (272, 64, K + 1)
    assert r._build_attention_metadata(num_tokens=200, num_reqs=30, max_query_len=9) == 9
    # a prompt chunk of 120 tokens beside decoding requests: the prefill-carrying family, max query length P
    chunk = r._determine_batch_execution_and_padding(
        600, 40, None, max_num_scheduled_tokens=120, use_cascade_attn=False
    )
    assert chunk == (17 * 48, 64, PREFILL)
    assert r._build_attention_metadata(num_tokens=600, num_reqs=40, max_query_len=120) == PREFILL
    prompt = r._determine_batch_execution_and_padding(
        600, 3, None, max_num_scheduled_tokens=500, use_cascade_attn=False
    )
    assert prompt is None and r._build_attention_metadata(num_tokens=600, num_reqs=3, max_query_len=500) == 500


@pytest.mark.parametrize("fallback", [False, True])
def test_uniform_batches_past_their_ladder_take_the_ragged_graphs_only_when_switched_on(
    monkeypatch: pytest.MonkeyPatch, fallback: bool
) -> None:
    """A plain or narrow batch of more requests than its FULL keys hold (here 8) replays a ragged key with
    ``UNIFORM_PAST_LADDER_RAGGED`` on (vLLM's piecewise graphs otherwise: the narrow path finds no key); one they
    hold stays narrow either way; with no ragged key for it (more requests than captured) it stays narrow."""
    monkeypatch.setattr(graphs, "UNIFORM_PAST_LADDER_RAGGED", fallback)
    r = _ragged_runner()
    setattr(r.cudagraph_dispatcher, graphs.NARROW_KEYS, {1: [1, 2, 4, 8], WIDTH + 1: [1, 2, 4, 8]})
    q = WIDTH + 1
    plain30 = r._determine_batch_execution_and_padding(30, 30, None, max_num_scheduled_tokens=1, use_cascade_attn=False)
    narrow30 = r._determine_batch_execution_and_padding(
        q * 30, 30, None, max_num_scheduled_tokens=q, use_cascade_attn=False
    )
    plain6 = r._determine_batch_execution_and_padding(6, 6, None, max_num_scheduled_tokens=1, use_cascade_attn=False)
    plain70 = r._determine_batch_execution_and_padding(70, 70, None, max_num_scheduled_tokens=1, use_cascade_attn=False)
    if fallback:  # the ragged keys' next token count, for the 64 requests they were captured with
        assert (plain30, narrow30) == ((34, 64, K + 1), (17 * 16, 64, K + 1))
    else:  # the narrow path (no ragged key set while vLLM dispatches)
        assert (plain30, narrow30) == (None, None)
    assert (plain6, plain70) == (None, None)  # held by its own keys; more requests than the ragged keys hold
    assert r.seen == [(34, 64, K + 1), (17 * 16, 64, K + 1), None, None] if fallback else [None] * 4


def test_capture_of_a_ragged_key_runs_vllms_uniform_dummy_under_that_key() -> None:
    r = _ragged_runner()
    got, key = r._warmup_and_capture(Desc(num_tokens=272, num_reqs=64), "FULL")
    assert (got, key, r.captured_q) == (Desc(num_tokens=272, num_reqs=64, uniform=True), (272, 64, K + 1), K + 1)
    tagged = Desc(num_tokens=272, num_reqs=64, num_active_loras=PREFILL_TAG)  # the prefill-carrying family
    got, key = r._warmup_and_capture(tagged, "FULL")  # vLLM gets the key untagged, dummy requests of P tokens
    assert (got, key, r.captured_q) == (Desc(num_tokens=272, num_reqs=64, uniform=True), (272, 64, PREFILL), PREFILL)
    assert r.uniform_decode_query_len == K + 1
    theirs = Desc(num_tokens=272, num_reqs=16, uniform=True)
    assert r._warmup_and_capture(theirs, "FULL") == (theirs, None)  # vLLM's own keys: as before
    assert getattr(r.cudagraph_dispatcher, graphs.RAGGED_DESC) is None


def test_each_engine_counts_and_logs_the_graphs_it_added_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Captures of our keys count into the engine's ``GraphStats`` (found through its dispatcher's config, where the
    proposer reads them); vLLM's own keys are not counted; each engine logs its added graphs once, after vLLM's
    ``capture_model``; two engines in one process keep their counts apart."""
    lines: list[tuple[Any, ...]] = []
    monkeypatch.setattr(graphs, "logger", SimpleNamespace(info=lambda *a: lines.append(a)))

    class Runner(FakeRaggedRunner):
        def capture_model(self) -> str:
            self._warmup_and_capture(Desc(num_tokens=272, num_reqs=64), "FULL")  # ours
            self._warmup_and_capture(Desc(num_tokens=272, num_reqs=16, uniform=True), "FULL")  # vLLM's
            return "captured"

    cls = type("CountingRunner", (Runner,), {})
    wrap_unchecked(cls, Feature.NARROW_GRAPHS, Feature.GRAPH_LOG, Feature.RAGGED_GRAPHS, targets=(RUNNER,))
    first, second = cls(), cls()
    for r in (first, second):
        r.cudagraph_dispatcher.vllm_config = SimpleNamespace()
    assert first.capture_model() == "captured" and first.capture_model() == "captured"
    stats = graph_stats_of(first.cudagraph_dispatcher.vllm_config)
    assert stats is dispatcher_stats(first.cudagraph_dispatcher)
    assert stats.added_graphs_captured == 2 and stats.added_graphs_logged == 1 and len(lines) == 1
    assert lines[0][1] == 1  # (the log line's first figure: graphs added so far)
    assert dispatcher_stats(second.cudagraph_dispatcher).added_graphs_captured == 0
    second.capture_model()
    assert dispatcher_stats(second.cudagraph_dispatcher).added_graphs_captured == 1 and len(lines) == 2


def test_a_proposer_reports_its_own_engines_graph_counts() -> None:
    from specdec.vllm_plugin.proposer import SpecdecProposer

    def config() -> SimpleNamespace:
        return SimpleNamespace(
            additional_config={"specdec": {"draft_timeout_ms": 0}},
            speculative_config=SimpleNamespace(num_speculative_tokens=K),
            model_config=SimpleNamespace(max_model_len=512),
        )

    ours, other = config(), config()
    graph_stats_of(ours).ragged_keys = graph_stats_of(ours).ragged_full = 3  # what its dispatcher counted
    prop, beside = SpecdecProposer(ours, patch_runner=False), SpecdecProposer(other, patch_runner=False)
    try:
        assert prop.graph_stats is graph_stats_of(ours) and prop.graph_stats.ragged_ready()
        assert prop.stats()["graphs"]["ragged_full"] == 3 and beside.stats()["graphs"]["ragged_full"] == 0
        assert not beside.graph_stats.ragged_ready()
    finally:
        prop.close()
        beside.close()


@dataclasses.dataclass(frozen=True)
class OldDesc:
    """A ``BatchDescriptor`` from before vLLM had ``num_active_loras``."""

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False


def test_descriptors_without_the_lora_count_get_the_decoding_family_only() -> None:
    cc = SimpleNamespace(cudagraph_capture_sizes=list(CAPTURE_SIZES), max_cudagraph_capture_size=CAPTURE_SIZES[-1])
    d = SimpleNamespace(
        compilation_config=cc,
        cudagraph_keys={"FULL": set()},
        vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=64)),
    )
    assert graphs.add_ragged_keys(d, K + 1, full_mode="FULL", descriptor=OldDesc, ceiling=10**6) == len(CAPTURE_SIZES)
    assert OldDesc(num_tokens=17, num_reqs=64) in d.cudagraph_keys["FULL"]
    assert not graphs.has_field(OldDesc, "num_active_loras") and graphs.has_field(Desc, "num_active_loras")
    r = _ragged_runner()  # its capture of a decoding-family key passes the old descriptor through untouched
    got, key = r._warmup_and_capture(OldDesc(num_tokens=272, num_reqs=64), "FULL")
    assert (got, key) == (OldDesc(num_tokens=272, num_reqs=64, uniform=True), (272, 64, K + 1))


def test_ragged_graphs_need_full_support_from_every_attention_backend() -> None:
    def backend(name: str) -> Any:
        support = SimpleNamespace(name=name, value={"ALWAYS": 3, "UNIFORM_BATCH": 2}[name])
        builder = SimpleNamespace(get_cudagraph_support=lambda config, spec: support)
        return SimpleNamespace(get_builder_cls=lambda: builder)

    group = SimpleNamespace(kv_cache_spec=None)
    r = _ragged_runner()
    assert r._check_and_update_cudagraph_mode([[backend("ALWAYS")]], [group]) is True
    assert (
        r._check_and_update_cudagraph_mode([[backend("ALWAYS")], [backend("UNIFORM_BATCH")]], [group, group]) is False
    )


def test_high_mat_steps_take_per_request_slots_once_ragged_graphs_exist() -> None:
    """While the moving MAT is at least the high-MAT floor, a mid-size step gives each request its own slots if
    the ragged graphs were captured, else the high-MAT width; below the floor the narrow width either way."""
    ready = {"graphs": False}
    book = SlotBook(K, narrow=WIDTH, narrow_rows=(16, 48), high=(8, 4.0), high_ragged=lambda: ready["graphs"])
    for _ in range(30):
        book.note(["a", "b"], [6, 12], emitted=[6, 7])  # MAT 6.5
    book.begin_schedule(running=32)
    assert book.width == 8  # no ragged graphs (yet): the high-MAT width
    ready["graphs"] = True
    book.begin_schedule(running=32)
    assert (book.width, book.slots("a", K), book.slots("b", K)) == (0, 6, 12)  # each its latest draft's length
    for _ in range(30):
        book.note(["a", "b"], [3, 3], emitted=[2, 3])  # MAT falls below 4
    book.begin_schedule(running=32)
    assert book.width == WIDTH
    assert book.as_dict()["ragged_high_mat_steps"] == 1
    assert SpecdecOptions().ragged_graphs


def test_sparse_ladder_keeps_ends_and_spaces_the_rest() -> None:
    assert ragged_keys.sparse_ladder([]) == []
    assert ragged_keys.sparse_ladder([8]) == [8]
    sizes = list(range(8, 257, 8))  # 8, 16, ..., 256
    kept = ragged_keys.sparse_ladder(sizes, ratio=1.25)
    assert kept == [8, 16, 24, 32, 40, 56, 72, 96, 120, 152, 192, 240, 256]
    assert all(b >= a * 1.25 for a, b in zip(kept[:-2], kept[1:-1]))  # (the largest is kept whatever its gap)
    assert all(any(k >= s for k in kept) for s in sizes)  # every size still finds a key


def test_profile_ceiling_is_vllms_second_largest_full_key() -> None:
    keys = {Desc(num_tokens=t, num_reqs=t // 17, uniform=True) for t in CAPTURE_SIZES}
    d = SimpleNamespace(cudagraph_keys={"FULL": keys})
    assert graphs.profile_ceiling(d, "FULL") == 17 * 48
    d.cudagraph_keys["FULL"] = {Desc(num_tokens=17, num_reqs=1, uniform=True)}
    assert graphs.profile_ceiling(d, "FULL") == 0  # one key of vLLM's: no room below the profile's two samples


# ----------------------------------------------------------------- plain batches (no draft verified)
def _our_config(**specdec: Any) -> SimpleNamespace:
    from specdec.vllm_plugin.patches.async_sched import PROPOSER_PATH

    spec = SimpleNamespace(method="custom_class", model=PROPOSER_PATH, num_speculative_tokens=K)
    return SimpleNamespace(speculative_config=spec, additional_config={"specdec": specdec})


def test_plain_width_for_our_engines_in_every_mode_narrow_ones_in_schedule_mode() -> None:
    from specdec.vllm_plugin.patches.narrow_keys import narrow_widths
    from specdec.vllm_plugin.settings import PLAIN_WIDTH

    assert PLAIN_WIDTH == 0
    assert narrow_widths(_our_config(async_mode="thread")) == (0,)
    assert narrow_widths(_our_config(async_mode="schedule")) == (0, 4, 6, 8)
    assert narrow_widths(_our_config(async_mode="schedule", narrow_graphs=False)) == (0,)
    assert narrow_widths(_our_config(async_mode="schedule", draft_slots="uniform")) == (0,)
    theirs = SimpleNamespace(speculative_config=SimpleNamespace(method="suffix", model=None), additional_config={})
    assert narrow_widths(theirs) == () and narrow_widths(SimpleNamespace()) == ()


def test_the_config_hook_and_the_engine_settings_decide_schedule_mode_alike() -> None:
    """``VllmConfig.__post_init__``'s hook (``wants_schedule``) and ``EngineSettings`` ask one parser and one mode
    decision; the internal settings reach the settings through ``resolve(..., internal=...)``."""
    from specdec.vllm_plugin.patches.async_sched import wants_schedule
    from specdec.vllm_plugin.settings import resolve

    big = SimpleNamespace(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, vocab_size=128256)
    cases = [
        ({}, None, False),  # auto: a small (unknown) target drafts in thread mode
        ({}, big, True),  # auto: an 8B target in schedule mode
        ({"async_mode": "schedule"}, None, True),
        ({"async_mode": "thread"}, big, False),
        ({"async_drafting": False, "async_mode": "schedule"}, big, False),
    ]
    for specdec, hf, schedule in cases:
        cfg = _our_config(**specdec)
        cfg.model_config = SimpleNamespace(hf_config=hf)
        assert wants_schedule(cfg) == resolve(cfg).schedule == schedule, (specdec, hf)
    assert not wants_schedule(SimpleNamespace(additional_config={}))  # no options of ours
    internal = InternalSettings(ragged_prefill_tokens=64)
    settings = resolve(_our_config(async_mode="schedule"), internal=internal)
    assert settings.internal is internal and settings.ragged_prefill_tokens == 64


@needs_vllm
def test_plain_batches_replay_one_token_full_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    d, modes, desc = _dispatcher(monkeypatch, width=0)
    monkeypatch.setattr(graphs, "narrow_widths", lambda config: (0, WIDTH))
    d.initialize_cudagraph_keys(modes.FULL_AND_PIECEWISE, K + 1)
    assert getattr(d, graphs.NARROW_KEYS)[1] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]  # no speculation's ladder
    full = d.cudagraph_keys[modes.FULL]
    assert desc(num_tokens=32, num_reqs=32, uniform=True) in full
    setattr(d, graphs.NARROW_Q, 1)
    plain = desc(num_tokens=32, num_reqs=32, uniform=True)
    assert d.dispatch(num_tokens=30, uniform_decode=True) == (modes.FULL, plain)
    setattr(d, graphs.NARROW_Q, WIDTH + 1)
    assert d.dispatch(num_tokens=(WIDTH + 1) * 30, uniform_decode=True)[0] == modes.FULL
    stats = dispatcher_stats(d)
    assert (stats.narrow_full, stats.plain_full) == (2, 1)


def test_runner_dispatches_a_plain_batch_as_uniform_with_one_token_per_request() -> None:
    cls = type("Runner", (FakeRunner,), {})
    wrap_unchecked(cls, Feature.NARROW_GRAPHS, Feature.GRAPH_LOG, targets=(RUNNER,))
    r = cls({1: [1, 2, 4, 8], WIDTH + 1: [1, 2, 4, 8]})
    assert r._determine_batch_execution_and_padding(3, 3, None, 1, False) == (True, 1)
    assert r._determine_batch_execution_and_padding(4, 3, None, 2, False) == (None, None)  # one request has a draft
    plain = SimpleNamespace(num_tokens=4, num_reqs=4, uniform=True)
    assert r._warmup_and_capture(plain, "FULL") == 1  # captured from vLLM's dummy batch of one token per request
