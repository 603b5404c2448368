"""The plugin's metrics: Prometheus text rendered from the proposer's statistics (hand-checked strings), the endpoint
answering real GETs, a busy port never failing the start, the drafter's gauges sampled on the drafting thread, and a
proposer whose scrapes follow its counters. No vLLM."""

from __future__ import annotations

import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest

from specdec.config import ConfigError
from specdec.drafters.suffix import SuffixDrafter, native_available
from specdec.vllm_plugin.core.batch import StepBatch
from specdec.vllm_plugin.core.proposer_core import ProposerCore
from specdec.vllm_plugin.entry.options import SpecdecOptions, split_speculative_config
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.metrics.drafter import SAMPLE_PERIOD_S, drafter_gauges
from specdec.vllm_plugin.metrics.render import CONTENT_TYPE, render
from specdec.vllm_plugin.metrics.server import MetricsServer, drafter_label, start_exporter
from specdec.vllm_plugin.modes.thread import ThreadedProposerCore
from specdec.vllm_plugin.proposer import SpecdecProposer

HOST = "127.0.0.1"


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def sample_value(text: str, name: str) -> str | None:
    for line in text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] == name:
            return line.rsplit(" ", 1)[1]
    return None


# --------------------------------------------------------------------------- the text format
def test_mapped_counters_and_gauges_render_exactly() -> None:
    stats = {"steps": 12, "draft_timeouts": 3, "propose_seconds": 0.25, "native_step": False, "async_mode": "thread"}
    assert render(stats, info={"drafter": "suffix", "k": "16"}) == (
        "# HELP specdec_info The plugin's settings, as labels (value 1).\n"
        "# TYPE specdec_info gauge\n"
        'specdec_info{drafter="suffix",k="16"} 1\n'
        "# HELP specdec_steps_total Engine steps the proposer took part in.\n"
        "# TYPE specdec_steps_total counter\n"
        "specdec_steps_total 12\n"
        "# HELP specdec_propose_seconds_total Seconds vLLM's engine thread spent in the plugin's drafting calls.\n"
        "# TYPE specdec_propose_seconds_total counter\n"
        "specdec_propose_seconds_total 0.25\n"
        "# HELP specdec_deadline_misses_total Steps whose drafting passed draft_timeout_ms; each went on without "
        "drafts.\n"
        "# TYPE specdec_deadline_misses_total counter\n"
        "specdec_deadline_misses_total 3\n"
        "# HELP specdec_native_step 1 while the suffix drafter's native step drafts; 0 without one or after it fell "
        "back to the Python path.\n"
        "# TYPE specdec_native_step gauge\n"
        "specdec_native_step 0\n"
    )


def test_nested_and_unknown_keys_render_generically_and_diagnostics_stay_out() -> None:
    stats = {
        "schedule": {"blind_requests": 2, "fills": 7, "narrow_full": 5},  # narrow_full: a copy of the graphs' count
        "graphs": {"narrow_full": 5},
        "drafter_state": {"global_cache_tokens": 4096},
        "cost_model": {"8": {"a": 1.0}},  # per-bucket diagnostics: not exported
        "thread_timing_us": {"8": {"run_us": 3.0}},
        "backoff steps": np.int64(9),  # a key added later, of a numpy type, with a character names cannot hold
        "ratio": float("nan"),
        "label": "text",  # not a number: left out
    }
    assert render(stats) == (
        "# HELP specdec_blind_requests_total Schedule mode: requests first seen mid-generation without their tokens; "
        "they get no real drafts.\n"
        "# TYPE specdec_blind_requests_total counter\n"
        "specdec_blind_requests_total 2\n"
        "# HELP specdec_global_cache_tokens Response tokens in the suffix drafter's global cache.\n"
        "# TYPE specdec_global_cache_tokens gauge\n"
        "specdec_global_cache_tokens 4096\n"
        "# HELP specdec_schedule_fills Proposer statistic 'schedule.fills', exported as read.\n"
        "# TYPE specdec_schedule_fills untyped\n"
        "specdec_schedule_fills 7\n"
        "# HELP specdec_graphs_narrow_full Proposer statistic 'graphs.narrow_full', exported as read.\n"
        "# TYPE specdec_graphs_narrow_full untyped\n"
        "specdec_graphs_narrow_full 5\n"
        "# HELP specdec_backoff_steps Proposer statistic 'backoff steps', exported as read.\n"
        "# TYPE specdec_backoff_steps untyped\n"
        "specdec_backoff_steps 9\n"
        "# HELP specdec_ratio Proposer statistic 'ratio', exported as read.\n"
        "# TYPE specdec_ratio untyped\n"
        "specdec_ratio NaN\n"
    )


