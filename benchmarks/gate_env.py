"""The GPU gate's machine and model (``gate`` and ``gate_serve`` both use them; they import neither): the GPUs,
the device label of the results' names, the installed versions, the model every engine loads."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any


def pythonpath(*first: str) -> str:
    """A ``PYTHONPATH`` for a process started from here: ``first`` (e.g. an installed base tree, whose ``specdec``
    then wins over the installed one) before this process's own ``PYTHONPATH``; empty entries dropped."""
    return os.pathsep.join(p for p in (*first, os.environ.get("PYTHONPATH", "")) if p)


def gpu_names(fake: bool) -> list[str]:
    if fake:
        return ["fake GPU", "fake GPU"]
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


def device_info(args: argparse.Namespace) -> dict[str, Any]:
    """GPU names, CPU, and the label of the results' file name (``h100``, ``h100x2``, ``fake``)."""
    from specdec.eval.results import cpu_name

    names = gpu_names(args.fake)
    n = args.gpus or len(names)
    m = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", names[0]) if names else None
    base = "fake" if args.fake else (m.group(1).lower() if m else "gpu")
    return {
        "gpus": names[:n],
        "gpu_count": n,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "label": base + (f"x{n}" if n > 1 else ""),
    }


def load_inputs(path: str, before_path: str) -> dict[str, Any]:
    """The gate's inputs (``gate_prompts``'s file; empty if there is none), the base commit taken from the tree
    installed at ``before_path`` (its ``GATE_COMMIT`` stamp), which is what the specdec-before engine runs, where
    there is one (the inputs name the tree exported with them)."""
    inputs = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    stamp = Path(before_path) / "GATE_COMMIT"
    if stamp.exists():
        inputs["before"] = {**(inputs.get("before") or {}), "commit": stamp.read_text().strip()}
    return inputs


def versions(inputs: dict[str, Any]) -> dict[str, Any]:
    from specdec.eval.results import installed_versions

    before = inputs.get("before") or {}
    return {**installed_versions(), "specdec_commit": inputs.get("commit"), "before_commit": before.get("commit")}


def prepare_model(args: argparse.Namespace) -> tuple[str, str]:
    """(the model folder every engine loads, its label): the source inflated to ``--shape`` (built once, kept
    under /tmp while the machine is warm), or the source itself."""
    from specdec.paths import TARGET_MODEL, model_path

    src = args.model or str(model_path(TARGET_MODEL))
    if args.fake or not args.shape:
        return src, Path(src).name
    from specdec.eval.inflate_model import INFLATE_DIR, MARKER, inflate_in_subprocess

    out = INFLATE_DIR / f"{Path(src).name}-{args.shape}"
    path = str(out) if (out / MARKER).exists() else inflate_in_subprocess(src, args.shape)
    return path, f"{Path(src).name} inflated to {args.shape} (same outputs, an 8B forward pass)"
