"""ModelDrafter's configuration: ``ModelDrafterConfig`` and the backends ``backend="auto"`` chooses among."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec.config import ConfigBase, ConfigError, rng
from specdec.drafters.cpu_info import check_threads
from specdec.drafters.model_backends import BACKEND_NAMES
from specdec.paths import DRAFT_MODEL, model_path

# backend="auto" times these and keeps the fastest. All compute in fp32 (drafts identical to the eager model's
# up to float rounding); bf16 joins where the CPU has native bf16 (AMX / AVX512-BF16). Not auto-picked: int8
# (approximate: force "onnx-int8" after checking agreement with benchmarks/bench_draft_cpu.py) and "compile"
# (inductor compiles for ~1 min per shape class on 2 cores and recompiles as batch/length classes change).
AUTO_CANDIDATES = ("native", "torch", "onnx", "eager")
NATIVE_BACKENDS = ("native", "native-fp32")  # run on their own thread pool (num_threads), not torch's
AUTO_BF16 = "torch-bf16"
# beside a busy engine in the same host (vLLM): backends that use torch intra-op (OpenMP) threads contend with the
# engine's threads and collapse (docs/results.md, CPU drafting); ONNX Runtime (spinning off) and numpy (one BLAS
# thread) keep their standalone speed; native uses its own pool (bounded spinning, then futex sleep), not torch's
AUTO_SHARED_HOST = ("native", "onnx", "numpy")


def auto_candidates(features: dict[str, bool], *, shared_host: bool = False) -> tuple[str, ...]:
    if shared_host:
        return AUTO_SHARED_HOST
    native_bf16 = features.get("amx_bf16", False) or features.get("avx512_bf16", False)
    return AUTO_CANDIDATES + ((AUTO_BF16,) if native_bf16 else ())


@dataclass(frozen=True)
class ModelDrafterConfig(ConfigBase):
    path: str = rng("", doc="Hugging Face model folder; empty = the shared code-draft-7m")
    backend: str = rng("auto", choices=("auto",) + BACKEND_NAMES, doc="forward backend; auto = fastest measured")
    num_threads: int = rng(
        0,
        lo=0,
        hi=4096,
        doc="threads of the native backend's pool, else torch intra-op threads; 0 = torch's current count",
    )
    cpu_affinity: list = rng([], doc="CPU ids to pin this process to (os.sched_setaffinity); [] = leave")
    tree_top_k: int = rng(2, lo=1, hi=64, doc="children per node at branching depths (tree drafts)")
    tree_branch_depths: list = rng([1, 2], doc="depths (1 = first draft token) where tree nodes branch")
    max_batch: int = rng(256, lo=1, hi=65536, doc="requests per backend forward (larger batches are split)")
    target_tokenizer: str = rng("", doc="target model/tokenizer folder; refuse to start if tokenizers differ")
    calibration_steps: int = rng(8, lo=1, hi=1000, doc="timed decode steps per backend for backend=auto")
    onnx_spin: bool = rng(
        False,
        doc="ONNX Runtime threads spin between ops: a little faster alone, but they "
        "steal the cores from other work in the process (a CPU target: 2x slower)",
    )
    shared_host: bool = rng(
        False,
        doc="the drafter runs beside a busy engine (the vLLM plugin sets it): "
        "backend=auto then picks among backends without torch OpenMP threads "
        "(onnx, numpy), which were measured to collapse under that load",
    )

    def resolved_path(self) -> Path:
        return Path(self.path).expanduser() if self.path else model_path(DRAFT_MODEL)

    def validate(self, *, where: str = "") -> None:
        super().validate(where=where)
        check_threads(self.num_threads, key=f"{where}num_threads", warn=False)  # the warning: when applied
        bad = [d for d in self.tree_branch_depths if not isinstance(d, int) or d < 1]
        if bad:
            raise ConfigError(
                f"{where}tree_branch_depths={self.tree_branch_depths!r} must hold depths >= 1; bad: {bad}"
            )
        if any(not isinstance(c, int) or c < 0 for c in self.cpu_affinity):
            raise ConfigError(f"{where}cpu_affinity={self.cpu_affinity!r} must be a list of CPU ids >= 0")
