"""Results files: ``{"settings", "versions", "device", "results": [...]}`` written atomically.

    path = results_path("suffix_anchor")            # eval/results/<YYYY-MM-DD>_<device>_suffix_anchor.json
    write_results(path, settings={...}, results=[{"dataset": ..., "drafter": ..., **replay_result.as_dict()}])

``results`` entries may be dicts or objects with ``as_dict()`` (a ``ReplayResult``), in which case give them as
``(meta_dict, result)`` pairs or dicts that already hold the metadata. See the README (Results JSON schema).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from specdec.paths import REPO_ROOT

RESULTS_DIR = REPO_ROOT / "eval" / "results"
SCHEMA_VERSION = 1


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def device_label(device: str | None = None) -> str:
    """``cpu-2core`` on a CPU, ``cuda-<gpu name>`` when ``device`` is a CUDA device."""
    if device and str(device).startswith("cuda"):
        try:
            import torch

            name = torch.cuda.get_device_name(0).lower().replace("nvidia ", "")
            return "cuda-" + "-".join(name.split())
        except Exception:  # noqa: BLE001
            return "cuda"
    return f"cpu-{cpu_count()}core"


def versions() -> dict[str, Any]:
    """Versions of everything that can change a number (imports are best effort)."""
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": cpu_count(),
    }
    for mod in ("specdec", "numpy", "torch", "transformers", "tokenizers", "onnxruntime", "vllm", "arctic_inference"):
        m = sys.modules.get(mod)
        if m is None and mod in ("specdec", "numpy", "torch", "transformers", "tokenizers"):
            try:
                m = __import__(mod)
            except Exception:  # noqa: BLE001
                m = None
        if m is not None:
            out[mod] = getattr(m, "__version__", None) or _dist_version(mod)
    try:
        import subprocess

        rev = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if rev.returncode == 0:
            out["git"] = rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001
        pass
    return out


def _dist_version(module: str) -> str:
    """The installed distribution's version of a module without ``__version__`` (arctic_inference)."""
    import importlib.metadata as md

    try:
        return md.version(module.replace("_", "-"))
    except md.PackageNotFoundError:
        return "unknown"


RUN_PACKAGES = ("vllm", "torch", "transformers", "arctic-inference", "specdec", "numpy", "openai")


def installed_versions(packages: Iterable[str] = RUN_PACKAGES) -> dict[str, str]:
    """What a GPU benchmark records beside its numbers: Python, platform, CPU, the GPU's name and the installed
    versions of ``packages`` (from their distribution metadata, so vLLM is not imported for it)."""
    import importlib.metadata as md

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in packages:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    try:
        import torch

        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception:  # noqa: BLE001 - no usable torch: the GPU is unknown, the record still stands
        out["gpu"] = "unknown"
    out["cpu"], out["cpu_count"] = cpu_name(), str(os.cpu_count())
    return out


def results_path(
    name: str, *, device: str | None = None, date: str | None = None, directory: str | os.PathLike[str] | None = None
) -> Path:
    """``eval/results/<YYYY-MM-DD>_<device>_<name>.json`` (UTC date)."""
    date = date or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    is_torch_device = device is None or device == "cpu" or re.fullmatch(r"cuda(:\d+)?", device) is not None
    label = device_label(device) if is_torch_device else device
    return Path(directory or RESULTS_DIR) / f"{date}_{label}_{name}.json"


def _plain(obj: Any) -> Any:
    """JSON-safe copy: objects with as_dict() expanded, NaN/inf -> None, numpy scalars -> Python."""
    if hasattr(obj, "as_dict") and callable(obj.as_dict):
        return _plain(obj.as_dict())
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0:
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return str(obj)


def result_entry(meta: Mapping[str, Any], result: Any) -> dict[str, Any]:
    """One ``results`` entry: metadata (dataset, drafter, budget, tree, options...) + the result's fields."""
    return {**_plain(meta), **_plain(result)}


def build_document(
    settings: Mapping[str, Any],
    results: Iterable[Any],
    *,
    device: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    doc = {
        "schema_version": SCHEMA_VERSION,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(sys.argv),
        "settings": _plain(settings),
        "versions": versions(),
        "device": device_label(device),
        "results": [_plain(r) for r in results],
    }
    if extra:
        doc.update(_plain(extra))
    return doc


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_results(
    path: str | os.PathLike[str],
    settings: Mapping[str, Any],
    results: Iterable[Any],
    *,
    device: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write the results JSON atomically (settings + versions + device + results); returns the path."""
    doc = build_document(settings, results, device=device, extra=extra)
    return atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
