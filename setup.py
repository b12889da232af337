"""Build gpubench's compiled probes and the replay engine's block pool.

Three pybind11 extensions:
  gpubench._cpu   C++17 from csrc/cpu/  (always built; OpenMP; -march=native unless GPUBENCH_NATIVE=0)
  scheduling._kvpool  C++17 from csrc/sim/ (always built): the replay engine's KV block pool
  gpubench._cuda  csrc/cuda/*.cu compiled by nvcc + csrc/cuda/*.cpp bindings compiled by the host
                  compiler, linked against cudart_static so that importing it needs no driver.
                  Built when nvcc is found (CUDA_HOME, then PATH); GPUBENCH_CUDA=1 makes a missing
                  or failing toolkit a hard error, GPUBENCH_CUDA=0 skips it.
GPUBENCH_CUDA_ARCHS: ";"-separated SM list (default "80;86;89;90a;100;120", less what the local nvcc
cannot build (`nvcc --list-gpu-arch`): every architecture of the SKU table, A100 to B200 and RTX
5090; 90a, not 90, so H100/H200 get the wgmma kernels, which exist only in arch-specific sm_90a
code). PTX of the *oldest* listed architecture is embedded too, so any newer GPU can JIT it (PTX of
the newest would run on nothing older). Building all six takes a few
minutes on two cores; set GPUBENCH_CUDA_ARCHS to the one GPU you have (scripts/device_check.sh does),
or GPUBENCH_CUDA=0 on a machine without a GPU that does not need the extension.
Without setuptools (a bare device image): scripts/build_cuda_ext.sh builds the same extension with
nvcc and the host compiler alone.
"""
import glob
import os
import shutil
import subprocess
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

VERSION = "0.1.0"
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "80;86;89;90a;100;120"


def _env_flag(name):
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    return value not in ("0", "false", "no", "off")


def locate_cuda():
    """Return (cuda_home, nvcc) or (None, reason). Runs only when building, never at import."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        nvcc = os.path.join(home, "bin", "nvcc")
        if not os.path.exists(nvcc):
            return None, f"CUDA_HOME={home} has no bin/nvcc"
        return home, nvcc
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None, "nvcc not found on PATH and CUDA_HOME is not set"
    # nvcc on PATH may be a wrapper script outside the toolkit: take the first candidate home that
    # really holds the runtime headers.
    for home in (os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda", "/opt/cuda"):
        if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return home, nvcc
    return None, f"found {nvcc} but no toolkit with include/cuda_runtime.h (set CUDA_HOME)"


def nvcc_supported_archs(nvcc):
    """The compute capabilities ``nvcc --list-gpu-arch`` says it can build ("90", "100", ...), or None
    when it cannot say (an nvcc older than 11.0 has no such option)."""
    try:
        out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    found = {w.split("_", 1)[1] for w in out.stdout.split() if w.startswith("compute_")}
    return found if out.returncode == 0 and found else None


def cuda_archs(nvcc=None):
    """GPUBENCH_CUDA_ARCHS as given; else the default list less what the local nvcc cannot build
    (sm_100 and sm_120 need CUDA 12.8: an older toolkit builds the rest instead of failing)."""
    given = os.environ.get("GPUBENCH_CUDA_ARCHS")
    archs = [a.strip() for a in (given or DEFAULT_ARCHS).split(";") if a.strip()]
    if given or nvcc is None:
        return archs
    supported = nvcc_supported_archs(nvcc)
    if supported is None:
        return archs
    kept = [a for a in archs if a.rstrip("af") in supported]
    dropped = [a for a in archs if a not in kept]
    if dropped:
        print(f"gpubench: {nvcc} cannot build sm_{{{','.join(dropped)}}}; building sm_{{{','.join(kept)}}} "
              "(a newer CUDA toolkit builds them all)", file=sys.stderr, flush=True)
    return kept


def cuda_gencode_flags(nvcc):
    """SASS for every listed architecture, plus PTX of the oldest one (JIT for anything newer)."""
    archs = cuda_archs(nvcc)
    flags = []
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    if archs:
        # An arch-specific "a" target's PTX cannot be JIT-compiled for other GPUs: take the plain one.
        oldest = min(archs, key=lambda a: int(a.rstrip("af")))
        plain = oldest.rstrip("af")
        flags += ["-gencode", f"arch=compute_{plain},code=compute_{plain}"]
    return flags


class GpubenchBuildExt(build_ext):
    """Routes .cu sources of the _cuda extension through nvcc, then links them with the host compiler."""

    def build_extension(self, ext):
        if ext.name == "gpubench._cuda":
            self._compile_cu(ext)
        super().build_extension(ext)

    def _compile_cu(self, ext):
        cuda_home, nvcc = ext._gpubench_cuda
        gencode = cuda_gencode_flags(nvcc)
        extra = os.environ.get("GPUBENCH_NVCC_FLAGS", "").split()
        os.makedirs(self.build_temp, exist_ok=True)
        for src in ext._gpubench_cu_sources:
            obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
            cmd = [nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17", "-Xcompiler", "-fPIC",
                   "-I", os.path.join(HERE, "csrc", "cuda"), *gencode, *extra]
            print("nvcc:", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            ext.extra_objects.append(obj)


def cpu_extension():
    native = _env_flag("GPUBENCH_NATIVE")
    flags = ["-O3", "-fopenmp", "-std=c++17"]
    if native is not False:
        flags.append("-march=native")
    return Pybind11Extension(
        "gpubench._cpu",
        sorted(glob.glob("csrc/cpu/*.cpp")),
        include_dirs=["csrc/cpu"],
        extra_compile_args=flags,
        extra_link_args=["-fopenmp"],
        define_macros=[("GPUBENCH_VERSION", f'"{VERSION}"')],
        cxx_std=17,
    )


def sim_extension():
    """The replay engine's KV block pool (portable flags: no -march=native, no OpenMP)."""
    return Pybind11Extension(
        "scheduling._kvpool",
        ["csrc/sim/kvpool.cpp"],
        extra_compile_args=["-O2"],
        cxx_std=17,
    )


