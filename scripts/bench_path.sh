# Sourced by the device scripts, in the repository root: the harnesses live in ./benchmarks (not installed), so a
# folder holding only a link to it goes on PYTHONPATH; `python -m benchmarks.X` (and the workers it starts) find
# them while `import specdec` stays the installed package.
BENCH_PATH="$(mktemp -d)"
ln -s "$PWD/benchmarks" "$BENCH_PATH/benchmarks"
export PYTHONPATH="$BENCH_PATH${PYTHONPATH:+:$PYTHONPATH}"
