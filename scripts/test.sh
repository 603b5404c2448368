#!/usr/bin/env bash
# The test command (README; .ci/run calls it inside a fresh venv). Runs with the `python` on PATH, normally a venv's:
#  1. installs torch==2.13.0 first (the CPU wheel; an unpinned torch would pull a CUDA build), then the package
#     editable with its dev and onnx extras (the ONNX Runtime backend is tested too);
#  2. ruff: lint (`ruff check`) and format check;
#  3. the CPU suite: every test not marked `vllm` (GPU tests skip with a reason);
#  4. the native extensions: with a C++ compiler on the machine, each one must import (setup.py builds them
#     optionally, so a failed build would otherwise only skip their tests);
#  5. the vLLM glue tests (marker `vllm`: tests/test_vllm_*.py and tests that opt in) against every vLLM in
#     src/specdec/vllm_plugin/versions.py, each in its own venv (SPECDEC_VLLM_VENV_ROOT, default /opt): vLLM's own
#     requirements minus torch and the GPU-only packages, then vLLM with --no-deps; a .pth file lets that venv see
#     this one's site-packages (the CPU torch and the editable specdec). Created on first use (a few minutes each),
#     reused while its import check passes. vLLM pins its CUDA torch (0.26: 2.11, 0.33: 2.14); both import on the
#     CPU torch here and their glue tests need no shim (the import check fails loudly should a release stop doing so).
# Every step runs even if an earlier one failed; the script exits non-zero if any did, naming them.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=python
VENV_ROOT="${SPECDEC_VLLM_VENV_ROOT:-/opt}"
[ -w "$VENV_ROOT" ] || [ -n "${SPECDEC_VLLM_VENV_ROOT:-}" ] || VENV_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/specdec"
TORCH_PIN="torch==2.13.0"
# Packages vLLM requires that serve only its GPU kernels or need a CUDA torch of their own; the glue tests import vLLM
# on the CPU torch above without them.
GPU_ONLY='^(torch|torchaudio|torchvision|torchcodec|triton|xformers|pynvvideocodec|nvtx|tilelang|quack-kernels|tokenspeed-mla|humming-kernels|fastsafetensors|instanttensor|deep-gemm|flash-attn|b12x|cuda-.*|cupy.*|nvidia-.*|flashinfer.*)$'
FAILED=()

# pip on a machine whose config lists local package folders warns once per package it finds none in; drop that noise.
quiet_pip() { "$@" 2> >(grep -v "^WARNING: Location 'file://.*' is ignored" >&2); }

step() { echo; echo "== $*"; }

# pytest's exit 5 (nothing collected) fails too: a selection that finds no test is a broken selection.
run_pytest() {  # <step name> <python> <pytest args...>
  local name=$1 py=$2 rc=0
  shift 2
  "$py" -m pytest "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "test.sh: $name selected no tests (pytest exit 5): check the 'vllm' marker and tests/conftest.py"
  fi
  [ "$rc" -eq 0 ] || FAILED+=("$name")
}

check_native() {
  local cxx
  # the compiler setuptools uses: $CXX, else the one Python was built with
  cxx=$("$PY" -c "import os, sysconfig; print((os.environ.get('CXX') or sysconfig.get_config_var('CXX') or 'c++').split()[0])")
  if ! command -v "$cxx" >/dev/null 2>&1; then
    echo "test.sh: no C++ compiler ($cxx) here: the native extensions were not expected to build"
    return 0
  fi
  local mod
  for mod in specdec.drafters._suffix_native specdec.drafters._llama_native specdec._host_flag; do
    if "$PY" -c "import $mod" 2>/dev/null; then
      echo "$mod: built and imports"
    else
      echo "test.sh: $mod did not build although $cxx is here; see why with: pip install -v --no-deps -e ."
      FAILED+=("native:$mod")
    fi
  done
}

tested_vllm_versions() {  # read from the file's text: specdec is not importable before step 1
  "$PY" - src/specdec/vllm_plugin/versions.py <<'PARSE_VERSIONS'
import ast, sys
def names(node):
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets if isinstance(t, ast.Name)}
tree = ast.parse(open(sys.argv[1]).read())
value = next(node.value for node in tree.body
             if isinstance(node, (ast.Assign, ast.AnnAssign)) and "TESTED_VLLM_VERSIONS" in names(node))
print(" ".join(ast.literal_eval(value)))
PARSE_VERSIONS
}

vllm_works() {  # <venv> <version> [stderr]: vLLM at that version imports on this venv's torch and sees its specdec
  "$1/bin/python" - "$2" "$(dirname "$("$PY" -c 'import torch; print(torch.__file__)')")" <<'CHECK' >/dev/null 2>"${3:-/dev/null}"
import sys
import torch, vllm, vllm.engine.arg_utils, specdec.vllm_plugin
assert vllm.__version__ == sys.argv[1], vllm.__version__
assert torch.__file__.startswith(sys.argv[2]), torch.__file__
CHECK
}

