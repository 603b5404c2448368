#!/usr/bin/env bash
# One device call on the GPU machine (developers' path to a lent GPU; see ../shared/device/README.md): assemble the
# staged bundle if this call carries its last part, install this tree, then run the command given as one string,
# its output under $OUT/block.log. Stage .device-bundle/p00 .. p(N-1) first, one call each
# (`bash .device-bundle/pNN/stage.sh`), then, carrying [".device-bundle/pN", "device_inputs"]:
#   OUT=$OUT bash scripts/device_call.sh "python -m benchmarks.serve_bench run --inflate llama-8b --out-dir /tmp/sb; \
#       tar czf \$OUT/sb.tgz --exclude='*.jsonl' -C /tmp sb"
# Later calls on the same warm machine carry only device_inputs. $OUT returns at most 8 files: tar folders.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LAST=$(ls -d .device-bundle/p[0-9][0-9] 2> /dev/null | tail -1)
if [[ ! -e /tmp/specdec-bundle/ready ]]; then
  [[ -n "$LAST" ]] || { echo "device_call.sh: no bundle here and none carried: stage the parts first"; exit 3; }
  bash "$LAST/stage.sh" || { echo "device_call.sh: staging $LAST failed"; exit 3; }
fi
source /tmp/specdec-bundle/env.sh
# a call that ran out of time leaves its vLLM servers behind (each in a session of its own), holding GPU memory the
# next server's start then lacks: stop them first
if pgrep -f "vllm.entrypoints.cli.main serve|VLLM::" > /dev/null; then
  echo "device_call.sh: stopping vLLM servers left by an earlier call"
  pkill -INT -f "vllm.entrypoints.cli.main serve"; sleep 10
  pkill -KILL -f "vllm.entrypoints.cli.main serve|VLLM::"; sleep 2
fi
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i "root\|notice" | tail -3
export PYTHONUNBUFFERED=1 OUT="${OUT:-/tmp/out}"
source scripts/bench_path.sh  # ./benchmarks on the path
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# the host's layout: which cores sit by which GPU (side-by-side servers are pinned by it: benchmarks/gpu_cores.py)
{ nvidia-smi topo -m | grep -E "^(GPU|\s+GPU)"; lscpu | grep -E "^(Socket|Thread|NUMA node)"; } 2> /dev/null
echo "device_call.sh: $(date -u +%T) running: $*"
bash -c "$*" 2>&1 | tee "$OUT/block.log" | grep -v "it/s\]" | tail -150
echo "device_call.sh: $(date -u +%T) done"
