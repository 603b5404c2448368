"""Build hooks for the optional native cores: the suffix drafter, the draft model's forward and schedule mode's
host flag (rest: pyproject.toml).

The extensions use only the CPython C API (no build dependency beyond setuptools and a C++20 compiler).
All are optional: without them ``specdec.drafters.suffix`` falls back to its pure-Python engine, the draft
model to its other backends (``native`` then reports itself unavailable) and schedule mode fills drafts from the
host (no device wait).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "specdec.drafters._suffix_native",
            sources=["csrc/suffix_native.cpp"],
            depends=[
                "csrc/suffix_calib.inc",
                "csrc/suffix_lane.inc",
                "csrc/suffix_lane_tokens.inc",
                "csrc/suffix_lane_async.inc",
                "csrc/job_thread.inc",
                "csrc/worker_pool.inc",
            ],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-pthread"],  # the lane thread
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(  # schedule mode's device wait: the pinned word a CUDA stream waits on, and its watchdog
            "specdec._host_flag",
            sources=["csrc/host_flag.cpp"],
            language="c++",
            extra_compile_args=["-O2", "-std=c++17", "-fvisibility=hidden", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "specdec.drafters._llama_native",
            sources=["csrc/llama_native.cpp"],
            depends=["csrc/llama_native.h", "csrc/llama_kernels.inc", "csrc/thread_pool.h"],
            language="c++",
            extra_compile_args=[
                "-O3",
                "-std=c++20",
                "-ffp-contract=fast",
                "-fvisibility=hidden",
                "-Wno-psabi",
                "-pthread",
            ],
            extra_link_args=["-pthread"],
            optional=True,
        ),
    ]
)
