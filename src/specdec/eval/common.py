"""What every ``specdec-eval`` subcommand shares (``cli``, ``run_replay``, ``live``, ``run_curve`` import it; it imports
none of them): the user-facing error, the output staging, the settings and cost model from the flags, ``echo``."""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from specdec.eval.costmodel import DEFAULT_VERIFY_MS, DEFAULT_VERIFY_MS_PER_TOKEN, CostModel
from specdec.eval.settings import Setting, build_settings


class EvalError(RuntimeError):
    """A user-facing failure: printed as one line, exit status 2."""


def cost_model(args: argparse.Namespace) -> CostModel:
    if getattr(args, "verify_table", None):
        return CostModel.parse_table(args.verify_table)
    src = (
        "flags"
        if (args.verify_ms, args.verify_ms_per_token) != (DEFAULT_VERIFY_MS, DEFAULT_VERIFY_MS_PER_TOKEN)
        else CostModel().source
    )
    return CostModel(t1_ms=args.verify_ms, per_token_ms=args.verify_ms_per_token, source=src)


def settings_from_args(args: argparse.Namespace) -> list[Setting]:
    return build_settings(
        drafters=args.drafter,
        options=args.option,
        budgets=args.budget,
        tree=args.tree,
        grid=getattr(args, "grid", []) or [],
        preset=args.config,
    )


# ------------------------------------------------------------------------------------------- outputs
class Staging:
    """Collects output files in a hidden folder and moves them into place only on ``commit()``."""

    def __init__(self, out_dir: str | os.PathLike[str], *, files: Sequence[tuple[str, str | None]] = ()) -> None:
        """``files``: (flag, path) of other outputs (``--json``), checked writable now, before any long work."""
        self.out = Path(out_dir)
        if self.out.exists() and not self.out.is_dir():
            raise EvalError(f"--out {self.out}: is an existing file; --out takes a folder (a new or existing one)")
        self.dir = self.out.parent / f".{self.out.name}.staging-{os.getpid()}"
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir.mkdir(parents=True)
        except OSError as exc:
            raise EvalError(
                f"--out {self.out}: cannot write there ({exc.strerror or exc}); pick a writable folder"
            ) from None
        self.targets: dict[Path, Path] = {}  # staged file -> final path
        for flag, path in files:
            if path:
                self._check_file(flag, Path(path))

    def _check_file(self, flag: str, path: Path) -> None:
        """``path`` can be written as a file: not a folder, its folder creatable and writable."""
        if path.is_dir():
            self.abort()
            raise EvalError(f"{flag} {path}: is a folder; {flag} takes a file path")
        probe = path.parent / f".{path.name}.probe-{os.getpid()}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            self.abort()
            raise EvalError(
                f"{flag} {path}: cannot write there ({exc.strerror or exc}); pick a writable path"
            ) from None

    def path(self, name: str, final: str | os.PathLike[str] | None = None) -> Path:
        staged = self.dir / name
        self.targets[staged] = Path(final) if final else self.out / name
        return staged

    def commit(self) -> list[Path]:
        done = []
        for staged, final in self.targets.items():
            if staged.exists():
                final.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(staged), str(final))
                done.append(final)
        shutil.rmtree(self.dir, ignore_errors=True)
        return done

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def safe_name(text: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "_" for c in text)
    return keep.strip("_")[:80] or "x"


def echo(args: argparse.Namespace, text: str) -> None:
    if not getattr(args, "quiet", False):
        print(text, flush=True)
