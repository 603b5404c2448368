"""Which host cores a GPU's server or engine is pinned to, where they run side by side (``serve_bench --lanes``, the
gate's serve rounds and its cells' lanes): each on the cores of its GPUs' NUMA node where the host says which those
are (``local_cpulist`` of the GPU's PCI device), else an equal share of this process's cores, in order.

Why: the servers of a side-by-side run can be host-bound at large batches (the engine's host work per step grows
with its rows), so a server whose cores sit on another NUMA node than its GPU (its pinned copies and launches
crossing the sockets) can read slower for that alone, and the comparison with the server beside it measures the
placement. The naive halves (0-15 for GPU 0, 16-31 for GPU 1) do that wherever the GPUs are not ordered like the
nodes. Lane i is CUDA device i in PCI bus order (``PCI_ORDER`` in its environment), nvidia-smi's order. Never
imports vLLM or torch."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

PCI_DEVICES = Path("/sys/bus/pci/devices")
NVIDIA_SMI_TIMEOUT_S = 20.0
EVEN, NUMA = "even", "numa"  # how a placement was chosen (recorded beside it)
# a side-by-side server's environment beside CUDA_VISIBLE_DEVICES: CUDA numbers the GPUs as nvidia-smi and sysfs do
PCI_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def parse_cpulist(text: str) -> set[int]:
    """``0-3,8,10-11`` (sysfs cpulist) -> {0, 1, 2, 3, 8, 10, 11}; empty text -> empty set."""
    out: set[int] = set()
    for part in (p.strip() for p in text.strip().split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def sysfs_bus_id(smi_bus_id: str) -> str:
    """nvidia-smi's ``00000000:18:00.0`` -> sysfs's ``0000:18:00.0`` (four-digit domain, lower case)."""
    domain, _, rest = smi_bus_id.strip().partition(":")
    return f"{domain[-4:]}:{rest}".lower()


def gpu_bus_ids() -> list[str]:
    """The GPUs' PCI bus ids in nvidia-smi's order (CUDA_VISIBLE_DEVICES indices); [] without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [sysfs_bus_id(line) for line in out.splitlines() if line.strip()]


def local_cpus(bus_ids: Sequence[str], *, root: Path = PCI_DEVICES) -> list[set[int] | None]:
    """Each GPU's NUMA-local cores from sysfs (None where the host does not say)."""
    out: list[set[int] | None] = []
    for bus in bus_ids:
        try:
            cpus = parse_cpulist((root / bus / "local_cpulist").read_text())
        except (OSError, ValueError):
            cpus = set()
        out.append(cpus or None)
    return out


def lane_cores(n: int, cores: Sequence[int], local: Sequence[set[int] | None]) -> tuple[list[list[int]], str]:
    """The cores of lanes 0..n-1 (lane i runs on GPU i), and how they were chosen. Lanes whose GPUs share a NUMA node
    split that node's cores (those in ``cores``) evenly; any GPU without a known node, nodes that overlap without being
    equal, or a lane left with under half an even share: the even split of ``cores`` in order."""
    cores = sorted(cores)
    share = len(cores) // n if n else 0
    even = [cores[i * share : (i + 1) * share] for i in range(n)]
    if n < 2 or len(local) < n or any(s is None for s in local[:n]):
        return even, EVEN
    nodes = [frozenset(s) for s in local[:n] if s is not None]
    distinct = set(nodes)
    if any(a != b and a & b for a in distinct for b in distinct):
        return even, EVEN
    lanes: list[list[int]] = [[] for _ in range(n)]
    for node in distinct:
        members = [i for i, s in enumerate(nodes) if s == node]
        mine = [c for c in cores if c in node]
        per = len(mine) // len(members)
        for j, i in enumerate(members):
            lanes[i] = mine[j * per : (j + 1) * per]
    if any(len(lane) < max(1, share // 2) for lane in lanes):
        return even, EVEN
    return lanes, NUMA


def span(cores: Sequence[int]) -> str:
    """``[16, ..., 31]`` -> ``16-31 (16)`` (first-last and count, for logs and records); [] -> ``any``."""
    return f"{cores[0]}-{cores[-1]} ({len(cores)})" if cores else "any"


def lanes_local(per_gpu: Sequence[set[int] | None], n: int, per_lane: int) -> list[set[int] | None]:
    """Lane i's GPUs are ``per_lane`` consecutive ones from ``i * per_lane`` (TP > 1: a lane's engine spans them):
    its local cores are theirs together (None if the host says nothing of one of them)."""
    out: list[set[int] | None] = []
    for i in range(n):
        mine = list(per_gpu[i * per_lane : (i + 1) * per_lane])
        out.append(None if len(mine) < per_lane or any(s is None for s in mine) else set().union(*mine))
    return out


def gpu_lane_cores(n: int, cores: Sequence[int], *, per_lane: int = 1) -> tuple[list[list[int]], str]:
    """``lane_cores`` for this host's GPUs (nvidia-smi's order), lane i on GPUs ``i * per_lane`` onwards."""
    if n < 2:
        return lane_cores(n, cores, [])
    return lane_cores(n, cores, lanes_local(local_cpus(gpu_bus_ids()), n, per_lane))
