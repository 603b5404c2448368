#!/usr/bin/env bash
# One device call: vLLM benchmark (+ float32 lossless check) and the real `vllm serve` test, results under $OUT.
# Needs the staged bundle (see ../shared/device/README.md) and device_inputs/prompts.json carried
# (python -m specdec.eval.prepare_prompts). Usage on the GPU machine, in the repo root:
#   bash scripts/vllm_device_run.sh [bench_vllm args: --methods ... --lossless --lossless-only --lossless-methods ...] [--serve]
# A full run does not fit one 10-minute call: (A) --methods nospec,ngram,suffix,specdec,specdec-async (~6.5 min),
# (B) --methods specdec --lossless-only --lossless-methods ngram,suffix,specdec,specdec-async --serve (~5.5 min).
set -uo pipefail
source /tmp/specdec-bundle/env.sh
python -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -v -i "root" | tail -3  # `pip` on PATH may be another Python's
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 OUT="${OUT:-/tmp/out}"  # SAFEPATH: the installed package, not ./specdec (which lacks specdec.configs etc.)
mkdir -p "$OUT"
SERVE=0; ARGS=()
for a in "$@"; do [[ "$a" == "--serve" ]] && SERVE=1 || ARGS+=("$a"); done
if [[ ${#ARGS[@]} -gt 0 ]]; then
  python -m specdec.eval.bench_vllm --prompts device_inputs/prompts.json --out-dir "$OUT" "${ARGS[@]}" 2>&1 \
    | grep -v "it/s\]" | tee "$OUT/bench.log"
fi
if [[ "$SERVE" == 1 ]]; then
  python -m specdec.eval.serve_test --prompts device_inputs/prompts.json --out "$OUT/serve_test.json" 2>&1 \
    | tail -40 | tee "$OUT/serve.log"
fi
