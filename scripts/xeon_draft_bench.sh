#!/usr/bin/env bash
# GPU host's Xeon: draft-model step latency standalone, then while vLLM decodes on the same host (issue 7).
# Needs the staged bundle (source /tmp/specdec-bundle/env.sh) and device_inputs/prompts.json. Results under $OUT.
set -uo pipefail
source /tmp/specdec-bundle/env.sh
export PYTHONSAFEPATH=1 OUT="${OUT:-/tmp/out}"
source scripts/bench_path.sh  # ./benchmarks on the path (./specdec stays off it)
mkdir -p "$OUT"
ARGS=(--threads 8 --affinity 0-7 --backends "${BACKENDS:-eager-hf,torch,onnx-int8,numpy}" --batches 1,8,32
      --steps 30 --agree-prompts 0 --draft-rounds 5 --device-name xeon-8t)
python -m benchmarks.bench_draft_cpu "${ARGS[@]}" --note "standalone" --out "$OUT/xeon_draft_cpu_standalone.json" \
  2>&1 | grep -v "it/s\]" | tail -25
rm -f /tmp/specdec_vllm_load.ready
python -m benchmarks.vllm_load --seconds "${LOAD_SECONDS:-90}" --batch 64 > "$OUT/vllm_load.log" 2>&1 &
LOAD=$!
for _ in $(seq 120); do [[ -f /tmp/specdec_vllm_load.ready ]] && break; sleep 1; done
python -m benchmarks.bench_draft_cpu "${ARGS[@]}" --note "while vLLM decodes batch 64 (benchmarks.vllm_load)" \
  --out "$OUT/xeon_draft_cpu_while_vllm.json" 2>&1 | grep -v "it/s\]" | tail -25
wait $LOAD
grep "vllm_load round" "$OUT/vllm_load.log" | tail -5