# vLLM's requirements (no extras) for this machine, minus the GPU-only ones, from the wheel's METADATA.
vllm_requirements() {  # <wheel>
  "$PY" - "$1" "$GPU_ONLY" <<'REQS'
import re, sys, zipfile
from packaging.requirements import Requirement
wheel, gpu_only = sys.argv[1], re.compile(sys.argv[2])
with zipfile.ZipFile(wheel) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    lines = zf.read(meta).decode().splitlines()
for line in lines:
    if line.startswith("Requires-Dist:"):
        req = Requirement(line.split(":", 1)[1].strip())
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if (req.marker is None or req.marker.evaluate({"extra": ""})) and not gpu_only.match(name):
            print(str(req))
REQS
}

make_vllm_venv() {  # <venv> <version>; called in an `||` list, where `set -e` is off: each step checks itself
  local venv=$1 version=$2 site wheel_dir
  rm -rf "$venv" && "$PY" -m venv "$venv" || return 1
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") || return 1
  point_at_caller "$site" || return 1
  wheel_dir="$venv/.specdec-download"  # goes with the venv when it is made again
  mkdir -p "$wheel_dir" || return 1
  quiet_pip "$venv/bin/pip" download -q --no-deps "vllm==$version" -d "$wheel_dir" || return 1
  vllm_requirements "$wheel_dir"/vllm-*.whl > "$wheel_dir/requirements.txt" || return 1
  # torch pinned to the caller's: a requirement wanting another torch fails here instead of pulling a CUDA build.
  "$PY" -c "import torch; print('torch==' + torch.__version__)" > "$wheel_dir/constraints.txt" || return 1
  quiet_pip "$venv/bin/pip" install -q -r "$wheel_dir/requirements.txt" -c "$wheel_dir/constraints.txt" || return 1
  # ... and the GPU-only packages a requirement pulled in (xgrammar requires triton) go again.
  local pulled
  pulled=$("$venv/bin/pip" list --format=freeze --path "$site" | cut -d= -f1 | tr 'A-Z_.' 'a-z--' | grep -E "$GPU_ONLY") || true
  [ -z "$pulled" ] || "$venv/bin/pip" uninstall -y -q $pulled || return 1
  quiet_pip "$venv/bin/pip" install -q --no-deps "$wheel_dir"/vllm-*.whl && rm -rf "$wheel_dir"
}

# The vLLM venv sees the site-packages named by SPECDEC_CALLER_SITE after its own (this venv's torch and editable
# specdec; their .pth files run too). The name travels in the environment, not in the shared venv, so two callers
# running at once each see their own.
point_at_caller() {  # <vLLM venv's site-packages>
  echo 'import os, site; os.environ.get("SPECDEC_CALLER_SITE") and site.addsitedir(os.environ["SPECDEC_CALLER_SITE"])' \
    > "$1/specdec-caller-site.pth"
}

vllm_glue_tests() {  # <version>
  local version=$1 venv="$VENV_ROOT/specdec-vllm-$1" site
  if site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" 2>/dev/null); then
    point_at_caller "$site" || true
  fi
  if ! vllm_works "$venv" "$version"; then
    echo "creating $venv (vLLM $version, vLLM's requirements without the GPU-only ones, this venv's torch)"
    make_vllm_venv "$venv" "$version" || { FAILED+=("vllm-$version:venv"); return 0; }
    if ! vllm_works "$venv" "$version"; then
      vllm_works "$venv" "$version" /dev/stderr 2>&1 | tail -5 || true
      echo "test.sh: vLLM $version does not import in $venv (error above)"
      FAILED+=("vllm-$version:import")
      return 0
    fi
  fi
  run_pytest "vllm-$version" "$venv/bin/python" -q -m vllm
}

step "install ($TORCH_PIN, then -e .[dev,onnx])"
quiet_pip "$PY" -m pip install -q "$TORCH_PIN"
quiet_pip "$PY" -m pip install -q -e ".[dev,onnx]"
SPECDEC_CALLER_SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
export SPECDEC_CALLER_SITE

step "ruff check"
"$PY" -m ruff check --output-format concise . || FAILED+=("ruff-check")
step "ruff format --check"
"$PY" -m ruff format --check . || FAILED+=("ruff-format")

step "CPU suite (not vllm)"
run_pytest "cpu-suite" "$PY" -q -m "not vllm"

step "native extensions"
check_native

versions=$(tested_vllm_versions)  # an unreadable list stops the script here (set -e) rather than testing nothing
for version in $versions; do
  step "vLLM glue tests against vLLM $version"
  vllm_glue_tests "$version"
done

echo
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "test.sh: FAILED: ${FAILED[*]}"
  exit 1
fi
echo "test.sh: all steps passed"
