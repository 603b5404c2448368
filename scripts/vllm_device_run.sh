#!/usr/bin/env bash
# One device call: vLLM benchmark (+ float32 lossless check) and the real `vllm serve` test, results under $OUT.
# Needs the staged bundle (see ../shared/device/README.md) and device_inputs/prompts.json carried
# (python -m benchmarks.prepare_prompts). Usage on the GPU machine, in the repo root:
#   bash scripts/vllm_device_run.sh [bench_vllm args: --methods ... --lossless --lossless-only --lossless-methods ...] [--serve]
#     [--py-spy]  (record each engine-core process with py-spy, carried as a wheel under device_inputs/, and write
#                  $OUT/pyspy_<n>_<pid>.md, engines in --methods order: python -m benchmarks.pyspy_profile)
# A full run does not fit one 10-minute call: (A) --methods nospec,ngram,suffix,specdec,specdec-async (~6.5 min),
# (B) --methods specdec --lossless-only --lossless-methods ngram,suffix,specdec,specdec-async --serve (~5.5 min).
set -uo pipefail
source /tmp/specdec-bundle/env.sh
python -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v -i "root" | tail -3  # `pip` on PATH may be another Python's
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 OUT="${OUT:-/tmp/out}"  # SAFEPATH: only installed packages (the src layout keeps ./src off the path anyway)
source scripts/bench_path.sh  # ./benchmarks on the path
mkdir -p "$OUT"
SERVE=0; PYSPY=0; ARGS=()
for a in "$@"; do
  case "$a" in --serve) SERVE=1;; --py-spy) PYSPY=1;; *) ARGS+=("$a");; esac
done
PYSPY_RATE=250  # samples per second; non-blocking, so the engine is not paused
record_engines() {  # background: one py-spy recorder per engine-core process that appears
  local seen=" " n=0
  while true; do
    for pid in $(pgrep -f EngineCore); do
      [[ "$seen" == *" $pid "* ]] && continue
      seen="$seen$pid "; n=$((n + 1))
      py-spy record --pid "$pid" --rate "$PYSPY_RATE" --format raw --idle --threads --nonblocking \
        -o "/tmp/pyspy_${n}_${pid}.raw" > "/tmp/pyspy_${n}_${pid}.log" 2>&1 &
    done
    sleep 1
  done
}
if [[ "$PYSPY" == 1 ]]; then
  command -v py-spy > /dev/null || python -m pip install -q --no-deps device_inputs/py_spy-*.whl 2>&1 | tail -1
  rm -f /tmp/pyspy_*.raw /tmp/pyspy_*.log
  record_engines & RECORDER=$!
fi
if [[ ${#ARGS[@]} -gt 0 ]]; then
  python -m benchmarks.bench_vllm --prompts device_inputs/prompts.json --out-dir "$OUT" "${ARGS[@]}" 2>&1 \
    | grep -v "it/s\]" | tee "$OUT/bench.log"
fi
if [[ "$PYSPY" == 1 ]]; then
  kill "$RECORDER" 2> /dev/null; pkill -INT -f "py-spy record" ; sleep 3
  for raw in /tmp/pyspy_*.raw; do
    [[ -e "$raw" ]] || continue
    python -m benchmarks.pyspy_profile "$raw" --label "engine $(basename "$raw" .raw)" \
      --out "$OUT/$(basename "$raw" .raw).md"
  done
fi
if [[ "$SERVE" == 1 ]]; then
  python -m benchmarks.serve_test --prompts device_inputs/prompts.json --out "$OUT/serve_test.json" 2>&1 \
    | tail -40 | tee "$OUT/serve.log"
fi
