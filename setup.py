"""Build hook for the optional native core of the suffix drafter (everything else is in pyproject.toml).

The extension uses only the CPython C API (no build dependency beyond setuptools and a C++17 compiler).
It is optional: if it fails to build, ``specdec.drafters.suffix`` falls back to the pure-Python engine.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "specdec.drafters._suffix_native",
            sources=["csrc/suffix_native.cpp"],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden"],
            optional=True,
        )
    ]
)
