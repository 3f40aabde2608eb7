"""Builds flashspark._C.

CPU kernels are always built. CUDA kernels are built when a CUDA toolkit and a
CUDA build of torch are both present, or when FLASHSPARK_CUDA=1 (FLASHSPARK_CUDA=0
turns them off). Target architectures come from FLASHSPARK_CUDA_ARCHS
(default "8.0;9.0a"). Nothing here needs a visible GPU.
"""

import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


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
# -fno-trapping-math: no FP trap is ever enabled, so GCC may if-convert and vectorize
# loops with floating-point selects (values unchanged); CMakeLists.txt uses it too.
cxx_flags = ["-O3", "-std=c++20", "-fopenmp", "-fno-trapping-math"]
sources = rel(glob.glob(os.path.join(ROOT, "csrc/torch/*.cpp")))
if with_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", os.environ.get("FLASHSPARK_CUDA_ARCHS", "8.0;9.0a"))
    sources += rel(glob.glob(os.path.join(ROOT, "csrc/kernels/*.cu")))
    ext = CUDAExtension(
        "flashspark._C",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc/include")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]},
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
