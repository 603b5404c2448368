#!/usr/bin/env bash
# Install the benchmark-only peer ArcticInference 0.1.1 (SuffixDecodingCache) without its torch pin.
# Its sdist's build requirements pin torch 2.7, so we build without isolation and without deps.
# Takes about a minute on a 2-core CPU machine. Usage: bash scripts/install_arctic.sh
set -euo pipefail
PY="${PYTHON:-python}"
"$PY" -m pip install -q nanobind==2.9.2 cmake ninja setuptools wheel grpcio-tools
"$PY" -m pip install -q --no-build-isolation --no-deps arctic-inference==0.1.1
"$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; print('arctic_inference OK')"
