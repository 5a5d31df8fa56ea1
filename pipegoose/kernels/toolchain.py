"""Find the CUDA toolkit, host compiler and target architectures for building kernels, and check them.

Everything here is probed once per process (``functools.lru_cache``); tests monkeypatch the probes.

* :func:`find_cuda_home` -- ``$CUDA_HOME``/``$CUDA_PATH``, else ``/usr/local/cuda``, else the toolkit of the
  ``nvcc`` on ``PATH`` (a wrapper script such as ``/usr/local/bin/nvcc`` that execs the real compiler is resolved
  by asking nvcc itself, ``nvcc --dryrun``). A folder counts as a toolkit only with ``bin/nvcc`` AND
  ``include/cuda_runtime.h`` (torch's own guess, ``/usr/local``, often lacks the headers).
* :func:`cuda_extra_include_dirs` -- the pip CUDA wheels' include folders (``site-packages/nvidia/cu13/include``,
  ``nvidia/{cublas,cusparse,cusolver}/include``, ...) holding each header of :data:`TORCH_CUDA_HEADERS` (the CUDA
  library headers torch's ``ATen/cuda/CUDAContextLight.h`` includes) that the toolkit lacks, searched after the
  toolkit's own folders (:func:`cuda_extra_include_flags`: ``-idirafter``); :func:`cuda_header_lookup` also says which of them are found nowhere (preflight's "CUDA headers" row).
* :func:`arch_list` -- the ``TORCH_CUDA_ARCH_LIST`` to build for: ``$TORCH_CUDA_ARCH_LIST`` when set (with any
  visible GPU it does not cover added), else the visible GPUs (PTX for the newest), else a default table matching
  nvcc's major version. ``compute_70`` is never assumed.
* :func:`preflight` -- the checks, each a :class:`Check` with an actionable ``fix``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Check",
    "Arch",
    "find_cuda_home",
    "is_cuda_toolkit",
    "nvcc_version",
    "torch_cuda_version",
    "host_compiler",
    "nvcc_host_compiler",
    "TORCH_CUDA_HEADERS",
    "cuda_header_lookup",
    "cuda_extra_include_dirs",
    "cuda_extra_include_flags",
    "visible_capabilities",
    "parse_arch_list",
    "format_arch_list",
    "default_arch_list",
    "arch_list",
    "arch_covers",
    "ninja_path",
    "max_jobs_check",
    "preflight",
]

# Oldest architecture each nvcc major version still compiles for (CUDA 13 dropped sm_50..sm_72).
_MIN_ARCH = {10: (3, 0), 11: (3, 5), 12: (5, 0), 13: (7, 5)}
# Host compilers: the oldest gcc torch's headers build with, and the newest each nvcc major accepts.
_GCC_MIN = 9
_GCC_MAX = {11: 11, 12: 14, 13: 15}
_CLANG_MAX = {11: 13, 12: 19, 13: 20}
# Where a toolkit is looked for after $CUDA_HOME/$CUDA_PATH and before nvcc on PATH.
DEFAULT_TOOLKITS = ("/usr/local/cuda",)
# The CUDA library headers torch's ATen/cuda/CUDAContextLight.h (which CUDAContext.h includes) includes (torch 2.14;
# cudss.h only in torch's own builds with USE_CUDSS), and the pip wheel of each ("nvidia-<name>", "-cu12" for CUDA 12).
# A toolkit without the math libraries (a cuda-nvcc + cudart install, a slim container) lacks them; torch's CUDA 13
# wheels put them in one nvidia/cu13/include, its CUDA 12 wheels in nvidia/cublas, nvidia/cusparse and
# nvidia/cusolver/include (cusolverDn.h and cublasLt.h were not looked for: a review).
TORCH_CUDA_HEADERS = {
    "cusparse.h": "cusparse",
    "cublas_v2.h": "cublas",
    "cublasLt.h": "cublas",
    "cusolverDn.h": "cusolver",
}


@dataclass(frozen=True)
class Check:
    """One preflight check: ``ok`` False means building is impossible (``fix`` says what to do)."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    warn: bool = False  # ok but suspicious (e.g. a newer host compiler than nvcc supports officially)


