"""Where the engine thread's time goes: py-spy's raw stacks of a vLLM engine-core process, aggregated.

``scripts/vllm_device_run.sh --py-spy`` records every engine-core process of a benchmark with py-spy (non-blocking,
Python frames, idle samples kept: a thread blocked on the GPU counts where it blocks) and runs this module on each
recording::

    python -m benchmarks.pyspy_profile RAW.txt [--label specdec] [--top 60] [--out profile.md]

py-spy's raw format is one line per distinct stack: ``thread (tid): name;frame;frame;... count``, frames
``function (file:line)``. Only samples inside the engine's busy loop count (start-up, compilation and CUDA-graph
capture are left out) and only the frames inside the loop are listed; shares are of those samples. Two tables:
*inclusive* (a function and everything it called, per function and file) and *leaf chains* (the innermost frames, where
the time is spent). The warm-up cells of the benchmark are in the busy loop too, so one-time work (Triton's first
compiles) shows as a few percent.
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

BUSY_LOOP = "run_busy_loop"  # vLLM's EngineCoreProc loop: every engine step runs under it
LEAF_DEPTH = 4  # frames shown per leaf chain
DEFAULT_TOP = 60


@dataclass
class Profile:
    """Aggregated samples of one recording (counts are py-spy samples)."""

    busy: int = 0  # samples inside the busy loop (the denominator of every share)
    total: int = 0  # every sample of every thread
    inclusive: collections.Counter = field(default_factory=collections.Counter)  # "func (file)" -> samples
    leaves: collections.Counter = field(default_factory=collections.Counter)  # "inner <- outer ..." -> samples

    def share(self, samples: int) -> float:
        return 100.0 * samples / self.busy if self.busy else 0.0


def frame_key(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: one entry per function, whatever the line."""
    name, sep, loc = frame.partition(" (")
    if not sep:
        return name.strip()
    path = loc.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({path.rsplit('/', 1)[-1]})"


def parse_line(line: str) -> tuple[list[str], int] | None:
    """One raw line -> (frames outermost first, thread entry dropped; samples), or None for a blank/odd line."""
    stack, sep, count = line.rstrip("\n").rpartition(" ")
    if not sep or not stack or not count.isdigit():
        return None
    frames = stack.split(";")
    if frames and frames[0].startswith("thread ("):
        frames = frames[1:]
    return frames, int(count)


def aggregate(lines: Iterable[str]) -> Profile:
    prof = Profile()
    for line in lines:
        parsed = parse_line(line)
        if parsed is None:
            continue
        frames, n = parsed
        prof.total += n
        keys = [frame_key(f) for f in frames]
        start = next((i for i, k in enumerate(keys) if BUSY_LOOP in k), None)
        if start is None:
            continue
        keys = keys[start + 1 :]  # the frames around the loop (process start-up) are in every sample
        prof.busy += n
        for key in dict.fromkeys(keys):  # a recursive function counts once per sample
            prof.inclusive[key] += n
        prof.leaves[" <- ".join(reversed(keys[-LEAF_DEPTH:]))] += n
    return prof


def markdown(prof: Profile, *, label: str, top: int = DEFAULT_TOP) -> str:
    lines = [
        f"## {label}: engine busy loop, {prof.busy} of {prof.total} samples",
        "",
        "| inclusive % | function (file) |",
        "| ---: | --- |",
    ]
    lines += [f"| {prof.share(n):.1f} | `{k}` |" for k, n in prof.inclusive.most_common(top)]
    lines += ["", f"| leaf % | innermost {LEAF_DEPTH} frames, innermost first |", "| ---: | --- |"]
    lines += [f"| {prof.share(n):.1f} | `{k}` |" for k, n in prof.leaves.most_common(top)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", type=Path, help="py-spy record --format raw output")
    ap.add_argument("--label", default="", help="heading of the tables (default: the file name)")
    ap.add_argument("--top", type=int, default=DEFAULT_TOP, help="rows per table")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown here (default: print)")
    args = ap.parse_args(argv)
    if args.top <= 0:
        ap.error(f"--top must be positive, got {args.top}")
    with args.raw.open() as fh:
        text = markdown(aggregate(fh), label=args.label or args.raw.name, top=args.top)
    if args.out:
        args.out.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
