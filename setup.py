"""Builds hvd_sparse, its C++ extension hvd_sparse._C (C++17, against the installed torch), the
torch-free protocol description hvd_sparse._protocol (plain CPython API), the torch-free
aggregator binary hvd_sparse/bin/hvd-sparse-aggregator and, where torch has CUDA and nvcc
exists, the CUDA kernels.

The extension must be compiled against the torch it will run with, so build without pip's
isolated build environment, in a venv that already has torch and Horovod:

    pip install --no-build-isolation .        # or -e . (what `make build` does)
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError:
    sys.exit("hvd-sparse builds against the installed torch, which this Python cannot import: "
             "install torch and Horovod first, then pip install --no-build-isolation .")

ROOT = Path(__file__).resolve().parent
# HVD_SPARSE_SANITIZE=1 (make sanitize-ext): only hvd_sparse._C and _protocol, with ASan and
# UBSan, into build/sanitize-ext/ whatever the command line says, so a sanitized build can never
# replace the in-place hvd_sparse/_C*.so that everything else imports. -O1: ASan's advice for
# usable stacks, and it compiles faster than -O3; -g1: line numbers in reports; -fno-wrapv
# undoes the -fwrapv of Python's own CFLAGS, under which UBSan cannot see signed overflow (the
# aggregator binary, which shares the core, is built without it).
SANITIZE = os.environ.get("HVD_SPARSE_SANITIZE") == "1"
SANITIZE_DIR = ROOT / "build" / "sanitize-ext"
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                  "-fno-omit-frame-pointer"]


def cuda_extensions() -> list:
    """hvd_sparse._cuda (csrc/cuda/), only where torch has CUDA and nvcc exists."""
    if torch.version.cuda is None or shutil.which("nvcc") is None:
        return []
    sources = ["csrc/cuda/binding.cpp", *sorted(glob.glob("csrc/cuda/*.cu"))]
    return [CUDAExtension("hvd_sparse._cuda", sources,
                          include_dirs=["csrc/cuda"],
                          extra_compile_args={"cxx": ["-O3", "-std=c++17"],
                                              "nvcc": ["-O3", "-std=c++17"]})]


# torch-free executables: name -> sources. The aggregator gains the DPDK transport where
# pkg-config finds libdpdk (Debian's libdpdk-dev); without it, --transport dpdk says so.
BINARIES = {"hvd-sparse-aggregator": ["csrc/omni/aggregator/main.cpp",
                                      "csrc/omni/aggregator/core.cpp", "csrc/omni/auth.cpp",
                                      "csrc/omni/transport/udp/transport.cpp"],
            "hvd-sparse-udpblast": ["csrc/omni/udpblast.cpp",  # raw UDP limit, for benchmarks
                                    "csrc/omni/transport/udp/transport.cpp"]}
DPDK_SOURCES = ["csrc/omni/transport/dpdk/transport.cpp"]
# Built only with DPDK: the emulated switch (its ports are DPDK ports).
SWITCH = ("hvd_sparse/bin/hvd-sparse-switch", ["csrc/switch/main.cpp", "csrc/switch/ports.cpp",
                                               "csrc/switch/control.cpp",
                                               "csrc/switch/pipeline.cpp"])


def dpdk_flags() -> tuple[list[str], list[str]] | None:
    """(compile flags, link flags) of libdpdk from pkg-config, or None when it is absent."""
    try:
        cflags = subprocess.run(["pkg-config", "--cflags", "libdpdk"], capture_output=True,
                                text=True, check=True).stdout.split()
        libs = subprocess.run(["pkg-config", "--libs", "libdpdk"], capture_output=True,
                              text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return cflags, libs


def binary_command(name: str, out: Path) -> list[str]:
    sources = [str(ROOT / s) for s in BINARIES[name]]
    # OpenSSL (libcrypto) for the aggregator's packet authentication (csrc/omni/auth.h).
    flags: list[str] = ["-lcrypto"] if name == "hvd-sparse-aggregator" else []
    if name == "hvd-sparse-aggregator" and (dpdk := dpdk_flags()) is not None:
        sources += [str(ROOT / s) for s in DPDK_SOURCES]
        flags += ["-DHVD_SPARSE_DPDK", *dpdk[0], *dpdk[1]]
    elif name == "hvd-sparse-aggregator":
        print("hvd-sparse: libdpdk not found by pkg-config: the aggregator is built without "
              "the DPDK transport")
    return [os.environ.get("CXX", "c++"), "-O3", "-std=c++17", "-march=x86-64-v2", "-Wall",
            "-pthread", f"-I{ROOT / 'csrc'}", *sources, "-o", str(out), *flags]


def up_to_date(out: Path, sources: list[str]) -> bool:
    """True when ``out`` is newer than its sources and every header they could include."""
    if not out.exists():
        return False
    deps = [*(ROOT / s for s in sources), *ROOT.glob("csrc/**/*.h")]
    return out.stat().st_mtime >= max(d.stat().st_mtime for d in deps)


class Build(BuildExtension):
    """Also compiles the aggregator: a plain executable, so servers that only aggregate need
    neither Python packages nor torch to run it."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if SANITIZE:
            if self.inplace:
                sys.exit("HVD_SPARSE_SANITIZE=1 builds into build/sanitize-ext/ only, never "
                         "--inplace (make sanitize-ext)")
            self.build_lib, self.build_temp = str(SANITIZE_DIR), str(SANITIZE_DIR / "temp")
            # _protocol too: the sanitized tree must not mix in a _protocol built from other
            # sources, and it parses packets as well
            self.extensions = [e for e in self.extensions
                               if e.name in ("hvd_sparse._C", "hvd_sparse._protocol")]
        elif self.editable_mode:
            # pip install -e compiles in a fresh temporary directory, i.e. everything from
            # scratch (minutes); the checkout's own build directory lets ninja redo only what
            # changed since the last `setup.py build_ext --inplace` (make build).
            plat = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
            self.build_temp = str(ROOT / "build" / f"temp.{plat}")

    def run(self) -> None:
        super().run()
        if SANITIZE:  # make sanitize builds its own sanitized executables
            return
        root = ROOT if self.inplace else Path(self.build_lib)
        self.build_switch(root)
        for name, sources in BINARIES.items():
            out = root / "hvd_sparse" / "bin" / name
            if up_to_date(out, [*sources, *DPDK_SOURCES]):
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = binary_command(name, out)
            print(" ".join(cmd))
            subprocess.check_call(cmd)

    def build_switch(self, root: Path) -> None:
        path, sources = SWITCH
        out = root / path
        dpdk = dpdk_flags()
        if dpdk is None:
            print("hvd-sparse: libdpdk not found by pkg-config: the emulated switch is not built")
            return
        if up_to_date(out, sources):
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [os.environ.get("CXX", "c++"), "-O3", "-std=c++17", "-Wall", "-pthread",
               *(str(ROOT / s) for s in sources), "-o", str(out), *dpdk[0], *dpdk[1]]
        print(" ".join(cmd))
        subprocess.check_call(cmd)


