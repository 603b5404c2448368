"""The py-spy aggregation (benchmarks/pyspy_profile.py) on hand-written raw stacks."""

from __future__ import annotations

from benchmarks.pyspy_profile import aggregate, frame_key, main, markdown, parse_line

LOOP = "EngineCoreProc.run_busy_loop (/x/vllm/v1/engine/core.py:900)"
RAW = [
    f"thread (1): MainThread;{LOOP};execute_model (/x/gpu_model_runner.py:10);forward (/x/llama.py:5) 6\n",
    f"thread (1): MainThread;{LOOP};execute_model (/x/gpu_model_runner.py:12);_prepare (/x/gpu_model_runner.py:40) 3\n",
    f"thread (1): MainThread;{LOOP};schedule (/x/scheduler.py:7) 1\n",
    "thread (1): MainThread;load_model (/x/loader.py:3) 50\n",  # start-up: not in the busy loop
    "thread (2): tqdm;wait (/x/threading.py:1) 40\n",
    "\n",
    "garbage\n",
]


def test_frame_key_drops_path_and_line() -> None:
    assert frame_key("execute_model (/a/b/gpu_model_runner.py:123)") == "execute_model (gpu_model_runner.py)"
    assert frame_key("<module> (<frozen runpy>:88)") == "<module> (<frozen runpy>)"
    assert frame_key("thread_name") == "thread_name"


def test_parse_line_strips_thread_and_count() -> None:
    frames, n = parse_line("thread (7): Main;a (f.py:1);b (g.py:2) 12\n")
    assert frames == ["a (f.py:1)", "b (g.py:2)"] and n == 12
    assert parse_line("\n") is None and parse_line("no-count-here\n") is None


def test_aggregate_counts_only_the_busy_loop() -> None:
    prof = aggregate(RAW)
    assert prof.total == 100 and prof.busy == 10
    # two lines of execute_model at different lines merge into one function entry
    assert prof.inclusive["execute_model (gpu_model_runner.py)"] == 9
    assert prof.inclusive["forward (llama.py)"] == 6
    assert "load_model (loader.py)" not in prof.inclusive
    assert prof.share(prof.inclusive["schedule (scheduler.py)"]) == 10.0
    assert not any("run_busy_loop" in k for k in prof.inclusive)  # frames around the loop are left out
    assert prof.leaves.most_common(1)[0] == ("forward (llama.py) <- execute_model (gpu_model_runner.py)", 6)


def test_recursion_counts_once_per_sample() -> None:
    prof = aggregate([f"thread (1): M;{LOOP};f (a.py:1);f (a.py:1);g (a.py:2) 4\n"])
    assert prof.inclusive["f (a.py)"] == 4 and prof.busy == 4


def test_markdown_and_cli(tmp_path, capsys) -> None:
    text = markdown(aggregate(RAW), label="specdec", top=1)
    assert text.startswith("## specdec: engine busy loop, 10 of 100 samples")
    assert "| 90.0 | `execute_model (gpu_model_runner.py)` |" in text
    raw = tmp_path / "raw.txt"
    raw.write_text("".join(RAW))
    out = tmp_path / "p.md"
    main([str(raw), "--label", "x", "--out", str(out)])
    assert out.read_text().startswith("## x: engine busy loop, 10 of 100 samples")
    main([str(raw)])
    assert "raw.txt" in capsys.readouterr().out
