"""Builds hvd_sparse and its C++ extension hvd_sparse._C (C++17, against the installed torch)."""
import glob
import shutil

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension


def cuda_extensions() -> list:
    """hvd_sparse._cuda (csrc/cuda/), only where torch has CUDA and nvcc exists."""
    if torch.version.cuda is None or shutil.which("nvcc") is None:
        return []
    sources = ["csrc/cuda/binding.cpp", *sorted(glob.glob("csrc/cuda/*.cu"))]
    return [CUDAExtension("hvd_sparse._cuda", sources,
                          include_dirs=["csrc/cuda"],
                          extra_compile_args={"cxx": ["-O3", "-std=c++17"],
                                              "nvcc": ["-O3", "-std=c++17"]})]


setup(
    name="hvd-sparse",
    version="0.1.0",
    description="Sparse gradient synchronization for Horovod",
    packages=find_packages(include=["hvd_sparse", "hvd_sparse.*"]),
    python_requires=">=3.10",
    ext_modules=[
        CppExtension(
            "hvd_sparse._C",
            ["csrc/codec.cpp", "csrc/sparsify.cpp", "csrc/cuda_host.cpp"],
            include_dirs=["csrc"],
            extra_compile_args=["-O3", "-std=c++17", "-march=x86-64-v2", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        ),
        *cuda_extensions(),
    ],
    cmdclass={"build_ext": BuildExtension},
)