setup(
    name="hvd-sparse",
    version="0.1.0",
    description="Sparse gradient synchronization for Horovod and PyTorch DDP",
    # hvd_sparse.tools.lab is what scripts/ and tests/ share (it needs rich, matplotlib and
    # scikit-learn): lab code, left out of the wheel. An editable install maps the hvd_sparse
    # folder itself, so checkouts installed that way (make build, the images) import it.
    packages=find_packages(include=["hvd_sparse", "hvd_sparse.*"],
                           exclude=["hvd_sparse.tools.lab", "hvd_sparse.tools.lab.*"]),
    python_requires=">=3.10",
    # The extension is built against the torch already installed (pip --no-build-isolation)
    # and runs with that release only (its C++ ABI): the wheel requires it, whatever its local
    # label (+cpu, +cu124). Horovod only for its front end; the DDP front end, the aggregator
    # and the tools run without it.
    install_requires=["psutil", f"torch=={torch.__version__.split('+')[0]}"],
    extras_require={"horovod": ["horovod>=0.28.1"]},
    ext_modules=[
        CppExtension(
            "hvd_sparse._C",
            ["csrc/module.cpp", "csrc/codec.cpp", "csrc/fresh_zeros.cpp", "csrc/sparsify.cpp",
             "csrc/rows.cpp", "csrc/cuda/host.cpp", "csrc/omni/worker/binding.cpp",
             "csrc/omni/worker/worker.cpp", "csrc/omni/worker/engine.cpp",
             "csrc/omni/transport/udp/transport.cpp", "csrc/omni/aggregator/binding.cpp",
             "csrc/omni/aggregator/core.cpp", "csrc/omni/auth.cpp", "csrc/switch/binding.cpp",
             "csrc/switch/pipeline.cpp"],
            include_dirs=["csrc"],
            extra_compile_args=[*(["-O1", "-g1", "-fno-wrapv", *SANITIZE_FLAGS] if SANITIZE
                                  else ["-O3"]),
                                "-std=c++17", "-march=x86-64-v2", "-fopenmp"],
            extra_link_args=["-fopenmp", *(SANITIZE_FLAGS if SANITIZE else [])],
            libraries=["crypto"],
        ),
        # No torch, no pybind11: tools that only speak the wire protocol import it anywhere.
        Extension("hvd_sparse._protocol", ["csrc/omni/protocol_module.cpp"],
                  include_dirs=["csrc"],
                  extra_compile_args=[*(["-O1", "-g1", "-fno-wrapv", *SANITIZE_FLAGS]
                                        if SANITIZE else ["-O2"]), "-std=c++17"],
                  extra_link_args=SANITIZE_FLAGS if SANITIZE else []),
        *cuda_extensions(),
    ],
    package_data={"hvd_sparse": [f"bin/{name}" for name in [*BINARIES, "hvd-sparse-switch"]]
                  + ["tools/testbed/collectives.rules"]},
    entry_points={"console_scripts": ["hvd-sparse=hvd_sparse.tools.cli:main"]},
    cmdclass={"build_ext": Build},
)
