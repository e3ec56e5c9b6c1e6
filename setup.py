"""Builds hvd_sparse, its C++ extension hvd_sparse._C (C++17, against the installed torch) and the
torch-free aggregator binary hvd_sparse/bin/hvd-sparse-aggregator."""
import os
import subprocess
from pathlib import Path

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

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
            ["csrc/codec.cpp", "csrc/omni/worker.cpp"],
            include_dirs=["csrc"],
            extra_compile_args=["-O3", "-std=c++17", "-march=x86-64-v2", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        )
    ],
    package_data={"hvd_sparse": [f"bin/{name}" for name in BINARIES]},
    entry_points={"console_scripts": ["hvd-sparse=hvd_sparse.cli:main"]},
    cmdclass={"build_ext": Build},
)