def test_label_values_are_escaped_and_a_generic_name_never_repeats_a_mapped_one() -> None:
    text = render({"steps": 1, "steps_total": 99, "inf": float("inf")}, info={"drafter": 'a"b\\c\nd'})
    assert 'specdec_info{drafter="a\\"b\\\\c\\nd"} 1\n' in text
    samples = [ln for ln in text.splitlines() if ln.startswith("specdec_steps_total")]
    assert samples == ["specdec_steps_total 1"] and text.count("# TYPE specdec_steps_total ") == 1
    assert "specdec_inf +Inf\n" in text
    assert drafter_label(["suffix", {"name": "model", "path": "/m"}]) == "suffix+model"


# --------------------------------------------------------------------------- the endpoint
def test_the_endpoint_answers_a_get_and_reads_the_statistics_per_scrape() -> None:
    counters = {"steps": 0, "accepted_tokens": 0}

    def source() -> dict[str, int]:
        return dict(counters)

    server = MetricsServer(source, host=HOST, port=0, info={"drafter": "suffix"})
    try:
        assert server.port > 0 and server.url == f"http://{HOST}:{server.port}/metrics"
        status, ctype, first = get(server.url)
        assert status == 200 and ctype == CONTENT_TYPE and first == render(source(), info={"drafter": "suffix"})
        assert sample_value(first, "specdec_steps_total") == "0"
        counters.update(steps=41, accepted_tokens=7)
        second = get(server.url)[2]
        assert (sample_value(second, "specdec_steps_total"), sample_value(second, "specdec_accepted_tokens_total")) == (
            "41",
            "7",
        )
        status, _, body = get(f"http://{HOST}:{server.port}/other")
        assert status == 404 and "/metrics" in body
    finally:
        server.close()
    server.close()  # idempotent
    assert port_free(server.port)


def test_a_failing_source_gives_a_500_and_the_server_goes_on() -> None:
    calls = {"n": 0}

    def source() -> dict[str, int]:
        calls["n"] += 1
        if calls["n"] <= 2:  # both tries of the first scrape fail
            raise RuntimeError("dictionary changed size during iteration")
        return {"steps": calls["n"]}

    server = MetricsServer(source, host=HOST, port=0)
    try:
        status, _, body = get(server.url)
        assert status == 500 and body.startswith("specdec: statistics unavailable (RuntimeError")
        assert get(server.url)[:1] == (200,) and calls["n"] == 3
    finally:
        server.close()


def options(**kw) -> SpecdecOptions:
    return SpecdecOptions.from_dict(kw)


def test_start_exporter_off_other_ranks_and_data_parallel_offset(
    caplog: pytest.LogCaptureFixture, plugin_log: Callable[[], list[logging.LogRecord]]
) -> None:
    asked = []

    def rank(r: int):
        return lambda: asked.append(r) or r

    holder = Holder()
    assert start_exporter(options(), holder.stats, vllm_config=None, tp_rank=rank(0)) is None and asked == []  # off
    base = free_port()
    assert start_exporter(options(metrics_port=base), holder.stats, vllm_config=None, tp_rank=rank(1)) is None
    assert asked == [1]
    dp = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank_local=0))
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    server = start_exporter(options(metrics_port=base - 1), holder.stats, vllm_config=dp, tp_rank=rank(0))
    assert server is None or server.port == base - 1  # base - 1 may be taken by someone else: then a warning
    if server is not None:
        server.close()
    dp.parallel_config.data_parallel_rank_local = 1
    server = start_exporter(options(metrics_port=base - 1), holder.stats, vllm_config=dp, tp_rank=rank(0))
    try:
        assert server is not None and server.port == base
        assert any(f"specdec: metrics on http://{HOST}:{base}/metrics" in r.getMessage() for r in plugin_log())
        assert sample_value(get(server.url)[2], "specdec_steps_total") == "3"
    finally:
        if server is not None:
            server.close()


class Holder:
    def stats(self) -> dict[str, int]:
        return {"steps": 3}