def cuda_extension():
    want = _env_flag("GPUBENCH_CUDA")
    if want is False:
        print("gpubench: skipping gpubench._cuda (GPUBENCH_CUDA=0)")
        return None
    cuda_home, nvcc_or_reason = locate_cuda()
    if cuda_home is None:
        if want:
            sys.exit(f"gpubench: GPUBENCH_CUDA=1 but {nvcc_or_reason}")
        print(f"gpubench: skipping gpubench._cuda ({nvcc_or_reason})")
        return None
    lib_dirs = [d for d in (os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib"),
                            os.path.join(cuda_home, "targets", "x86_64-linux", "lib")) if os.path.isdir(d)]
    # GEMMs run through torch's cuBLAS (gpubench.backends.cuda.torch_gemm): the extension links
    # cudart only, statically, so importing it needs no driver and no CUDA wheel layout.
    macros = [("GPUBENCH_VERSION", f'"{VERSION}"')]
    libs = ["cudart_static", "dl", "rt", "pthread"]
    inc = ["csrc/cuda", os.path.join(cuda_home, "include")]
    ext = Pybind11Extension(
        "gpubench._cuda",
        sorted(glob.glob("csrc/cuda/*.cpp")),
        include_dirs=inc,
        library_dirs=lib_dirs,
        libraries=libs,
        define_macros=macros,
        extra_compile_args=["-O3", "-std=c++17"],
        # The static cudart's cuda* symbols stay inside the extension: exported, they would interpose
        # on (or be interposed by) torch's own libcudart in the same process.
        extra_link_args=["-Wl,--exclude-libs,ALL"],
        cxx_std=17,
    )
    ext._gpubench_cuda = (cuda_home, nvcc_or_reason)
    ext._gpubench_cu_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    # Say so before the long part: SASS for every listed GPU takes minutes on a small machine.
    print(f"gpubench: building gpubench._cuda with {nvcc_or_reason} for sm_{{{','.join(cuda_archs(nvcc_or_reason))}}} "
          f"({len(ext._gpubench_cu_sources)} .cu files; a few minutes on 2 cores). GPUBENCH_CUDA_ARCHS=<your GPU> "
          "builds one architecture, GPUBENCH_CUDA=0 skips the extension.", file=sys.stderr, flush=True)
    return ext


# GPUBENCH_ONLY=cpu builds the C++ extensions only, =cuda the CUDA one only (a developer's quick
# rebuild); the default builds all three.
_only = os.environ.get("GPUBENCH_ONLY", "")
ext_modules = [] if _only == "cuda" else [cpu_extension(), sim_extension()]
cuda_ext = cuda_extension() if _only != "cpu" else None
if cuda_ext is not None:
    ext_modules.append(cuda_ext)

setup(ext_modules=ext_modules, cmdclass={"build_ext": GpubenchBuildExt})
