"""GPU and CPU benchmark and profiling harnesses (a plain folder, not installed with specdec).

Run them from the repository root, e.g. ``python -m benchmarks.bench_vllm --help``; they import the installed
``specdec`` package. The user tool is ``specdec-eval`` (``specdec.eval``).
"""
