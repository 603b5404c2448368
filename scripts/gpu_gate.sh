#!/usr/bin/env bash
# The GPU gate (issue 41, docs/gate.md): specdec's default path vs no speculation and vLLM's `suffix`, a verdict
# per cell. Run in the repo root of the GPU machine, after `python -m benchmarks.gate_prompts [--before-commit SHA]`
# on a machine with ../shared (device_inputs/ travels with the call). Results under $OUT (default /tmp/out).
#   bash scripts/gpu_gate.sh --tp 1 --part cells        # TP=1: two engines at once on a 2-GPU machine
#   bash scripts/gpu_gate.sh --tp 2 --part cells --methods nospec,suffix
#   bash scripts/gpu_gate.sh --part serve [--checks tpot-53m,tpot-8b,start-8b-tp2]
#   bash scripts/gpu_gate.sh --part prepare             # installs + the inflated model only (e.g. while staging)
#   bash scripts/gpu_gate.sh --dry-run [...]             # the whole flow on the CPU (fake engines and servers)
#   bash scripts/gpu_gate.sh --help                      # every option of the driver (python -m benchmarks.gate)
# vLLM: the staged bundle (/tmp/specdec-bundle/env.sh, ../shared/device) where there is one, else the vLLM this
# Python imports (pip install vllm). The project is installed here (pip, non-editable; skipped when the tree is
# unchanged), the base tree device_inputs/gate_before into BEFORE_DIR for the specdec-before engine, and each tree
# of device_inputs/gate_candidates (gate_prompts --candidates) into /tmp/specdec-cand/<name>.
set -uo pipefail
export GATE_T0="${GATE_T0:-$(date +%s.%N)}"  # the driver's --max-wall-s counts from here (installs included)
export GATE_COMMAND="bash scripts/gpu_gate.sh $*"
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"
BEFORE_SRC=device_inputs/gate_before
BEFORE_DIR=/tmp/specdec-before
CANDIDATES_SRC=device_inputs/gate_candidates
CANDIDATES_DIR=/tmp/specdec-cand
MAIN_STAMP=/tmp/specdec-gate-main.stamp
DRY=0
ARGS=()
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    -h | --help) sed -n '2,14p' "$0"; exec python -m benchmarks.gate --help ;;
    *) ARGS+=("$a") ;;
  esac
done
mkdir -p "$OUT"

if [[ "$DRY" == 1 ]]; then  # no vLLM, no GPU, no install: fake engines and servers, 2 fake GPUs
  WORK="$(mktemp -d)"
  echo "gpu_gate: dry run: python -m benchmarks.gate --fake --gpus 2 --work-dir $WORK --out-dir $OUT ${ARGS[*]}"
  exec python -m benchmarks.gate --fake --gpus 2 --work-dir "$WORK" --out-dir "$OUT" "${ARGS[@]}"
fi

tree_stamp() {  # what a build of the tree in $1 depends on
  (cd "$1" && find src specdec drafters verifiers eval configs csrc setup.py pyproject.toml -type f \
    ! -path '*/__pycache__/*' ! -path 'eval/results/*' ! -name '*.so' -print0 2> /dev/null \
    | sort -z | xargs -0 sha1sum | sha1sum | cut -c1-40)
}

[[ -f /tmp/specdec-bundle/env.sh ]] && source /tmp/specdec-bundle/env.sh
python -c "import vllm" 2> /dev/null || { echo "gpu_gate: vLLM is not importable: pip install vllm, or stage ../shared/device"; exit 2; }
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1  # SAFEPATH: only installed packages (the src layout keeps ./src off the path anyway)
stamp="$(tree_stamp .)"
if [[ "$(cat "$MAIN_STAMP" 2> /dev/null)" != "$stamp" ]] || ! python -c "import specdec" 2> /dev/null; then
  echo "gpu_gate: installing this tree"
  python -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v -i "root" | tail -3
  echo "$stamp" > "$MAIN_STAMP"
fi
install_tree() {  # install_tree SRC DEST WHAT: an exported tree (gate_prompts) into DEST, unless already there
  local stamp
  stamp="$(tree_stamp "$1")"
  [[ "$(cat "$2/.gate_stamp" 2> /dev/null)" == "$stamp" ]] && return 0
  echo "gpu_gate: installing $3 $(cat "$1/GATE_COMMIT") into $2"
  rm -rf "$2"
  python -m pip install -q --no-deps --no-build-isolation --target "$2" "$1" 2>&1 | grep -v -i "root" | tail -3
  cp "$1/GATE_COMMIT" "$2/" && echo "$stamp" > "$2/.gate_stamp"
}
[[ -d "$BEFORE_SRC" ]] && install_tree "$BEFORE_SRC" "$BEFORE_DIR" "the base tree"
for cand in "$CANDIDATES_SRC"/*/; do  # gate_prompts --candidates: trees a benchmark variant's path names
  [[ -d "$cand" ]] && install_tree "$cand" "$CANDIDATES_DIR/$(basename "$cand")" "candidate $(basename "$cand")"
done
source scripts/bench_path.sh  # ./benchmarks on the path
python -m benchmarks.gate --before-path "$BEFORE_DIR" --out-dir "$OUT" "${ARGS[@]}" 2>&1 \
  | grep --line-buffered -v "it/s\]" | tee -a "$OUT/gate_console.log"
exit "${PIPESTATUS[0]}"