def test_a_port_in_use_warns_once_and_never_raises(
    caplog: pytest.LogCaptureFixture, plugin_log: Callable[[], list[logging.LogRecord]]
) -> None:
    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError):
            MetricsServer(dict, host=HOST, port=port)
        caplog.set_level(logging.INFO, logger=LOGGER_NAME)
        holder = Holder()
        assert start_exporter(options(metrics_port=port), holder.stats, vllm_config=None, tp_rank=lambda: 0) is None
    warnings = [r for r in plugin_log() if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"cannot listen on {HOST}:{port}" in warnings[0].getMessage()


def test_the_endpoint_closes_when_its_proposer_is_collected() -> None:
    import gc

    holder = Holder()
    server = start_exporter(options(metrics_port=free_port()), holder.stats, vllm_config=None, tp_rank=lambda: 0)
    assert server is not None
    del holder
    gc.collect()
    assert server.stopped.wait(timeout=60) and not server.thread.is_alive()
    assert port_free(server.port)


def port_free(port: int) -> bool:
    """Whether nothing listens on ``port`` (a closed server's connections may linger in TIME_WAIT: reused)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
            s.listen()
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- options
def test_metrics_options_are_validated() -> None:
    _, opts = split_speculative_config({"method": "specdec", "metrics_port": 9464, "metrics_host": "0.0.0.0"})
    assert (opts.metrics_port, opts.metrics_host) == (9464, "0.0.0.0")
    assert options().metrics_port == 0 and options().metrics_host == HOST
    with pytest.raises(ConfigError, match=r"metrics_port=70000 is out of range: must be in \[0, 65535\]"):
        split_speculative_config({"method": "specdec", "metrics_port": 70000})
    with pytest.raises(ConfigError, match="metrics_host='my-host' is not an IP address: use '127.0.0.1'"):
        split_speculative_config({"method": "specdec", "metrics_host": "my-host"})
    with pytest.raises(ConfigError, match="metrics_port='9464' has the wrong type"):
        split_speculative_config({"method": "specdec", "metrics_port": "9464"})


# --------------------------------------------------------------------------- the drafter's gauges
class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def one_step(core: ProposerCore, rid: str, tokens: list[int], new: int) -> list[list[int]]:
    ids = np.zeros((1, 256), np.int32)
    ids[0, : len(tokens)] = tokens
    return core.step(StepBatch([rid], [tokens[-new:] if new else []], np.array([len(tokens)], np.int32), ids))


@pytest.mark.skipif(not native_available(), reason="the native suffix core is not built")
def test_drafter_gauges_are_sampled_between_steps_at_most_once_a_period() -> None:
    clock = Clock()
    drafter = SuffixDrafter(backend="native", max_cached_requests=7, max_cached_tokens=500)
    opts = options(num_speculative_tokens=4, draft_timeout_ms=0, adaptive=False)
    core = ProposerCore(drafter, opts, max_model_len=256, clock=clock)
    seq = [5, 6, 7, 8] * 10
    one_step(core, "a", seq[:20], 1)  # starts "a" (first sample: nothing cached yet)
    first = core.stats_dict()["drafter_state"]
    assert first["global_cache_requests"] == 0 and first["global_cache_max_requests"] == 7
    assert first["global_cache_max_tokens"] == 500 and first["memory_bytes"] > 0
    one_step(core, "b", seq[:10], 1)  # "a" absent: stopped, its response cached; within the period: no sample
    assert core.stats_dict()["drafter_state"] == first
    clock.t += SAMPLE_PERIOD_S
    one_step(core, "b", seq[:11], 1)
    now = core.stats_dict()["drafter_state"]
    assert now == drafter_gauges(drafter) and now["global_cache_requests"] == 1 and now["global_cache_tokens"] > 0


@pytest.mark.skipif(not native_available(), reason="the native suffix core is not built")
def test_thread_mode_never_reads_the_drafter_while_a_lane_job_may_run() -> None:
    clock = Clock()
    opts = options(num_speculative_tokens=4, draft_timeout_ms=0, adaptive=False)
    core = ThreadedProposerCore(SuffixDrafter(backend="native"), opts, max_model_len=256, clock=clock)
    ids = np.zeros((1, 256), np.int32)
    ids[0, :8] = [1, 2, 3, 1, 2, 3, 1, 2]
    core.submit(StepBatch(["a"], [[2]], np.array([8], np.int32), ids))
    assert not core._drafter_idle()  # submitted, not collected
    assert core.collect() is not None and core._drafter_idle()
    assert core.stats_dict()["drafter_state"]["memory_bytes"] > 0


# --------------------------------------------------------------------------- the proposer, end to end
def test_a_proposer_serves_its_own_counters_while_it_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("specdec.vllm_plugin.proposer._tp_rank", lambda: 0)
    port = free_port()
    spec = {"draft_timeout_ms": 0, "adaptive": False, "async": False, "metrics_port": port}
    cfg = SimpleNamespace(
        additional_config={"specdec": spec},
        speculative_config=SimpleNamespace(num_speculative_tokens=4),
        model_config=SimpleNamespace(max_model_len=256),
    )
    prop = SpecdecProposer(cfg, patch_runner=False)  # the default drafter, suffix
    try:
        assert prop.exporter is not None and prop.exporter.port == port
        url = prop.exporter.url
        before = get(url)[2]
        assert sample_value(before, "specdec_steps_total") == "0"
        assert 'drafter="suffix"' in before and 'async_mode="off"' in before
        ids = np.zeros((1, 256), np.int32)
        seq = [4, 5, 6, 7] * 8
        for n in range(8, 20):
            ids[0, :n] = seq[:n]
            prop.bind_step(SimpleNamespace(req_ids=["r"], num_prompt_tokens=np.array([8])))
            prop.propose([[seq[n - 1]]], np.array([n], np.int32), ids)
        after = get(url)[2]
        s = prop.core.stats
        assert sample_value(after, "specdec_steps_total") == str(s.steps) == "12"
        assert sample_value(after, "specdec_drafted_tokens_total") == str(s.drafted_tokens) != "0"
        assert sample_value(after, "specdec_active_requests") == "1"
        assert int(sample_value(after, "specdec_drafter_memory_bytes") or 0) > 0
    finally:
        prop.close()
    assert port_free(port)  # closed with the proposer