@dataclass(frozen=True, order=True)
class Arch:
    """A CUDA compute capability, e.g. ``Arch(9, 0)`` = sm_90; ``ptx`` also embeds PTX for JIT on newer GPUs."""

    major: int
    minor: int
    ptx: bool = False
    suffix: str = ""  # "a" / "f" arch-specific variants (sm_90a): no forward compatibility

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{self.suffix}" + ("+PTX" if self.ptx else "")

    @property
    def sm(self) -> str:
        return f"sm_{self.major}{self.minor}{self.suffix}"


# --------------------------------------------------------------------------------------------------- CUDA


def is_cuda_toolkit(path: str | os.PathLike | None) -> bool:
    """True when ``path`` holds ``bin/nvcc`` and ``include/cuda_runtime.h``."""
    if not path:
        return False
    p = Path(path)
    return (p / "bin" / "nvcc").is_file() and (p / "include" / "cuda_runtime.h").is_file()


def _toolkit_of_nvcc(nvcc: str) -> Path | None:
    real = Path(nvcc).resolve()
    if is_cuda_toolkit(real.parent.parent):
        return real.parent.parent
    # A wrapper script: nvcc reports its own folder in a dry run ("#$ _HERE_=/usr/local/cuda-13.0/bin").
    with tempfile.TemporaryDirectory(prefix="pipegoose-nvcc-") as d:
        src = Path(d) / "probe.cu"
        src.write_text("")
        try:
            out = subprocess.run([nvcc, "--dryrun", "-c", str(src), "-o", str(Path(d) / "probe.o")],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
    m = re.search(r"^#\$ _HERE_=(.+)$", out.stdout + out.stderr, re.M)
    if m:
        top = Path(m.group(1).strip()).resolve().parent
        if is_cuda_toolkit(top):
            return top
    return None


def _cuda_env_toolkit() -> tuple[Path | None, list[str]]:
    """(the toolkit that $CUDA_HOME, else $CUDA_PATH, names, or None; ``VAR='value'`` of each of them that is set but
    is not a toolkit and was looked at before it): :func:`find_cuda_home`'s first step, and what :func:`preflight`
    reports as passed over."""
    passed_over: list[str] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        v = os.environ.get(var)
        if not v:
            continue
        if is_cuda_toolkit(v):
            return Path(v).resolve(), passed_over
        passed_over.append(f"{var}={v!r}")
    return None, passed_over


@functools.lru_cache(maxsize=None)
def find_cuda_home() -> Path | None:
    """The CUDA toolkit folder, or None. Order: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, nvcc on PATH.

    A $CUDA_HOME or $CUDA_PATH that is set but is not a toolkit (no ``bin/nvcc`` with ``include/cuda_runtime.h``: a
    typo, or a prefix such as /usr/local whose nvcc is a wrapper) is passed over with a ``UserWarning`` that names it
    and what is used instead (once per process: the result is cached)."""
    found, passed_over = _cuda_env_toolkit()
    if found is None:
        found = next((Path(c).resolve() for c in DEFAULT_TOOLKITS if is_cuda_toolkit(c)), None)
    if found is None:
        nvcc = shutil.which("nvcc")
        found = _toolkit_of_nvcc(nvcc) if nvcc else None
    for what in passed_over:
        warnings.warn(f"{what} is not a CUDA toolkit (expected bin/nvcc and include/cuda_runtime.h there); "
                      + (f"using {found} instead" if found is not None else "no other toolkit found either"),
                      UserWarning, stacklevel=2)
    return found


@functools.lru_cache(maxsize=None)
def nvcc_version(cuda_home: Path | None = None) -> tuple[int, int] | None:
    """``(major, minor)`` of ``<cuda_home>/bin/nvcc`` (default: :func:`find_cuda_home`), or None."""
    home = cuda_home or find_cuda_home()
    if home is None:
        return None
    try:
        out = subprocess.run([str(Path(home) / "bin" / "nvcc"), "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def nvcc_gpu_archs(cuda_home: Path | None = None) -> frozenset[tuple[int, int]] | None:
    """The compute capabilities ``<cuda_home>/bin/nvcc --list-gpu-arch`` names (``compute_90`` -> ``(9, 0)``,
    ``compute_121`` -> ``(12, 1)``), or None where nvcc is absent or says nothing readable."""
    home = cuda_home or find_cuda_home()
    return None if home is None else _listed_gpu_archs(str(Path(home) / "bin" / "nvcc"))


@functools.lru_cache(maxsize=8)
def _listed_gpu_archs(nvcc: str) -> frozenset[tuple[int, int]] | None:
    try:
        out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    got = frozenset((int(d[:-1]), int(d[-1])) for d in re.findall(r"\bcompute_(\d{2,3})\b", out))
    return got or None


def torch_cuda_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the CUDA torch was built with, or None for a CPU-only torch."""
    import torch

    v = torch.version.cuda
    if not v:
        return None
    major, minor = v.split(".")[:2]
    return int(major), int(minor)


def cuda_header_lookup(cuda_home: Path | None = None) -> tuple[list[str], list[str]]:
    """``(folders, missing)`` for the headers of :data:`TORCH_CUDA_HEADERS` that ``<cuda_home>/include`` lacks:
    ``folders`` the pip CUDA wheels' include folders (``<sys.path entry>/nvidia/*/include``) that hold them, the
    first holding each, in search order (``sys.path``, then folder name) and each once; ``missing`` those found in
    no such folder either, in :data:`TORCH_CUDA_HEADERS` order. Both are empty when the toolkit has every header
    (no wheel folder is added then)."""
    home = cuda_home or find_cuda_home()
    lacking = [h for h in TORCH_CUDA_HEADERS if home is None or not (Path(home) / "include" / h).is_file()]
    folders: list[str] = []
    for base in sys.path:
        if not lacking:
            break
        nv = Path(base or ".") / "nvidia"
        if not nv.is_dir():
            continue
        for inc in sorted(nv.glob("*/include")):
            has = [h for h in lacking if (inc / h).is_file()]
            if has:
                if str(inc) not in folders:
                    folders.append(str(inc))
                lacking = [h for h in lacking if h not in has]
    return folders, lacking


def cuda_extra_include_dirs(cuda_home: Path | None = None) -> list[str]:
    """Include folders of the pip CUDA wheels holding the headers of :data:`TORCH_CUDA_HEADERS` (which torch's
    ``ATen/cuda/CUDAContext.h`` includes) that the toolkit lacks: the folder of each such header (e.g.
    ``nvidia/cublas/include``, ``nvidia/cusparse/include`` and ``nvidia/cusolver/include`` for CUDA 12 wheels),
    each once, in a stable order (see :func:`cuda_header_lookup`, which also names the ones found nowhere).

    Returns ``[]`` when ``<cuda_home>/include`` has all of them.
    """
    return cuda_header_lookup(cuda_home)[0]


def cuda_extra_include_flags(folders: list[str]) -> tuple[list[str], list[str]]:
    """``(cflags, cuda_cflags)`` that search ``folders`` (from :func:`cuda_extra_include_dirs`) AFTER every other
    include folder: ``-idirafter <folder>`` for the host compiler, the same through ``-Xcompiler`` for nvcc (which
    has no such option of its own; its host-compiler preprocessing takes it). So the toolkit's own headers win and a
    wheel folder supplies only what the toolkit lacks: ``nvidia/cu13/include`` holds a whole CUDA runtime's headers
    too, and as a ``-I`` folder it came before the toolkit's, mixing header versions where the wheel's CUDA and
    nvcc's differ (a review). nvcc splits ``-Xcompiler`` values at commas, so a folder whose path has a comma is
    passed as ``-I`` (``cuda_cflags`` then holds ``-I<folder>``, searched first, as before)."""
    cflags: list[str] = []
    cuda_cflags: list[str] = []
    for d in folders:
        cflags += ["-idirafter", d]
        cuda_cflags += [f"-I{d}"] if "," in d else ["-Xcompiler", "-idirafter", "-Xcompiler", d]
    return cflags, cuda_cflags


def _header_fix(missing: list[str], cuda_major: int | None) -> str:
    """What to install for ``missing`` headers: the nvidia-* wheels holding them, for torch's CUDA major."""
    suffix = f"-cu{cuda_major}" if cuda_major is not None and cuda_major < 13 else ""
    wheels = list(dict.fromkeys(f"nvidia-{TORCH_CUDA_HEADERS[h]}{suffix}" for h in missing))
    return (f"pip install {' '.join(wheels)} (the versions matching torch's CUDA"
            + (f" {cuda_major}" if cuda_major is not None else "") + "), or install the full CUDA toolkit "
            "(with cuBLAS, cuSPARSE and cuSOLVER) and point CUDA_HOME at it")


# --------------------------------------------------------------------------------------------------- host


def _compiler_version(name: str) -> tuple[str, str]:
    """``(resolved path, first line of --version)`` of the compiler ``name`` (a path or a name on PATH); ``(name, "")``
    when it is not found or not runnable, and ``(path, "")`` when ``--version`` fails (``/bin/false`` prints one)."""
    path = shutil.which(name)
    if path is None:
        return name, ""
    try:
        r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
        out = r.stdout if r.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        out = ""
    return str(Path(path).resolve()), (out.splitlines() or [""])[0].strip()


@functools.lru_cache(maxsize=None)
def host_compiler() -> tuple[str, str]:
    """``(path, first line of --version)`` of the C++ compiler torch.utils.cpp_extension uses ($CXX or c++)."""
    return _compiler_version(os.environ.get("CXX", "c++"))


def nvcc_host_compiler() -> tuple[str, str] | None:
    """``(path, first line of --version)`` of ``$CC``, which torch.utils.cpp_extension passes to nvcc as its host
    compiler (``-ccbin``, which wins over ``$NVCC_CCBIN``); None when CC is unset or empty. Not cached: CC is read
    at each call, as torch reads it at each build."""
    cc = os.environ.get("CC")
    return _compiler_version(cc) if cc else None


def _compiler_check(cuda_major: int | None, need_cuda: bool = True) -> Check:
    path, version = host_compiler()
    if not version:
        return Check("host compiler", False, f"{path}: not found or not runnable",
                     "install g++ (e.g. apt-get install g++) or set CXX to a C++17 compiler")
    detail = f"{path} ({version})"
    # nvcc's own host compiler where the environment names one (a review: CC, which torch passes to nvcc as -ccbin,
    # changed CUDA builds without being shown here or taken into their key)
    nvcc_cc = nvcc_host_compiler() if need_cuda else None
    if nvcc_cc is not None:
        if not nvcc_cc[1]:
            return Check("host compiler", False, f"{detail}; CC={os.environ['CC']!r}, which torch passes to nvcc as "
                         "its host compiler (-ccbin): not found or not runnable",
                         "unset CC, or set it to a C/C++ compiler nvcc accepts")
        detail += f"; nvcc's host compiler: CC={os.environ['CC']} -> {nvcc_cc[0]} ({nvcc_cc[1]})"
    elif need_cuda and os.environ.get("NVCC_CCBIN"):
        detail += f"; nvcc's host compiler: NVCC_CCBIN={os.environ['NVCC_CCBIN']}"
    m = re.search(r"(\d+)\.(\d+)(?:\.\d+)?", version)
    major = int(m.group(1)) if m else 0
    is_clang = "clang" in version.lower()
    if not is_clang and major < _GCC_MIN:
        return Check("host compiler", False, detail, f"gcc >= {_GCC_MIN} is needed by torch's headers; set CXX")
    # the version nvcc checks is its host compiler's: CC's where set
    host = nvcc_cc[1] if nvcc_cc is not None else version
    m = re.search(r"(\d+)\.(\d+)(?:\.\d+)?", host)
    major = int(m.group(1)) if m else 0
    is_clang = "clang" in host.lower()
    limits = _CLANG_MAX if is_clang else _GCC_MAX
    if cuda_major in limits and major > limits[cuda_major]:
        fix = "set CC" if nvcc_cc is not None else "set NVCC_CCBIN/CXX"
        return Check("host compiler", True, detail + f"; newer than nvcc {cuda_major} supports "
                     f"(max {limits[cuda_major]})", f"{fix} to an older compiler if nvcc rejects it", warn=True)
    return Check("host compiler", True, detail)


def ninja_path() -> str | None:
    p = shutil.which("ninja")
    if p:
        return p
    try:  # the pip wheel puts its binary next to the module
        import ninja  # type: ignore

        cand = Path(ninja.BIN_DIR) / "ninja"
        return str(cand) if cand.is_file() else None
    except Exception:
        return None


# --------------------------------------------------------------------------------------------------- archs


def visible_capabilities() -> list[tuple[int, int]]:
    """Compute capabilities of the visible GPUs (empty without a GPU or without a CUDA torch)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    except Exception:
        return []


_ARCH_RE = re.compile(r"^(?:sm_)?(\d+)\.?(\d)([af]?)(\+PTX)?$", re.I)
# The architecture names torch.utils.cpp_extension takes in TORCH_CUDA_ARCH_LIST (torch 2.11-2.14), as it expands them
# (they were refused here: a list set for torch's own extension builds failed ours; a review). Case is ignored.
NAMED_ARCHS = {
    "kepler+tesla": "3.7", "kepler": "3.5+PTX", "maxwell+tegra": "5.3", "maxwell": "5.0;5.2+PTX",
    "pascal": "6.0;6.1+PTX", "volta+tegra": "7.2", "volta": "7.0+PTX", "turing": "7.5+PTX", "ampere+tegra": "8.7",
    "ampere": "8.0;8.6+PTX", "ada": "8.9+PTX", "hopper": "9.0+PTX", "blackwell+tegra": "11.0",
    "blackwell": "10.0;10.3;12.0;12.1+PTX", "rubin": "10.7+PTX",
}


def parse_arch_list(text: str) -> list[Arch]:
    """Parse a ``TORCH_CUDA_ARCH_LIST`` value (``"8.0;9.0+PTX"``, spaces or semicolons; ``sm_90`` for ``9.0``; the
    names torch takes, :data:`NAMED_ARCHS`, such as ``Hopper`` for ``9.0+PTX``). ``native`` is not a list: see
    :func:`arch_list`.

    Raises:
        ValueError: an entry is none of those; ``compute_90`` (PTX alone, which torch does not build either) names
            the list to write instead.
    """
    out: list[Arch] = []
    for tok in re.split(r"[;\s,]+", text.strip()):
        if not tok:
            continue
        if tok.lower() in NAMED_ARCHS:
            out += parse_arch_list(NAMED_ARCHS[tok.lower()])
            continue
        m = _ARCH_RE.match(tok)
        if not m:
            virt = re.fullmatch(r"compute_(\d+)(\d)([af]?)", tok, re.I)
            if virt:  # (it was read as sm_90, SASS without the PTX it names: a review)
                cc = f"{int(virt[1])}.{virt[2]}{virt[3].lower()}"
                raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {tok!r} names PTX alone, which is not built by itself; "
                                 f"write {cc}+PTX (sm_{tok[8:]} code and its PTX) or {cc}")
            names = ", ".join(sorted({k.split("+")[0].title() for k in NAMED_ARCHS}))
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {tok!r}: expected <major>.<minor>[+PTX], e.g. 9.0+PTX, "
                             f"or a name torch takes ({names})")
        major, minor = int(m.group(1)), int(m.group(2))
        out.append(Arch(major, minor, bool(m.group(4)), m.group(3).lower()))
    if not out:
        raise ValueError("TORCH_CUDA_ARCH_LIST is empty")
    return out


def _distinct(archs: list[Arch]) -> list[Arch]:
    """``archs`` sorted, each capability (and suffix) once, with PTX where any of its entries asked for it: "9.0;9.0"
    and "9.0;8.0" build what "9.0" and "8.0;9.0" build, under the same build key."""
    ptx: dict[tuple[int, int, str], bool] = {}
    for a in archs:
        key = (a.major, a.minor, a.suffix)
        ptx[key] = ptx.get(key, False) or a.ptx
    return [Arch(m, n, p, s) for (m, n, s), p in sorted(ptx.items())]


def gencode_flags(archs: list[Arch]) -> list[str]:
    """nvcc's ``-gencode`` flags for ``archs``, as ``torch.utils.cpp_extension`` writes them from
    ``TORCH_CUDA_ARCH_LIST`` (each architecture's SASS, and its PTX where ``+PTX``), for every architecture nvcc
    lists: torch's own table lacks some (torch 2.14: 8.8, and the family-specific ``f`` ones such as 10.0f), which it
    refused with "Unknown CUDA arch" in the build after the preflight, checked against ``nvcc --list-gpu-arch``, had
    passed them. The builder passes these flags; cpp_extension then adds none of its own (it leaves its arch flags
    out where a flag given names an arch)."""
    out = []
    for a in archs:
        cc = f"{a.major}{a.minor}{a.suffix}"
        if a.ptx:
            out.append(f"-gencode=arch=compute_{cc},code=compute_{cc}")
        out.append(f"-gencode=arch=compute_{cc},code=sm_{cc}")
    return out


def format_arch_list(archs: list[Arch]) -> str:
    return ";".join(str(a) for a in archs)


def default_arch_list(cuda: tuple[int, int]) -> list[Arch]:
    """Architectures to build for when no GPU is visible and ``TORCH_CUDA_ARCH_LIST`` is unset.

    CUDA 13: sm_75 .. sm_120 (PTX for sm_120); CUDA 12: sm_50 .. sm_90 (sm_100/sm_120 from 12.8);
    CUDA 11: sm_35 .. sm_86 (sm_90 from 11.8).
    """
    major, minor = cuda
    if major >= 13:
        caps = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
    elif major == 12:
        caps = [(5, 0), (6, 0), (7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0)]
        if minor >= 8:
            caps += [(10, 0), (12, 0)]
    else:
        caps = [(3, 5), (5, 0), (6, 0), (7, 0), (7, 5), (8, 0), (8, 6)]
        if minor >= 8:
            caps += [(8, 9), (9, 0)]
    return [Arch(a, b, ptx=(i == len(caps) - 1)) for i, (a, b) in enumerate(caps)]


def arch_covers(archs: list[Arch], cap: tuple[int, int]) -> bool:
    """Whether a build for ``archs`` runs on a GPU of capability ``cap``.

    SASS runs on the same major with an equal or higher minor (arch-specific ``a``/``f`` builds only on the exact
    capability); PTX of an equal or older capability is JIT-compiled by the driver.
    """
    for a in archs:
        if a.suffix:
            if (a.major, a.minor) == cap:
                return True
            continue
        if a.major == cap[0] and a.minor <= cap[1]:
            return True
        if a.ptx and (a.major, a.minor) <= cap:
            return True
    return False


def arch_list(cuda: tuple[int, int] | None = None) -> tuple[list[Arch], str]:
    """The architectures to build for and where they came from (``"gpu"``, ``"env"``, ``"default"``).

    Visible GPUs win (PTX added for the newest); an explicit ``TORCH_CUDA_ARCH_LIST`` is used when it covers every
    visible GPU, and is extended with the missing GPUs otherwise; ``native`` (as torch reads it) is the visible GPUs,
    and an error without one. Architectures older than nvcc supports are
    rejected rather than passed on (``compute_70`` fails with CUDA 13).

    Raises:
        ValueError: ``TORCH_CUDA_ARCH_LIST`` is malformed or names an architecture nvcc cannot build.
    """
    cuda = cuda or nvcc_version() or torch_cuda_version() or (13, 0)
    caps = visible_capabilities()
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env.lower() == "native":   # torch's word for the visible GPUs (it was refused as a malformed list; a review)
        if not caps:
            raise ValueError("TORCH_CUDA_ARCH_LIST='native' takes the architectures of the visible GPUs, and none is "
                             "visible; name them (e.g. 9.0) or unset it to build for the default table")
        env = ""
    env_archs = _distinct(parse_arch_list(env)) if env else None
    if env_archs is not None:
        low = _MIN_ARCH.get(cuda[0])
        bad = [a for a in env_archs if low and (a.major, a.minor) < low]
        if bad:
            raise ValueError(
                f"TORCH_CUDA_ARCH_LIST={env!r} names {', '.join(a.sm for a in bad)}, which nvcc "
                f"{cuda[0]}.{cuda[1]} cannot build (oldest: sm_{low[0]}{low[1]}); remove it from the list")
        # and none nvcc does not know (99.0, or 10.1, which CUDA 13 calls 11.0): torch's ValueError in the build
        # made a failed build, and a failed-build log, of a setting (a review)
        known = nvcc_gpu_archs()
        unknown = [a for a in env_archs if known and (a.major, a.minor) not in known]
        if unknown:
            raise ValueError(
                f"TORCH_CUDA_ARCH_LIST={env!r} names {', '.join(a.sm for a in unknown)}, which nvcc "
                f"{cuda[0]}.{cuda[1]} does not know (nvcc --list-gpu-arch: "
                f"{', '.join(f'{a}.{b}' for a, b in sorted(known))}); remove it from the list")
        # the suffixes exist from some architecture on: "a" (sm_90a) from 9.0, "f" (the family, sm_100f) from 10.0;
        # nvcc --list-gpu-arch lists neither, and 8.0a failed in nvcc (a review)
        odd = [a for a in env_archs if (a.suffix == "a" and a.major < 9) or (a.suffix == "f" and a.major < 10)]
        if odd:
            raise ValueError(
                f"TORCH_CUDA_ARCH_LIST={env!r} names {', '.join(a.sm for a in odd)}: architecture-specific 'a' "
                "variants exist from 9.0 (sm_90a), family 'f' ones from 10.0 (sm_100f); remove the suffix")
    if caps:
        gpu = [Arch(a, b, ptx=(i == len(caps) - 1)) for i, (a, b) in enumerate(caps)]
        if env_archs is None:
            return gpu, "gpu"
        missing = [Arch(a, b) for (a, b) in caps if not arch_covers(env_archs, (a, b))]
        if not missing:
            return env_archs, "env"
        return sorted(set(env_archs) | set(missing)), "env+gpu"
    if env_archs is not None:
        return env_archs, "env"
    return default_arch_list(cuda), "default"


# --------------------------------------------------------------------------------------------------- preflight


def preflight(cache_dir: Path | None = None, *, need_cuda: bool = True, create_cache: bool = True) -> list[Check]:
    """All toolchain checks (CUDA toolkit, nvcc vs torch CUDA major, ninja, host compiler, cache dir). With
    ``create_cache=False`` (``doctor``) a missing cache folder is checked through the folder it would be made in, and
    not created."""
    checks: list[Check] = []
    tv = torch_cuda_version()
    if need_cuda:
        home = find_cuda_home()
        # a CUDA_HOME / CUDA_PATH that find_cuda_home passed over (its UserWarning shows once per process): said in
        # the row too, so that doctor's table does not read "ok" beside a variable that is not used
        passed = _cuda_env_toolkit()[1]
        are = "is" if len(passed) == 1 else "are"
        if home is None:
            checks.append(Check(
                "CUDA toolkit", False, "no toolkit found (looked at $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, nvcc "
                "on PATH; a toolkit has bin/nvcc and include/cuda_runtime.h"
                + (f"; {' and '.join(passed)} {are} not one" if passed else "") + ")",
                f"install the CUDA {tv[0] if tv else ''} toolkit (nvcc) and set CUDA_HOME to it"))
        else:
            if passed:
                checks.append(Check("CUDA toolkit", True, f"{home} ({' and '.join(passed)} {are} not a CUDA toolkit: "
                                    "no bin/nvcc with include/cuda_runtime.h there; passed over)",
                                    f"unset {' and '.join(p.split('=')[0] for p in passed)} or point it at the "
                                    "toolkit", warn=True))
            else:
                checks.append(Check("CUDA toolkit", True, str(home)))
            nv = nvcc_version(home)
            if nv is None:
                checks.append(Check("nvcc", False, f"{home}/bin/nvcc --version gave no release number",
                                    "reinstall the CUDA toolkit"))
            elif tv is None:
                checks.append(Check("nvcc", False, f"nvcc {nv[0]}.{nv[1]}, but torch is a CPU-only build",
                                    "install a CUDA build of torch (pip install torch --index-url "
                                    "https://download.pytorch.org/whl/cu<version>)"))
            elif nv[0] != tv[0]:
                checks.append(Check(
                    "nvcc", False, f"nvcc {nv[0]}.{nv[1]} but torch was built with CUDA {tv[0]}.{tv[1]}: "
                    "CUDA major versions must match",
                    f"install CUDA {tv[0]}.x and point CUDA_HOME at it, or a torch built for CUDA {nv[0]}"))
            else:
                checks.append(Check("nvcc", True, f"{nv[0]}.{nv[1]} (torch CUDA {tv[0]}.{tv[1]})"))
            # every header torch's CUDAContext.h includes, in the toolkit or in a wheel folder added (the row read
            # ok with cusolverDn.h nowhere: a review)
            extra, missing = cuda_header_lookup(home)
            if missing:
                checks.append(Check(
                    "CUDA headers", False,
                    f"{', '.join(missing)} (included by torch's ATen/cuda/CUDAContext.h) not found: neither in "
                    f"{home}/include nor in a pip CUDA wheel's nvidia/*/include"
                    + (f" (added: {', '.join(extra)})" if extra else ""),
                    _header_fix(missing, tv[0] if tv else nv[0] if nv else None)))
            elif extra:
                lacking = [h for h in TORCH_CUDA_HEADERS if not (home / "include" / h).is_file()]
                checks.append(Check("CUDA headers", True, f"{', '.join(lacking)} from {', '.join(extra)}"))
        try:
            archs, origin = arch_list()
            checks.append(Check("arch list", True, f"{format_arch_list(archs)} (from {origin})"))
        except ValueError as e:
            checks.append(Check("arch list", False, str(e), "fix or unset TORCH_CUDA_ARCH_LIST"))
    nj = ninja_path()
    checks.append(Check("ninja", nj is not None, nj or "not found", "" if nj else "pip install ninja"))
    jobs = max_jobs_check()
    if jobs is not None:
        checks.append(jobs)
    checks.append(_compiler_check(tv[0] if tv else None, need_cuda))
    if cache_dir is not None:
        checks.append(_writable_check(Path(cache_dir), create=create_cache))
    return checks


def max_jobs_check() -> Check | None:
    """MAX_JOBS as torch.utils.cpp_extension reads it: ``-j int(MAX_JOBS)`` for ninja when ``str.isdigit()`` holds
    (Unicode digits too), else ignored. A failed row where that int() fails (every build would), a warning row for a
    value torch ignores or for 0 (ninja's -j 0 sets no limit); None when unset."""
    v = os.environ.get("MAX_JOBS")
    if v is None:
        return None
    fix = "set MAX_JOBS to a positive integer (compile jobs per build), or unset it"
    if not v.isdigit():
        return Check("MAX_JOBS", True, f"{v!r} is not a whole number: torch ignores it, and ninja runs its default "
                     "number of jobs (the CPU count + 2)", fix, warn=True)
    try:
        jobs = int(v)
    except ValueError:  # digits int() does not take, such as '²': torch's int() raises in every build
        return Check("MAX_JOBS", False, f"{v!r}: torch reads it as a number of jobs, and int() fails on it", fix)
    if jobs == 0:
        return Check("MAX_JOBS", True, "0: ninja -j 0 runs any number of compile jobs at once (no limit)", fix,
                     warn=True)
    return Check("MAX_JOBS", True, f"{jobs} compile jobs per build")


def _writable_check(path: Path, create: bool = True) -> Check:
    """Whether a file can be written in ``path`` (made first when ``create``), by writing and removing one. Without
    ``create``, a missing ``path`` is checked in its nearest existing parent folder, where a build would make it."""
    fix = "give a writable folder (--cache-dir, or PIPEGOOSE_CACHE_DIR for the default)"
    where, note = path, ""
    try:
        if path.is_symlink() and not path.exists():  # a build's mkdir fails on it ("File exists")
            return Check("cache dir", False, f"{path}: a symbolic link to {os.readlink(path)}, which does not exist", fix)
        if path.exists() and not path.is_dir():  # (doctor said "Not a directory", build "File exists": a walkthrough)
            return Check("cache dir", False, f"{path}: a file, not a folder", fix)
        if create:
            path.mkdir(parents=True, exist_ok=True)
        elif not path.exists():
            where = next(p for p in path.parents if p.exists())  # the root exists
            if not where.is_dir():
                return Check("cache dir", False, f"{path}: cannot be made: {where} is not a folder", fix)
            note = f" (not made yet; a build makes it in {where})"
        with tempfile.NamedTemporaryFile(dir=where, prefix=".write-test-"):
            pass
        return Check("cache dir", True, f"{path}{note}")
    except OSError as e:
        return Check("cache dir", False, f"{path}: not writable ({e.strerror or e})", fix)
