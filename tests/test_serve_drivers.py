"""The served-path drivers (serve_bench, serve_features, serve_soak) against benchmarks.serve_fake, a stand-in for
the `vllm` CLI (an OpenAI-compatible HTTP server on 127.0.0.1, an ephemeral port, that stops by itself) — no vLLM."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest

from benchmarks import serve_bench, serve_features, serve_inputs, serve_soak, serve_soak_load
from benchmarks.serve_bench_client import BenchClient
from benchmarks.serve_bench_runs import bench_flags
from benchmarks.serve_common import (
    VLLM_CLI_ENV,
    Budget,
    ServeError,
    Server,
    free_port,
    parse_methods,
    parse_metrics,
    spec_config,
    spec_delta,
    with_metrics_port,
)

FAKE_CLI = f"{sys.executable} -m benchmarks.serve_fake"
METRICS_TEXT = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 80.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 15.0
vllm:num_requests_running{model_name="m"} 3.0
"""


@pytest.fixture
def fake_cli(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(VLLM_CLI_ENV, FAKE_CLI)
    return FAKE_CLI


@pytest.fixture
def pools_file(tmp_path: Path) -> Path:
    pools = {
        name: [{"prompt": f"<|endoftext|>{name} prompt {i} " * 3, "output_tokens": 4 + i % 3} for i in range(40)]
        for name in serve_inputs.POOLS
    }
    path = tmp_path / "pools.json"
    serve_inputs.write_pools(path, pools, {"test": True})
    return path


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read()


# --------------------------------------------------------------------------- pure pieces
def test_parse_metrics_sums_label_sets_and_skips_comments() -> None:
    m = parse_metrics(METRICS_TEXT)
    assert m["vllm:spec_decode_num_drafts_total"] == 20.0
    assert m["vllm:num_requests_running"] == 3.0
    assert not any(k.startswith("#") for k in m)


def test_by_label_sums_a_metric_per_label_value() -> None:
    from benchmarks.serve_common import by_label

    text = METRICS_TEXT + (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",position="0"} 5.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1",engine="0"} 7.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m"} 99.0\n'  # no position: skipped
    )
    assert by_label(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position") == {"0": 20.0, "1": 7.0}
    assert by_label(text, "vllm:spec_decode_num_drafts_total", "engine") == {"0": 10.0, "1": 10.0}
    assert by_label(text, "vllm:spec_decode_num_drafts_total", "gine") == {}  # a label name, not a suffix of one


def test_spec_delta_by_hand() -> None:
    before = parse_metrics(METRICS_TEXT)
    after = {
        **before,
        "vllm:spec_decode_num_drafts_total": 30.0,
        "vllm:spec_decode_num_draft_tokens_total": 120.0,
        "vllm:spec_decode_num_accepted_tokens_total": 50.0,
    }
    d = spec_delta(before, after)
    assert (d["drafts"], d["draft_tokens"], d["accepted_tokens"]) == (10.0, 40.0, 20.0)
    assert d["acceptance"] == pytest.approx(0.5)
    assert d["emitted_per_step"] == pytest.approx(3.0)
    assert spec_delta({}, {})["emitted_per_step"] == 0.0


def test_methods_and_rates() -> None:
    assert spec_config("nospec") is None
    assert spec_config("hybrid", "/d") == {"method": "specdec", "drafter": ["suffix", "model"], "draft_model": "/d"}
    with pytest.raises(ServeError, match="unknown method 'eagle'"):
        parse_methods("nospec,eagle")
    sat = {"code": {"rate": 8.0}}
    assert serve_bench.parse_rates("0.25R,inf,3", sat, "code") == [("0.25R", 2.0), ("inf", "inf"), ("3", 3.0)]
    with pytest.raises(ServeError, match="needs the saturation rate"):
        serve_bench.parse_rates("0.5R", {}, "code")
    assert serve_bench.parse_rates("R", sat, "code") == [("R", 8.0)]
    # a rate given again runs again (fresh server, then after the others): its label is numbered
    assert serve_bench.parse_rates("inf,0.5R,inf,inf", sat, "code") == [
        ("inf", "inf"), ("0.5R", 4.0), ("inf#2", "inf"), ("inf#3", "inf")
    ]  # fmt: skip


def test_a_repeated_rate_is_reported_and_plotted(tmp_path) -> None:
    """Three runs at ``inf`` on the same servers (``--rates inf,...,inf,inf``): the JSON, table and PNG are written,
    and the goal is the median of the three paired ratios (each repeat against the same repeat of no speculation)."""
    pytest.importorskip("matplotlib")
    from benchmarks.serve_report import write_outputs

    def run(method: str, label: str, tpot: float) -> dict:
        bench = {"p50_tpot_ms": tpot, "output_throughput": 1000.0 / tpot, "p99_ttft_ms": 1.0, "p99_itl_ms": 1.0}
        return {"method": method, "dataset": "random", "rate_label": label, "rate": "inf", "bench": bench, "spec": {}}

    doc = {"runs": [run("nospec", "inf", 6.0), run("specdec", "inf", 7.2), run("nospec", "inf#2", 6.0),
                    run("specdec", "inf#2", 9.0), run("nospec", "inf#3", 8.0), run("specdec", "inf#3", 8.0),
                    run("specdec", "inf#4", 60.0)],  # no nospec run to pair with: not counted
           "errors": [], "skipped": [], "settings": {}}  # fmt: skip
    paths = write_outputs(doc, tmp_path, "rep")
    assert Path(paths["png"]).exists()
    saved = json.loads(Path(paths["json"]).read_text())
    (tpot,) = [
        g for g in saved["goals"] if (g["dataset"], g["rate"], g["goal"]) == ("random", "inf", "TPOT p50 x nospec")
    ]
    assert tpot["repeats"] == pytest.approx([1.2, 1.5, 1.0])
    assert tpot["ratio"] == pytest.approx(1.2) and tpot["verdict"] == "FAIL"
    md = Path(paths["md"]).read_text()
    assert "inf#2" in md and "1.200 (1.200 / 1.500 / 1.000)" in md


def test_a_finite_rate_sends_at_most_max_arrival_s_of_requests() -> None:
    from benchmarks.serve_bench_runs import arrivals_capped

    args = argparse.Namespace(num_prompts=200, max_arrival_s=60.0)
    assert arrivals_capped(args, 2.5) == 150  # 60 s at 2.5 requests/s
    assert arrivals_capped(args, 20.0) == 200  # --num-prompts bounds it
    assert arrivals_capped(args, 0.001) == 1  # at least one
    assert arrivals_capped(args, "inf") == 200  # all at once: every prompt
    assert arrivals_capped(argparse.Namespace(num_prompts=200, max_arrival_s=0.0), 2.5) == 200  # 0: no cap


def test_a_run_the_worker_fails_goes_through_the_cli_and_so_do_the_rest(
    fake_cli: str, pools_file: Path, tmp_path: Path
) -> None:
    """The worker answers rc 1: that run is made again by the CLI, its worker log kept beside; the client is retired
    for every holder of it, so the next run goes straight to the CLI."""

    class Failing(BenchClient):
        def run(self, flags: list[str], *, log: Path, timeout_s: float) -> int:
            self.calls = getattr(self, "calls", 0) + 1
            log.write_text("in-process failure\n")
            return 1

    srv = Server("m", port=free_port(), log=tmp_path / "s.log", spec={"method": "specdec"}).start(60)
    client = Failing("fake")
    args = argparse.Namespace(vllm_cli="", model="m", out_dir=str(tmp_path), pools=serve_inputs.load_pools(pools_file))
    args.__dict__.update(num_prompts=3, temperature=0.0, ignore_eos=False, bench_client=client)
    copy = argparse.Namespace(**vars(args))  # as a lane or the methods after the search hold it
    try:
        first = serve_bench.bench_once(args, srv, dataset="code", slice_index=1, rate="inf", budget=Budget(60))
        second = serve_bench.bench_once(copy, srv, dataset="code", slice_index=2, rate="inf", budget=Budget(60))
    finally:
        srv.stop()
    assert [r["bench"]["completed"] for r in (first, second)] == [3, 3] and client.calls == 1
    assert not client.usable and client.proc is None
    kept = sorted(p.name for p in (tmp_path / "work").glob("*.in-process.log"))
    assert kept == [f"{srv.port}-code-1.bench.in-process.log"]


def test_random_traffic_samples_at_the_servers_default_temperature(tmp_path: Path) -> None:
    """vLLM's random prompts go without --temperature (the server's default: low acceptance, as a user's first run);
    the pools' prompts carry --temperature."""
    args = argparse.Namespace(model="m", temperature=0.0, ignore_eos=False)
    kw = {"port": 1, "num": 3, "rate": "inf", "seed": 1, "result": tmp_path / "r.json"}
    rand = bench_flags(args, dataset="random", rows_file=None, **kw)
    code = bench_flags(args, dataset="code", rows_file=tmp_path / "c.jsonl", **kw)
    assert "--temperature" not in rand and "random" in rand
    assert code[code.index("--temperature") + 1] == "0.0"


def test_rate_slices_are_disjoint_and_bounded() -> None:
    rows = [{"prompt": str(i)} for i in range(10)]
    a, b = (serve_inputs.rate_slice(rows, k, 4, pool="p") for k in (0, 1))
    assert {r["prompt"] for r in a}.isdisjoint(r["prompt"] for r in b)
    with pytest.raises(ServeError, match="pool 'p' has 10 prompts; slice 2 of 4 needs 12"):
        serve_inputs.rate_slice(rows, 2, 4, pool="p")


def test_soak_plan_mixes_modes() -> None:
    reqs = serve_soak_load.plan(["a", "b"], 2000, cancel_share=0.05)
    cancels = sum(r["mode"] == "cancel" for r in reqs)
    assert 50 < cancels < 150  # 5% of 2,000, seeded
    assert {r["max_tokens"] for r in reqs} == set(serve_soak_load.SOAK_LENGTHS)


# --------------------------------------------------------------------------- the fake server
def test_fake_server_endpoints(fake_cli: str, tmp_path: Path) -> None:
    srv = Server("m", port=free_port(), log=tmp_path / "s.log", spec={"method": "specdec"}).start(60)
    try:
        plain = json.loads(_post(f"{srv.base_url}/v1/completions", {"prompt": "x", "max_tokens": 5, "temperature": 0}))
        assert plain["usage"]["completion_tokens"] == 5
        stream = _post(
            f"{srv.base_url}/v1/completions", {"prompt": "x", "max_tokens": 5, "temperature": 0, "stream": True}
        ).decode()
        chunks = [json.loads(ln[6:]) for ln in stream.splitlines() if ln.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
        assert stream.rstrip().endswith("data: [DONE]")
        with urllib.request.urlopen(f"{srv.base_url}/metrics") as r:
            m = parse_metrics(r.read().decode())
        assert m["vllm:spec_decode_num_drafts_total"] == 8.0  # one fake draft per token after the first (prefill's)
    finally:
        assert srv.stop() == 0  # SIGINT to the process group: a clean exit


# --------------------------------------------------------------------------- serve_bench
def test_bench_client_runs_every_rate_in_one_worker(fake_cli: str, pools_file: Path, tmp_path: Path) -> None:
    """The in-process `vllm bench serve` (fake runner here): one worker makes several runs through bench_once with
    the flags the subprocess would get; a run that fails answers rc 1 and the same worker makes the next one."""
    srv = Server("m", port=free_port(), log=tmp_path / "s.log", spec={"method": "specdec"}).start(60)
    client = BenchClient("fake")
    args = argparse.Namespace(
        vllm_cli="",
        model="m",
        out_dir=str(tmp_path),
        pools=serve_inputs.load_pools(pools_file),
        num_prompts=3,
        temperature=0.0,
        ignore_eos=False,
        bench_client=client,
    )
    try:
        runs = [
            serve_bench.bench_once(args, srv, dataset="code", slice_index=i, rate="inf", budget=Budget(60))
            for i in (1, 2)
        ]
        assert [r["bench"]["completed"] for r in runs] == [3, 3]
        assert runs[0]["spec"]["drafts"] > 0  # the deltas of /metrics around the run, as with the subprocess
        worker = client.proc
        log = tmp_path / "bad.log"
        assert client.run(["--port", str(free_port()), "--num-prompts", "1"], log=log, timeout_s=60) == 1
        assert "Traceback" in log.read_text() and client.proc is worker and worker.poll() is None
    finally:
        client.close()
        srv.stop()


def test_serve_bench_end_to_end(fake_cli: str, pools_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = serve_bench.main(
        [
            "run",
            "--methods",
            "nospec,specdec",
            "--datasets",
            "code,random",
            "--prompts",
            str(pools_file),
            "--num-prompts",
            "3",
            "--warmup-prompts",
            "2",
            "--rates",
            "0.5R,inf",
            "--saturation-rate",
            "4",
            "--out-dir",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads((out / "serve_bench-nospec-specdec.json").read_text())
    assert len(doc["runs"]) == 2 * 2 * 2 and not doc["errors"]
    spec = [r for r in doc["runs"] if r["method"] == "specdec"]
    assert all(r["spec"]["acceptance"] == pytest.approx(0.5) for r in spec)
    assert all(r["spec"]["drafts"] == 0 for r in doc["runs"] if r["method"] == "nospec")
    assert [r["rate"] for r in spec[:2]] == [2.0, "inf"]
    assert all(r["bench"]["completed"] == 3 and r["bench"]["failed"] == 0 for r in doc["runs"])
    table = (out / "serve_bench-nospec-specdec.md").read_text()
    assert "| specdec | 0.5R | 2.00 |" in table and "50.0%" in table
    # every code slice a server used is disjoint from its others (warm-up included)
    for port in {p.name.split("-")[0] for p in (out / "work").glob("*-code-*.jsonl")}:
        seen: list[str] = []
        for f in sorted((out / "work").glob(f"{port}-code-*.jsonl")):
            seen += [json.loads(line)["prompt"] for line in f.read_text().splitlines()]
        assert len(seen) == len(set(seen))


def test_serve_bench_lanes_run_methods_at_once_each_on_its_gpu(fake_cli: str, pools_file: Path, tmp_path: Path) -> None:
    """--lanes 2: the two methods' servers run at once, each with its own CUDA_VISIBLE_DEVICES and, where taskset
    exists, its own half of the cores; the results are the same runs as one after another, lane by lane."""
    out = tmp_path / "out"
    argv = ["run", "--methods", "nospec,specdec", "--datasets", "code", "--prompts", str(pools_file)]
    argv += ["--num-prompts", "3", "--warmup-prompts", "0", "--rates", "inf", "--out-dir", str(out), "--lanes", "2"]
    assert serve_bench.main(argv) == 0
    doc = json.loads((out / "serve_bench-nospec-specdec.json").read_text())
    assert [r["method"] for r in doc["runs"]] == ["nospec", "specdec"] and not doc["errors"]
    lanes = doc["settings"]["lanes"]
    assert [(ln["methods"], ln["gpu"]) for ln in lanes] == [(["nospec"], "0"), (["specdec"], "1")]
    if shutil.which("taskset") and len(os.sched_getaffinity(0)) >= 2:
        assert all(ln["cli"].startswith("taskset -c ") for ln in lanes)
    one = serve_bench.method_lanes(argparse.Namespace(methods=["nospec", "specdec"], lanes=1, vllm_cli=""))
    assert [m for _, m in one] == [["nospec", "specdec"]]


def test_serve_bench_saturation_then_report(fake_cli: str, pools_file: Path, tmp_path: Path) -> None:
    rc = serve_bench.main(
        [
            "find-saturation",
            "--datasets",
            "code",
            "--prompts",
            str(pools_file),
            "--num-prompts",
            "3",
            "--warmup-prompts",
            "0",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    sat = json.loads((tmp_path / "saturation.json").read_text())["saturation"]["code"]
    ladder_rates = [p["rate"] for p in sat["ladder"]]
    want = [f * sat["capacity_req_s"] for f in serve_bench.SATURATION_LADDER]
    assert len(ladder_rates) >= 1 and ladder_rates == pytest.approx(want[: len(ladder_rates)])  # from the top down
    assert sat["rate"] in ladder_rates or sat["rate"] == sat["capacity_req_s"]


def test_serve_bench_auto_saturation_runs_nospec_on_the_search_server(
    fake_cli: str, pools_file: Path, tmp_path: Path
) -> None:
    """--saturation-rate auto: no speculation's rates run on the server that found R (no second start), on prompts
    the search never sent; the other methods get servers of their own."""
    out = tmp_path / "out"
    argv = ["run", "--methods", "nospec,specdec", "--datasets", "code", "--prompts", str(pools_file)]
    argv += ["--num-prompts", "3", "--warmup-prompts", "2", "--rates", "0.5R,inf", "--saturation-rate", "auto"]
    assert serve_bench.main([*argv, "--out-dir", str(out)]) == 0
    doc = json.loads((out / "serve_bench-nospec-specdec.json").read_text())
    assert [r["method"] for r in doc["runs"]] == ["nospec", "nospec", "specdec", "specdec"] and not doc["errors"]
    assert doc["runs"][0]["rate"] == pytest.approx(0.5 * doc["saturation"]["code"]["rate"])
    logs = sorted(p.name for p in out.glob("server-*.log"))
    assert logs == ["server-nospec-saturation.log", "server-specdec-code-0.log"]
    nospec_port = doc["runs"][0]["command"][doc["runs"][0]["command"].index("--port") + 1]
    sent: dict[bool, list[str]] = {True: [], False: []}  # by "the search sent it": its slices, the others
    for f in (out / "work").glob(f"{nospec_port}-code-*.jsonl"):
        searched = int(f.stem.split("-")[-1]) in serve_bench.SATURATION_SLICES
        sent[searched] += [json.loads(line)["prompt"] for line in f.read_text().splitlines()]
    assert sent[True] and len(sent[False]) == 2 + 3 + 3  # warm-up, then both rates
    assert len(set(sent[False])) == len(sent[False]) and not set(sent[False]) & set(sent[True])


def test_saturation_is_the_smallest_rate_that_holds_the_throughput() -> None:
    ladder = [{"rate": 12.5, "output_throughput": 990}, {"rate": 10, "output_throughput": 960}]
    assert serve_bench.saturation_rate(ladder, 950, 10) == 10
    ladder.append({"rate": 7.5, "output_throughput": 700})  # fell short: the ladder stopped here
    assert serve_bench.saturation_rate(ladder, 950, 10) == 10
    assert serve_bench.saturation_rate([{"rate": 12.5, "output_throughput": 900}], 950, 10) == 10  # none: C


def test_serve_bench_dead_server_is_one_line_naming_the_log(
    monkeypatch: pytest.MonkeyPatch, pools_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv(VLLM_CLI_ENV, f"{FAKE_CLI} --fail-start")
    rc = serve_bench.main(
        [
            "run",
            "--methods",
            "specdec",
            "--datasets",
            "code",
            "--prompts",
            str(pools_file),
            "--rates",
            "inf",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert rc == 1
    err = json.loads((tmp_path / "serve_bench-specdec.json").read_text())["errors"][0]["error"]
    assert "server exited with code 1 before /health answered" in err and "server-specdec" in err
    assert "simulated start-up failure" in err and "\n" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--methods", "nospec,eagle"], "unknown method 'eagle'"),
        (["--datasets", "code,poems"], "unknown dataset 'poems'"),
        (["--rates", "0.5R"], "are relative to R"),
        (["--rates", "fast", "--saturation-rate", "3"], "rate 'fast' is not a number"),
    ],
)
def test_serve_bench_bad_input(
    args: list[str], message: str, pools_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base = ["run", "--prompts", str(pools_file), "--out-dir", str(tmp_path), "--rates", "inf"]
    if "--methods" not in args:  # not the hybrid: its draft model is in ../shared, which a fresh clone may lack
        base += ["--methods", "nospec,specdec"]
    if "fast" in args:
        base.remove("inf"), base.remove("--rates")
    assert serve_bench.main(base + args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_dataset_file_without_prompts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"pools": {"code": []}}))
    assert (
        serve_bench.main(
            ["run", "--prompts", str(empty), "--datasets", "code", "--rates", "inf", "--methods", "nospec"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "pool 'code' has no prompts" in err and str(empty) in err and len(err.splitlines()) == 1
    missing = tmp_path / "nope.json"
    assert (
        serve_bench.main(
            ["run", "--prompts", str(missing), "--datasets", "code", "--rates", "inf", "--methods", "nospec"]
        )
        == 2
    )
    assert "serve_bench prepare" in capsys.readouterr().err


# --------------------------------------------------------------------------- serve_features, serve_soak
def test_serve_features_against_fakes(fake_cli: str, pools_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("openai")
    feats = "streaming,stop,max_tokens_1,top_k_1,top_p_small,n2,logprobs,long_prompt,json_schema,cancel_stream,sampling"
    rc = serve_features.main(["--prompts", str(pools_file), "--features", feats, "--out-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "serve_features.json").read_text())
    assert rc == 0, doc
    assert list(doc["modes"]) == list(serve_features.MODES)
    for mode, res in doc["modes"].items():
        assert [k for k in res if k != "exit_codes"] == feats.split(",")
        own = {k: v for k, v in res.items() if k not in ("exit_codes", "max_tokens_1", "sampling")}
        assert all(f["spec"]["accepted_tokens"] > 0 and f["ok"] for f in own.values()), own
        assert res["max_tokens_1"]["draft_step"] is False and res["max_tokens_1"]["ok"]
        assert res["exit_codes"] == {f"features-spec-{mode}": 0}
        for r in res["sampling"]["per_prompt"]:  # the fake samples words from fixed weights, its logprobs say them
            assert r["p"] > serve_features.P_MIN and r["p_control"] > serve_features.P_MIN, r
            assert r["p_biased"] <= serve_features.P_MIN and r["power"] >= 0.99 and r["accepted_share"] >= 0.3, r
    assert doc["exit_codes"] == {"features-ref": 0, "features-peer": 0}


def test_serve_features_unknown_feature(capsys: pytest.CaptureFixture) -> None:
    assert serve_features.main(["--features", "streaming,telepathy"]) == 2
    assert "unknown feature 'telepathy'" in capsys.readouterr().err
    assert serve_features.main(["--modes", "thread,warp"]) == 2
    assert "unknown mode 'warp': use one of thread, schedule" in capsys.readouterr().err
    assert serve_soak.main(["--modes", "warp"]) == 2  # the same check, before any server starts
    assert "unknown mode 'warp'" in capsys.readouterr().err


def test_serve_soak_baseline_soaks_no_speculation_beside_and_answers_the_comparison(
    fake_cli: str, pools_file: Path, tmp_path: Path
) -> None:
    pytest.importorskip("openai")
    argv = ["--prompts", str(pools_file), "--spec", SOAK_SPEC, "--modes", "thread", "--baseline"]
    argv += ["--requests", "40", "--concurrency", "4", "--sample-s", "0.05", "--max-cached-requests", "10"]
    rc = serve_soak.main([*argv, "--compare", "6", "--out-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "serve_soak.json").read_text())
    assert rc == 0 and list(doc["modes"]) == ["thread", "nospec"], doc
    base = doc["modes"]["nospec"]
    assert base["speculative_config"] is None and base["spec"]["draft_tokens"] == 0 and base["failed"] == 0
    itl = doc["modes"]["thread"]["itl"]
    assert itl["ok"] and itl["ok_absolute"] and itl["baseline_gaps"] > 0
    # the baseline answered the greedy requests as the reference (no row of its own)
    assert set(doc["greedy_vs_nospec"]["methods"]) == {"specdec-thread", "ngram"}
    assert doc["greedy_vs_nospec"]["methods"]["specdec-thread"]["differ"] == 0


# the fake streams at once: a deadline of a minute keeps the ITL check off the machine's timing
SOAK_SPEC = '{"method": "specdec", "draft_timeout_ms": 60000}'


def test_serve_soak_against_fake(fake_cli: str, pools_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("openai")
    argv = ["--prompts", str(pools_file), "--spec", SOAK_SPEC, "--requests", "120", "--concurrency", "8"]
    argv += ["--sample-s", "0.05", "--max-cached-requests", "30", "--compare", "12", "--out-dir", str(tmp_path)]
    rc = serve_soak.main([*argv, "--faults", "raise:10,sleep:7"])
    doc = json.loads((tmp_path / "serve_soak.json").read_text())
    assert rc == 0 and doc["pass"], doc
    assert list(doc["modes"]) == list(serve_soak.MODES)
    planned = sum(r["mode"] == "cancel" for r in serve_soak_load.plan(["x"], 120, cancel_share=0.05))
    for mode, d in doc["modes"].items():
        config = d["speculative_config"]
        assert config["async_mode"] == mode and config["drafter_options"]["suffix"]["max_cached_requests"] == 30
        assert (d["failed"], d["cancelled"], d["ok"]) == (0, planned, 120 - planned)
        assert d["spec"]["accepted_tokens"] > 0 and d["server_exit_code"] == 0
        assert d["cap_reached_s"] is not None and d["plugin_cache"]["specdec_global_cache_max_requests"] == 30
        assert len(d["samples"]) >= 2 and d["itl"]["gaps"] > 0 and d["itl"]["ok"]
        # the fake's statistics follow vLLM's spec-decode counters: the run's growth of each must match
        assert d["plugin_metrics_url"].startswith("http://127.0.0.1:") and d["plugin_metrics_error"] == ""
        delta = d["plugin_delta"]
        assert delta["specdec_drafted_tokens_total"] > 0 and delta["specdec_accepted_tokens_total"] > 0
        # injected faults: every one handled, one log line per kind
        for kind in ("raise", "sleep"):
            f = d["faults"][kind]
            assert f["injected"] > 0 and f["handled"] == f["injected"] and f["log_lines"] == 1, f
    greedy = doc["greedy_vs_nospec"]
    assert greedy["ok"] and set(greedy["methods"]) == {"specdec-thread", "specdec-schedule", "ngram"}
    assert all(r["compared"] == 12 and r["differ"] == 0 for r in greedy["methods"].values())


def test_serve_soak_fails_when_the_cap_is_never_reached(fake_cli: str, pools_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("openai")
    argv = ["--prompts", str(pools_file), "--spec", SOAK_SPEC, "--requests", "20", "--concurrency", "4"]
    argv += ["--modes", "thread", "--compare", "0", "--sample-s", "0.05", "--out-dir", str(tmp_path)]
    assert serve_soak.main(argv) == 1  # the cap of 1,000 responses is far above 20 requests
    d = json.loads((tmp_path / "serve_soak.json").read_text())["modes"]["thread"]
    assert d["cap_reached_s"] is None and not d["pass"] and d["failed"] == 0


def test_with_metrics_port_only_for_specdec_configs() -> None:
    assert with_metrics_port(None, -1) == (None, 0)
    assert with_metrics_port({"method": "suffix"}, -1) == ({"method": "suffix"}, 0)
    assert with_metrics_port({"method": "specdec"}, 0) == ({"method": "specdec"}, 0)
    assert with_metrics_port({"method": "specdec"}, 9464) == ({"method": "specdec", "metrics_port": 9464}, 9464)
    assert with_metrics_port({"method": "specdec", "metrics_port": 9000}, 0)[1] == 9000  # the spec's own wins
    spec, port = with_metrics_port({"method": "specdec"}, -1)
    assert port > 0 and spec == {"method": "specdec", "metrics_port": port}


def test_plugin_report_by_hand() -> None:
    before = {"specdec_steps_total": 10.0, "vllm:x_total": 1.0}
    after = {
        "specdec_steps_total": 25.0,
        "specdec_global_cache_tokens": 100.0,
        "specdec_global_cache_max_tokens": 100.0,
        "specdec_global_cache_requests": 3.0,
        "specdec_global_cache_max_requests": 2.0,
        "vllm:x_total": 5.0,
    }
    rep = serve_soak.plugin_report(before, after)
    assert rep["plugin_delta"] == {"specdec_steps_total": 15.0}
    assert rep["cache_within_cap"] is False  # 3 cached responses over a cap of 2
    assert serve_soak.plugin_report({}, {"specdec_steps_total": 1.0})["cache_within_cap"] is None


def test_serve_soak_unreachable_server(capsys: pytest.CaptureFixture, tmp_path: Path, pools_file: Path) -> None:
    port = free_port()  # nothing listens there
    assert (
        serve_soak.main(
            ["--prompts", str(pools_file), "--base-url", f"http://127.0.0.1:{port}", "--out-dir", str(tmp_path)]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert f"cannot reach http://127.0.0.1:{port}/health" in err and len(err.splitlines()) == 1


def test_serve_soak_faults_start_the_server_with_the_fault_variable(
    fake_cli: str, pools_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("openai")
    from specdec.vllm_plugin.faults import FAULTS_ENV

    envs: list[dict[str, str] | None] = []

    class Recording(Server):
        def __init__(self, *args, env=None, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
            envs.append(env)
            super().__init__(*args, env=env, **kwargs)

    monkeypatch.setattr(serve_soak, "Server", Recording)
    base = ["--prompts", str(pools_file), "--requests", "20", "--concurrency", "4", "--sample-s", "0.1"]
    base += ["--modes", "thread", "--compare", "0", "--max-cached-requests", "5", "--spec", SOAK_SPEC]
    assert serve_soak.main([*base, "--out-dir", str(tmp_path), "--faults", "raise:100"]) in (0, 1)
    assert envs == [{FAULTS_ENV: "raise:100"}]
    assert json.loads((tmp_path / "serve_soak.json").read_text())["settings"]["faults"] == "raise:100"
    assert serve_soak.main([*base, "--faults", "explode:3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--faults" in err[0] and "'explode:3'" in err[0]
    assert serve_soak.main([*base, "--faults", "sleep:5", "--base-url", "http://127.0.0.1:1"]) == 2
    assert "with --base-url" in capsys.readouterr().err and len(envs) == 1  # no server started for either


def test_serving_goals_judge_specdec_against_nospec_and_suffix_in_the_same_run() -> None:
    from benchmarks.serve_goals import goals, goals_markdown

    def run(method: str, dataset: str, label: str, tpot: float, tput: float) -> dict:
        bench = {"p50_tpot_ms": tpot, "p99_ttft_ms": 100.0, "p99_itl_ms": 20.0, "output_throughput": tput}
        return {"method": method, "dataset": dataset, "rate_label": label, "rate": 1.0, "bench": bench}

    runs = [
        run("nospec", "code", "0.5R", 10.0, 100.0), run("suffix", "code", "0.5R", 12.0, 100.0),
        run("specdec", "code", "0.5R", 8.0, 100.0),  # 8 / 12 = 0.667 of suffix's, 0.8 of nospec's: both pass
        run("nospec", "code", "inf", 10.0, 1000.0), run("suffix", "code", "inf", 9.0, 1200.0),
        run("specdec", "code", "inf", 8.0, 1100.0),  # above nospec's throughput, under suffix's: one fails
        run("nospec", "chat", "R", 10.0, 500.0), run("specdec", "chat", "R", 10.4, 490.0),  # 1.04 > 1.03: fails
        run("nospec", "random", "inf", 10.0, 500.0),  # specdec not measured there
    ]  # fmt: skip
    rows = {(r["dataset"], r["rate"], r["goal"]): r for r in goals({"runs": runs})}
    assert rows[("code", "0.5R", "TPOT p50 x suffix")]["verdict"] == "PASS"
    assert rows[("code", "0.5R", "TPOT p50 x suffix")]["ratio"] == pytest.approx(8 / 12)
    assert rows[("code", "0.5R", "TPOT p50 x nospec")]["verdict"] == "PASS"
    assert rows[("code", "0.5R", "ITL p99 x nospec")]["ratio"] == pytest.approx(1.0)
    assert rows[("code", "inf", "out tok/s x nospec")]["verdict"] == "PASS"
    assert rows[("code", "inf", "out tok/s x suffix")]["verdict"] == "FAIL"
    assert rows[("chat", "R", "TPOT p50 x nospec")]["verdict"] == "FAIL"
    assert rows[("chat", "R", "out tok/s x nospec")]["verdict"] == "PASS"  # 0.98 >= 0.97
    assert rows[("random", "inf", "TPOT p50 x nospec")]["verdict"] == "MISSING"  # never a pass without the run
    table = "\n".join(goals_markdown(list(rows.values())))
    assert "| code | inf | out tok/s x suffix | 0.917 | >= 1.00 | FAIL |" in table
    # every goal of the table is judged: agentic (no runs at all) and the rates not run are MISSING
    assert len(rows) == 2 * (3 * 4 + 2) + 2 * 5 * 2
    assert rows[("agentic", "0.25R", "TPOT p50 x suffix")]["verdict"] == "MISSING"
    assert "6 of 48 goals pass, 2 fail, 40 not measured." in table


def test_auto_saturation_searches_only_what_the_file_lacks(fake_cli: str, pools_file: Path, tmp_path: Path) -> None:
    """--saturation-rate auto with --saturation-file: the file's R stands for its datasets (no search run on them),
    the others are searched in the same call."""
    sat_file = tmp_path / "sat.json"
    sat_file.write_text(json.dumps({"saturation": {"code": {"rate": 7.0}}}))
    out = tmp_path / "out"
    argv = ["run", "--methods", "nospec", "--datasets", "code,agentic", "--prompts", str(pools_file)]
    argv += ["--num-prompts", "3", "--warmup-prompts", "0", "--rates", "0.5R", "--saturation-rate", "auto"]
    assert serve_bench.main([*argv, "--saturation-file", str(sat_file), "--out-dir", str(out)]) == 0
    doc = json.loads((out / "serve_bench-nospec.json").read_text())
    assert doc["saturation"]["code"] == {"rate": 7.0}
    assert "ladder" in doc["saturation"]["agentic"] and not doc["errors"]
    rates = {r["dataset"]: r["rate"] for r in doc["runs"]}
    assert rates == {"code": pytest.approx(3.5), "agentic": pytest.approx(0.5 * doc["saturation"]["agentic"]["rate"])}
    port = doc["runs"][0]["command"][doc["runs"][0]["command"].index("--port") + 1]
    searched = {
        f.stem.split("-")[1]
        for f in (out / "work").glob(f"{port}-*-*.jsonl")
        if int(f.stem.split("-")[-1]) in serve_bench.SATURATION_SLICES
    }
    assert searched == {"agentic"}


def test_serve_features_time_budget_skips_what_it_cannot_start(fake_cli: str, pools_file: Path, tmp_path: Path) -> None:
    """Past --time-budget-s (less serve_common.MARGIN_S) no spec server starts: each mode's features are recorded as
    not run, the reference servers stop, and the run is not ok."""
    pytest.importorskip("openai")
    argv = ["--prompts", str(pools_file), "--features", "streaming,stop", "--time-budget-s", "1"]
    assert serve_features.main([*argv, "--out-dir", str(tmp_path)]) == 1
    doc = json.loads((tmp_path / "serve_features.json").read_text())
    assert not doc["ok"] and list(doc["modes"]) == list(serve_features.MODES)
    for res in doc["modes"].values():
        assert {k: v["skipped"] for k, v in res.items()} == dict.fromkeys(
            ("streaming", "stop"), "not run: --time-budget-s ran out"
        )
    assert not list(tmp_path.glob("features-spec-*.log"))
    assert doc["exit_codes"] == {"features-ref": 0, "features-peer": 0}


def test_a_dying_servers_error_is_its_root_cause(tmp_path: Path) -> None:
    """vLLM's API server re-raises its engine's failure last; the message names the engine's own error (here: GPU
    memory another process holds), not the wrapper nor a warning that quotes an exception."""
    from benchmarks.serve_common import failure_line

    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=1) WARNING [system_utils.py:299] can cause `OSError: [Errno 24] Too many open files`\n"
        "(EngineCore pid=2) ERROR [core.py:1330] ValueError: Free memory on device cuda:0 (37.5/139.8 GiB) is less\n"
        "(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert failure_line(log) == "ValueError: Free memory on device cuda:0 (37.5/139.8 GiB) is less"
    log.write_text("INFO starting\nKilled\n\n")
    assert failure_line(log) == "Killed"
    assert failure_line(tmp_path / "absent.log") == "no log"
