"""Builds hvd_sparse and its C++ extension hvd_sparse._C (C++17, against the installed torch)."""
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

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
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
