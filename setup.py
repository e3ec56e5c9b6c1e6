"""Builds hvd_sparse, its C++ extension hvd_sparse._C (C++17, against the installed torch), the
torch-free aggregator binary hvd_sparse/bin/hvd-sparse-aggregator and, where torch has CUDA and
nvcc exists, the CUDA kernels."""
import glob
import os
import shutil
import subprocess
from pathlib import Path

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


# torch-free executables: name -> source
BINARIES = {"hvd-sparse-aggregator": "csrc/omni/aggregator.cpp",
            "hvd-sparse-udpblast": "csrc/omni/udpblast.cpp"}  # raw UDP limit, for benchmarks


class Build(BuildExtension):
    """Also compiles the aggregator: a plain executable, so servers that only aggregate need
    neither Python packages nor torch to run it."""

    def run(self) -> None:
        super().run()
        root = Path(__file__).parent if self.inplace else Path(self.build_lib)
        for name, src in BINARIES.items():
            out = root / "hvd_sparse" / "bin" / name
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = [os.environ.get("CXX", "c++"), "-O3", "-std=c++17", "-march=x86-64-v2",
                   "-Wall", "-pthread", "-Icsrc", src, "-o", str(out)]
            print(" ".join(cmd))
            subprocess.check_call(cmd)


setup(
    name="hvd-sparse",
    version="0.1.0",
    description="Sparse gradient synchronization for Horovod",
    packages=find_packages(include=["hvd_sparse", "hvd_sparse.*"]),
    python_requires=">=3.10",
    ext_modules=[
        CppExtension(
            "hvd_sparse._C",
            ["csrc/codec.cpp", "csrc/fresh_zeros.cpp", "csrc/sparsify.cpp", "csrc/rows.cpp",
             "csrc/cuda_host.cpp",
             "csrc/omni/worker.cpp"],
            include_dirs=["csrc"],
            extra_compile_args=["-O3", "-std=c++17", "-march=x86-64-v2", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        ),
        *cuda_extensions(),
    ],
    package_data={"hvd_sparse": [f"bin/{name}" for name in BINARIES]},
    entry_points={"console_scripts": ["hvd-sparse=hvd_sparse.cli:main"]},
    cmdclass={"build_ext": Build},
)
