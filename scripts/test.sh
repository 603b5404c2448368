#!/usr/bin/env bash
# The test command (README; .ci/run calls it): installs what the tests need and runs them.
#  1. the package with its dev and onnx extras (the ONNX Runtime backend is tested too), then the whole suite on the CPU (GPU tests skip with a reason);
#  2. the vLLM glue tests against a real vLLM 0.32 (CPU import only) in a venv that shares the system
#     torch 2.13 CPU wheel; created on first use (~5-10 min), reused afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -q "torch==2.13.0" -e ".[dev,onnx]"
python -m pytest -q

VENV="${SPECDEC_VLLM_VENV:-/opt/vllm-venv}"
if ! "$VENV/bin/python" -c "import vllm.engine.arg_utils, vllm.v1.spec_decode.custom_class_proposer" 2>/dev/null; then
  python -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" install -q "vllm==0.32.0"
  # PyPI's torchvision/torchaudio/torchcodec expect CUDA torch and break vLLM's imports beside the CPU wheel.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$VENV/bin/python" -m pytest -q tests/test_vllm_plugin.py tests/test_vllm_proposer.py tests/test_vllm_bench.py tests/test_vllm_scheduled.py tests/test_vllm_thread.py tests/test_vllm_graphs.py \
  tests/test_step_trace.py tests/test_vllm_engine_timer.py tests/test_vllm_compile_warmup.py
