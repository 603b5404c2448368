"""CPU feature detection (AMX, AVX-512 BF16/VNNI) and thread/core placement for the draft model."""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from specdec.config import ConfigError

logger = logging.getLogger("specdec.drafters.model")

MAX_THREADS = 256  # thread counts above this are refused on any machine
OVERSUBSCRIBE = 4  # ... and above this many per usable CPU: past it threads only queue for cores (or fail to start)

CPUINFO = "/proc/cpuinfo"
FEATURE_FLAGS = {  # report name -> /proc/cpuinfo flag
    "avx2": "avx2",
    "avx512f": "avx512f",
    "avx512_vnni": "avx512_vnni",
    "avx512_bf16": "avx512_bf16",
    "avx_vnni": "avx_vnni",
    "amx_tile": "amx_tile",
    "amx_bf16": "amx_bf16",
    "amx_int8": "amx_int8",
}


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    logical_cpus: int
    usable_cpus: int  # in this process's affinity mask
    features: dict[str, bool]

    @property
    def amx(self) -> bool:
        return self.features.get("amx_bf16", False) and self.features.get("amx_tile", False)

    def summary(self) -> str:
        have = [k for k, v in self.features.items() if v]
        missing = [k for k, v in self.features.items() if not v]
        return (
            f"{self.model_name}; {self.usable_cpus}/{self.logical_cpus} CPUs usable; "
            f"has: {', '.join(have) or 'none'}; lacks: {', '.join(missing) or 'none'}"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """(model name, flags) of the first processor block of a /proc/cpuinfo text."""
    name, flags = platform.processor() or "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name in ("unknown", "x86_64", ""):
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return name, flags


def detect_cpu() -> CpuInfo:
    """Features from /proc/cpuinfo (all False where it is unreadable, e.g. not Linux)."""
    try:
        with open(CPUINFO, encoding="utf-8") as fh:
            name, flags = parse_cpuinfo(fh.read())
    except OSError:
        name, flags = platform.processor() or "unknown", set()
    usable = usable_cpus()
    features = {k: flag in flags for k, flag in FEATURE_FLAGS.items()}
    return CpuInfo(name, os.cpu_count() or 1, usable, features)


def usable_cpus() -> int:
    """CPUs in this process's affinity mask (all of them where it cannot be read)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(value: int, *, key: str, warn: bool = True) -> int:
    """``value`` threads against this machine: more than ``OVERSUBSCRIBE`` x the usable CPUs or ``MAX_THREADS`` is a
    ``ConfigError`` naming ``key`` (a flag such as ``--threads`` or a keyword); more than the CPUs, one warning
    (``warn``). Returns the value."""
    cpus = usable_cpus()
    limit = min(MAX_THREADS, OVERSUBSCRIBE * cpus)
    given = f"{key} {value}" if key.startswith("-") else f"{key}={value!r}"
    if value > limit:
        raise ConfigError(
            f"{given} is more than this machine runs: at most {limit} ({OVERSUBSCRIBE}x its {cpus} usable CPU(s), "
            f"{MAX_THREADS} at most anywhere); pass {cpus} or fewer (0 = the default)"
        )
    if warn and value > cpus:
        logger.warning("%s is more than the %d CPU(s) usable here: the threads will share cores", given, cpus)
    return value


def ipex_status() -> str:
    """Whether intel_extension_for_pytorch is importable with this torch (it pins torch 2.8)."""
    try:
        import intel_extension_for_pytorch as ipex  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means unavailable
        return (
            f"IPEX unavailable ({type(exc).__name__}: {str(exc)[:80]}); it pins torch 2.8, this is torch "
            f"{_torch_version()}: using oneDNN/ONNX Runtime instead"
        )
    return f"IPEX {ipex.__version__} available"


def _torch_version() -> str:
    import torch

    return torch.__version__


def apply_placement(*, num_threads: int = 0, cpu_affinity: Sequence[int] = ()) -> CpuInfo:
    """Pin the process to ``cpu_affinity`` and set torch's thread count; log the CPU features once."""
    if cpu_affinity:
        try:
            os.sched_setaffinity(0, set(cpu_affinity))
        except (AttributeError, OSError) as exc:
            raise ValueError(
                f"cpu_affinity={list(cpu_affinity)!r} could not be applied ({exc}); "
                f"usable CPU ids: {sorted(os.sched_getaffinity(0))}"
            ) from exc
    import torch

    if num_threads:
        torch.set_num_threads(check_threads(num_threads, key="num_threads"))
    info = detect_cpu()
    global _LOGGED
    if not _LOGGED:
        _LOGGED = True
        logger.info("draft model CPU: %s; torch threads %d; %s", info.summary(), torch.get_num_threads(), ipex_status())
    return info


_LOGGED = False
