"""specdec-eval curve: many settings in one replay equal one replay each; envelopes and comparisons by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specdec.drafters import build_drafter
from specdec.eval.cli import main
from specdec.eval.curve import group_settings, in_split, record_half, replay_settings
from specdec.eval.curve_report import compare, envelope, interpolate
from specdec.eval.records import TraceRecord
from specdec.eval.replay import replay
from specdec.eval.settings import Setting

COUNTS = ("steps", "drafted_tokens", "accepted_tokens", "emitted_tokens", "per_position_accepted", "records")


def _records(seed: int = 0, n: int = 12) -> list[TraceRecord]:
    rng = np.random.default_rng(seed)
    motifs = [rng.integers(0, 30, size=int(rng.integers(4, 12))) for _ in range(4)]
    out = []
    for i in range(n):
        parts = [motifs[int(rng.integers(0, 4))] if rng.random() < 0.6 else rng.integers(0, 30, 5) for _ in range(8)]
        seq = np.concatenate(parts)
        cut = int(rng.integers(3, 20))
        out.append(TraceRecord(f"r{i}", seq[:cut], seq[cut:]))
    return out


@pytest.mark.parametrize("backend", ["python", "native"])
def test_one_replay_per_setting_equals_shared_replay(backend: str) -> None:
    records = _records()
    settings = [
        Setting(("suffix",), {"suffix": {"max_spec_factor": f, "min_token_prob": p, "backend": backend}}, b)
        for f, p, b in [(0.5, 0.1, 16), (1.0, 0.3, 4), (8.0, 0.0, 16), (2.0, 0.2, 1)]
    ]
    configs = [build_drafter("suffix", s.options).config for s in settings]
    shared = replay_settings(build_drafter("suffix", settings[0].options), configs, settings, records)
    for s, got in zip(settings, shared):
        want = replay(build_drafter("suffix", s.options), records, budget=s.budget, tree=False)
        for key in COUNTS:
            assert getattr(got, key) == getattr(want, key), (s.label, key)
        assert got.per_record_mat == want.per_record_mat


def test_split_counts_its_half_and_both_halves_add_up() -> None:
    records = _records(seed=3, n=16)
    s = Setting(("suffix",), {"suffix": {"backend": "python"}}, 8)
    cfg = [build_drafter("suffix", s.options).config]
    halves = {
        h: replay_settings(build_drafter("suffix", s.options), cfg, [s], records, split=h)[0] for h in ("even", "odd")
    }
    whole = replay_settings(build_drafter("suffix", s.options), cfg, [s], records)[0]
    assert halves["even"].records == sum(record_half(r.id) == "even" for r in records)
    for key in ("steps", "drafted_tokens", "accepted_tokens", "records"):
        assert getattr(halves["even"], key) + getattr(halves["odd"], key) == getattr(whole, key)


def test_record_half_is_sha1_parity() -> None:
    # the last bytes of sha1("0") .. sha1("4"): 0c, ab, b0, bb, 7a
    assert [record_half(str(i)) for i in range(5)] == ["even", "odd", "even", "odd", "even"]
    assert in_split("4", "even") and not in_split("4", "odd") and in_split("4", "all")


def test_groups_share_a_drafter_only_across_draft_options() -> None:
    s = [
        Setting(("suffix",), {"suffix": {"max_depth": 32, "min_token_prob": 0.1}}),
        Setting(("suffix",), {"suffix": {"max_depth": 32, "min_token_prob": 0.3}}, 4),
        Setting(("suffix",), {"suffix": {"max_depth": 64}}),
        Setting(("suffix", "ngram")),
    ]
    groups = group_settings(s, lambda n: frozenset({"min_token_prob"}))
    assert groups == [[0, 1], [2], [3]]


def test_envelope_interpolation_and_ratio_by_hand() -> None:
    pts = [(1.0, 1.2), (2.0, 1.5), (2.0, 1.4), (3.0, 1.45), (4.0, 1.8), (0.5, 1.3), (5.0, 1.7), (1.5, 1.45)]
    env = envelope(pts)
    # (1, 1.2), (3, 1.45) and (2, 1.4) are beaten by cheaper points; (2, 1.5) lies below the chord from (1.5, 1.45)
    # to (4, 1.8) (1.52 at x = 2); (5, 1.7) is past the highest MAT
    assert env == [(0.5, 1.3), (1.5, 1.45), (4.0, 1.8)]
    assert interpolate(env, 3.0) == pytest.approx(1.45 + 0.35 * 1.5 / 2.5)
    assert interpolate(env, 0.4) is None and interpolate(env, 4.5) is None
    table = {"d": {"a": {"settings": 6, "envelope": env}, "b": {"settings": 1, "envelope": [(1.0, 1.1), (3.0, 1.5)]}}}
    rows = {r["drafter"]: r for r in compare(table, at=(2.0, 4.0), versus="b")}
    assert rows["a"]["mat@2"] == pytest.approx(1.52)
    assert rows["a"]["ratio@2"] == pytest.approx(1.52 / 1.3)
    assert rows["a"]["ratio@4"] is None  # 4 is outside b's curve
    assert rows["b"]["ratio@2"] == pytest.approx(1.0)


def test_curve_command_writes_table_json_png(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.jsonl"
    with path.open("w") as fh:
        for r in _records(seed=5, n=8):
            fh.write(json.dumps({"id": r.id, "prompt_ids": r.prompt_list(), "response_ids": r.response_list()}) + "\n")
    out = tmp_path / "out"
    argv = ["curve", str(path), "--tokenizer", "none", "--drafter", "suffix", "ngram", "--versus", "suffix"]
    argv += ["--grid", "suffix.min_token_prob=0.1,0.5", "--grid", "suffix.max_spec_factor=1,4"]
    assert main([*argv, "--out", str(out), "--no-progress", "--no-cache"]) == 0
    doc = json.loads((out / "curve.json").read_text())
    assert len(doc["results"]) == 4 + 16  # the suffix grid, ngram's default grid
    assert {r["drafter"] for r in doc["comparison"]} == {"suffix", "ngram"}
    assert (out / "curve.png").stat().st_size > 0 and "MAT@4" in capsys.readouterr().out


def test_labelled_curves_sweep_one_drafter_twice(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    with path.open("w") as fh:
        for r in _records(seed=6, n=6):
            fh.write(json.dumps({"id": r.id, "prompt_ids": r.prompt_list(), "response_ids": r.response_list()}) + "\n")
    out = tmp_path / "out"
    argv = ["curve", str(path), "--tokenizer", "none", "--drafter", "before=suffix", "suffix", "--versus", "before"]
    argv += ["--grid", "before.min_token_prob=0.1,0.5", "--grid", "suffix.min_confidence=0.01,0.3", "--no-plots"]
    assert main([*argv, "--option", "before.max_depth=16", "--out", str(out), "--no-progress", "--no-cache"]) == 0
    doc = json.loads((out / "curve.json").read_text())
    assert [r["curve"] for r in doc["results"]] == ["before", "before", "suffix", "suffix"]
    assert {r["options"]["suffix"].get("max_depth") for r in doc["results"][:2]} == {16}
    assert doc["results"][2]["options"]["suffix"] == {"min_confidence": 0.01}


def test_composed_drafter_sweeps_name_their_part(tmp_path, capsys) -> None:
    """A composed drafter (best draft per step) is swept by LABEL.PART.KEY; LABEL.KEY, which names no part, is one
    line naming the parts and the form to use, and so is a composed drafter with no --grid."""
    path = tmp_path / "t.jsonl"
    with path.open("w") as fh:
        for r in _records(seed=7, n=4):
            fh.write(json.dumps({"id": r.id, "prompt_ids": r.prompt_list(), "response_ids": r.response_list()}) + "\n")
    base = ["curve", str(path), "--tokenizer", "none", "--drafter", "sn=suffix+ngram", "--versus", "", "--no-plots"]
    base += ["--no-progress", "--no-cache"]
    out = tmp_path / "out"
    argv = [*base, "--grid", "sn.suffix.min_confidence=0.01,0.3", "--option", "sn.ngram.max_candidates=2"]
    assert main([*argv, "--grid", "sn.budget=4,8", "--out", str(out)]) == 0
    doc = json.loads((out / "curve.json").read_text())
    got = sorted((r["options"]["suffix"]["min_confidence"], r["budget"]) for r in doc["results"])
    assert got == [(0.01, 4), (0.01, 8), (0.3, 4), (0.3, 8)]
    assert all(r["options"]["ngram"] == {"max_candidates": 2} for r in doc["results"])
    capsys.readouterr()
    assert main([*base, "--grid", "sn.min_confidence=0.01", "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "composes suffix, ngram" in err[0] and "sn.suffix.min_confidence" in err[0]
    assert main([*base, "--out", str(tmp_path / "o3")]) == 2
    assert "--grid sn.suffix.KEY=V1,V2" in capsys.readouterr().err
    assert main([*base, "--grid", "sn=4", "--out", str(tmp_path / "o4")]) == 2
    assert "'sn=4': give sn.KEY=VALUE" in capsys.readouterr().err


def test_save_png_writes_a_palette_image_of_the_figure(tmp_path) -> None:
    """The kept plots are palette PNGs: same pixel size as matplotlib's own PNG, each line's colour kept."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    from specdec.eval.report import PNG_COLORS, _pyplot, save_png

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [0, 1], color="#ff0000", linewidth=4)
    ax.plot([0, 1], [1, 0], color="#0000ff", linewidth=4)
    fig.savefig(tmp_path / "rgba.png", dpi=50)
    save_png(fig, tmp_path / "p.png", dpi=50)
    plt.close(fig)
    img, ref = Image.open(tmp_path / "p.png"), Image.open(tmp_path / "rgba.png")
    assert img.mode == "P" and img.size == ref.size
    colours = {c for _, c in img.convert("RGB").getcolors(PNG_COLORS)}
    assert {(255, 0, 0), (0, 0, 255), (255, 255, 255)} <= colours
