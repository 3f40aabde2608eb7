"""Builds flashspark._C.

CPU kernels are always built. CUDA kernels are built when a CUDA toolkit and a
CUDA build of torch are both present, or when FLASHSPARK_CUDA=1 (FLASHSPARK_CUDA=0
turns them off). Target architectures come from FLASHSPARK_CUDA_ARCHS (e.g. "9.0a"),
by default from csrc/build.json, which also holds the language standards and the
compiler flags (shared with CMakeLists.txt). Nothing here needs a visible GPU.
"""

import glob
import json
import os
import re

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(ROOT, "csrc", "build.json")) as f:
    BUILD = json.load(f)


def build_cuda() -> bool:
    flag = os.environ.get("FLASHSPARK_CUDA", "")
    toolkit = CUDA_HOME is not None
    torch_cuda = torch.version.cuda is not None
    if flag == "0":
        return False
    if flag == "1":
        if not (toolkit and torch_cuda):
            raise SystemExit(
                "FLASHSPARK_CUDA=1 needs a CUDA toolkit (found: %s) and a CUDA build of torch (found torch %s). "
                "The torch-free CUDA kernels alone build with CMake: cmake -S . -B build/cmake"
                % (CUDA_HOME, torch.__version__)
            )
        return True
    return toolkit and torch_cuda


def rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


with_cuda = build_cuda()
cxx_flags = [f"-std=c++{BUILD['cxx_standard']}", "-fopenmp", *BUILD["cxx_flags"]]
# torch's arch list spells CMake's "90a" as "9.0a"
default_archs = ";".join(re.sub(r"^(\d+)(\d)([a-z]?)$", r"\1.\2\3", a) for a in BUILD["cuda_architectures"])
sources = rel(glob.glob(os.path.join(ROOT, "csrc/torch/*.cpp")))
if with_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", os.environ.get("FLASHSPARK_CUDA_ARCHS", default_archs))
    sources += rel(glob.glob(os.path.join(ROOT, "csrc/kernels/*.cu")))
    ext = CUDAExtension(
        "flashspark._C",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc/include")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": [f"-std=c++{BUILD['cuda_standard']}", *BUILD["cuda_flags"]]},
        extra_link_args=["-fopenmp"],
        define_macros=[("FLASHSPARK_WITH_CUDA", "1")],
    )
else:
    sources = [s for s in sources if not s.endswith("_cuda.cpp")]
    ext = CppExtension(
        "flashspark._C",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc/include")],
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=["-fopenmp"],
    )



def asset_files():
    """Shipped models and tokenizer, relative to the package directory."""
    pkg = os.path.join(ROOT, "python", "flashspark")
    found = glob.glob(os.path.join(pkg, "assets", "**", "*"), recursive=True)
    return sorted(os.path.relpath(p, pkg) for p in found if os.path.isfile(p))


setup(
    packages=find_packages("python", exclude=["flashspark.assets*"]),
    package_dir={"": "python"},
    package_data={"flashspark": asset_files()},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
