"""Builds tokenmill's compiled CPU core: the same C++ sources (csrc/) compiled three times, once per
instruction-set variant, into three extension modules. kernels/native.py imports the best one this
CPU can run, as ggml's GGML_CPU_ALL_VARIANTS does. Every module is optional: without a compiler the
package still installs and runs on its PyTorch reference path."""
import glob
import os
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext, has_flag
from setuptools import setup

ParallelCompile("TOKENMILL_BUILD_JOBS", default=os.cpu_count() or 1).install()

# name -> compiler flags. The avx512 variant needs F/BW/VL/DQ and VNNI (Cascade Lake, Ice Lake,
# Sapphire Rapids, Zen 4); bf16 is converted with integer ops, so AVX512_BF16 is not required.
VARIANTS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c",
               "-mbmi2"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mbmi2"],
    "scalar": [],
}
SOURCES = sorted(glob.glob("csrc/*.cpp"))
HEADERS = sorted(glob.glob("csrc/*.h"))  # a changed header rebuilds the variant (setuptools tracks `depends`)
COMMON = ["-O3", "-pthread", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wno-unknown-pragmas"]


def extension(variant: str, flags: list[str]) -> Pybind11Extension:
    return Pybind11Extension(
        f"tokenmill._native_{variant}", SOURCES, depends=HEADERS, cxx_std=17, include_dirs=["csrc"],
        define_macros=[("TOKENMILL_MODULE", f"_native_{variant}"), ("TOKENMILL_VARIANT", f'"{variant}"')],
        extra_compile_args=COMMON + flags, extra_link_args=["-pthread"], optional=True)


# AMX-INT8 (csrc/qmatmul_amx.h) rides in the avx512 variant when the compiler knows the flags (gcc 11+);
# it only runs where the CPU has it and Linux grants the tile state (csrc/cpu.cpp).
AMX_FLAGS = ["-mamx-tile", "-mamx-int8"]


class BuildVariants(build_ext):
    """The variants compile the same sources with other flags, so each gets its own object directory,
    and they build one after another (setuptools' parallel build would race on the shared build_temp;
    files within a variant still compile in parallel, through ParallelCompile)."""

    def finalize_options(self):
        super().finalize_options()
        self.parallel = None

    def build_extension(self, ext):
        if ext.name.endswith("_avx512") and all(has_flag(self.compiler, f) for f in AMX_FLAGS):
            ext.extra_compile_args = ext.extra_compile_args + AMX_FLAGS
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base


ext_modules = [] if os.environ.get("TOKENMILL_NATIVE") == "0" else \
    [extension(v, f) for v, f in VARIANTS.items()] if sys.platform.startswith("linux") else []

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildVariants})
