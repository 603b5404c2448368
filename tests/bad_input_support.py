"""What the bad-input tests share beside their fixtures (``toys``, ``no_replay`` in conftest.py): a tiny trace file,
and ``fails``: specdec-eval run in-process must exit 2 with one error line."""

from __future__ import annotations

import json
import pathlib

from specdec.eval.cli import main
from specdec.eval.flags import EXIT_USAGE


def trace_file(tmp_path: pathlib.Path, name: str = "t.jsonl") -> pathlib.Path:
    f = tmp_path / name
    f.write_text(json.dumps({"prompt_ids": [1, 2, 3, 1, 2], "response_ids": [3, 1, 2, 3]}) + "\n")
    return f


def fails(args: list[str], capsys) -> str:
    """specdec-eval in-process: exit status 2 and one line on stderr, which is returned."""
    capsys.readouterr()
    rc = main(args + ["--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_USAGE, err
    assert len(err) == 1 and err[0].startswith("specdec-eval: error: "), err
    return err[0]
