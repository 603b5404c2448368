"""Build hooks for the optional native cores: the suffix drafter and the draft model's forward (rest: pyproject.toml).

The extensions use only the CPython C API (no build dependency beyond setuptools and a C++20 compiler).
Both are optional: without them ``specdec.drafters.suffix`` falls back to its pure-Python engine and the draft
model to its other backends (``native`` then reports itself unavailable).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "specdec.drafters._suffix_native",
            sources=["csrc/suffix_native.cpp"],
            depends=["csrc/suffix_lane.inc", "csrc/suffix_lane_async.inc", "csrc/job_thread.inc", "csrc/worker_pool.inc"],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-pthread"],  # defer_cache's thread
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "specdec.drafters._llama_native",
            sources=["csrc/llama_native.cpp"],
            depends=["csrc/llama_native.h", "csrc/llama_kernels.inc", "csrc/thread_pool.h"],
            language="c++",
            extra_compile_args=["-O3", "-std=c++20", "-ffp-contract=fast", "-fvisibility=hidden", "-Wno-psabi",
                                "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
    ]
)
