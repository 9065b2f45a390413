"""The project's own ONNX Runtime kernels (moe_experts.cc), compiled on this machine once.

Why native code: ONNX Runtime ships no fp32 kernel that runs a layer's routed experts in one
node (llama.cpp's MUL_MAT_ID), and standard ops pick an expert's weights only by copying them
or with an If per expert (plugins/moe_native.py says what that costs).

ONNX Runtime's pip wheel has no C headers, so the build needs them from elsewhere:
$MOEDEPLOY_ORT_INCLUDE (a folder holding onnxruntime_c_api.h), else the Python environment's
include/onnxruntime (a conda environment with conda-forge's onnxruntime-cpp; $CONDA_PREFIX's
too), else a system install (/usr/include/onnxruntime: Debian's and Ubuntu's
libonnxruntime-dev; /usr/local/include/onnxruntime). Headers of any C API
version from 17 (KernelContext_ParallelFor) up to the installed runtime's work: the library asks
ONNX Runtime for the API version it was compiled against, which newer runtimes keep serving.
Without headers or a C++ compiler nothing is built and sessions take the other MoE paths.

The library is compiled with -march=native, so it is kept per machine: under
<cache>/native/<key>-api<N>/, the key hashing the source, the flags and the CPU's identity
(`cpu_identity`: its whole flags line, so a cache folder shared between machines never hands
one another's build), N the
headers' C API version (a library is used only with a runtime that serves N). Once built it
needs neither headers nor compiler. A build goes to a temporary folder renamed into place, so
two processes building at once both end with a complete library. MOEDEPLOY_NATIVE=0 turns it
all off.

A new source (a moedeploy upgrade) means a new build folder; the old ones would pile up. So each
build folder holds a `machine` file naming the CPU it was built for (`machine_hash`), touched by
the first session of every process that loads it, and each new build removes this machine's
builds that no process has loaded for STALE_AFTER_S, with the staging folders of compiles that
were killed (`prune`). A build in use is never removed (two installs sharing the cache each keep
theirs), nor one for another CPU sharing the cache, nor anything without that file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moedeploy.utils.io import current_umask

SOURCE = Path(__file__).with_name("moe_experts.cc")
LIBRARY = "libmoedeploy_cpu.so"
INCLUDE_ENV = "MOEDEPLOY_ORT_INCLUDE"
#: set to 0 / off: never build or load the native kernels (sessions take the other MoE paths)
SWITCH_ENV = "MOEDEPLOY_NATIVE"
SYSTEM_INCLUDES = (Path("/usr/include/onnxruntime"), Path("/usr/local/include/onnxruntime"))
#: where an environment's prefix (sys.prefix, $CONDA_PREFIX) holds the headers
PREFIX_INCLUDE = Path("include") / "onnxruntime"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")
#: the C API version that added KernelContext_ParallelFor, which the kernel splits its work with
MIN_API_VERSION = 17
HEADER = "onnxruntime_c_api.h"
#: a compile takes about 7 s; a compiler that hangs must not hang the session that asked for it
COMPILE_TIMEOUT_S = 600
#: in each build folder: the CPU it was built for (`machine_hash`); its time is when a process last loaded it
MACHINE_FILE = "machine"
#: a build of this machine's that no process has loaded for this long is removed by the next build
STALE_AFTER_S = 30 * 24 * 3600
BUILD_FOLDER = re.compile(r"[0-9a-f]{16}-api\d+")
STAGING_FOLDER = re.compile(r"\.[0-9a-f]{16}-api\d+\.[a-z0-9_]{8}")  # tempfile.mkdtemp's suffix


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why and what to do."""


def headers() -> tuple[Path | None, str]:
    """(folder holding the ONNX Runtime C API headers, "") or (None, why not)."""
    if explicit := os.environ.get(INCLUDE_ENV):
        folder = Path(explicit)
        if not (folder / HEADER).is_file():
            return None, f"{INCLUDE_ENV}={explicit} holds no {HEADER}"
        return folder, ""
    found = [folder for folder in candidate_includes() if (folder / HEADER).is_file()]
    usable = [folder for folder in found if MIN_API_VERSION <= (api_version(folder) or 0) <= runtime_api_version()]
    if usable or found:  # the first that builds, else the first found (whose version is then refused)
        return (usable or found)[0], ""
    return None, (f"no ONNX Runtime C API headers ({HEADER}): install libonnxruntime-dev (conda: onnxruntime-cpp), "
                  f"or set {INCLUDE_ENV} to a folder holding them")


def candidate_includes() -> list[Path]:
    """Where headers are looked for without MOEDEPLOY_ORT_INCLUDE, in order: this Python
    environment's prefix, an active conda environment's, then the system's."""
    conda = os.environ.get("CONDA_PREFIX", "")
    prefixes = [Path(sys.prefix), *([Path(conda)] if os.path.isabs(conda) else [])]
    return list(dict.fromkeys([*(prefix / PREFIX_INCLUDE for prefix in prefixes), *SYSTEM_INCLUDES]))


def api_version(include: Path) -> int | None:
    """ORT_API_VERSION as the headers define it."""
    match = re.search(r"#define\s+ORT_API_VERSION\s+(\d+)", (include / HEADER).read_text(errors="replace"))
    return int(match.group(1)) if match else None


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def runtime_api_version() -> int:
    """The C API version the installed ONNX Runtime serves at most: its minor version (1.32 -> 32)."""
    import onnxruntime

    return int(onnxruntime.__version__.split(".")[1])


def cpu_identity(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """What -march=native compiles for, as the kernel reports it: the first processor's model and
    its whole flags (x86) or Features / implementer / part lines (Arm)."""
    wanted = ("vendor_id", "model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU part")
    found: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in wanted and key not in found:
                    found[key] = " ".join(value.split())
    except OSError:
        pass
    return [f"{k}={found.get(k, '')}" for k in wanted]


@functools.cache
def build_key() -> str:
    """What a built library is valid for: the source, the flags, and this CPU (-march=native).
    Kept for the process (sessions and tune records ask for it); `forget` drops it."""
    parts = [SOURCE.read_bytes().hex(), *FLAGS, *cpu_identity()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def machine_hash() -> str:
    """This CPU (`cpu_identity`) as 16 hex digits: what a build folder's `machine` file holds."""
    return hashlib.sha256("\n".join(cpu_identity()).encode()).hexdigest()[:16]


def built(root: Path, key: str) -> Path | None:
    """A library built earlier for `key` against headers this runtime serves (folder <key>-api<N>)."""
    usable = []
    for folder in root.glob(f"{key}-api*"):
        version = folder.name.rpartition("-api")[2]
        if version.isdigit() and int(version) <= runtime_api_version() and (folder / LIBRARY).is_file():
            usable.append((int(version), folder / LIBRARY))
    return max(usable)[1] if usable else None


def build(include: Path, cxx: str, out_dir: Path) -> Path:
    """Compile the library into `out_dir` (made whole or not at all); returns its path."""
    target = out_dir / LIBRARY
    if target.is_file():
        return target
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        # its own process group: on a timeout the kill reaches the compiler's children (cc1plus, as, ld)
        compile_ = subprocess.Popen([cxx, *FLAGS, f"-I{include}", str(SOURCE), "-o", str(staging / LIBRARY)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, stderr = compile_.communicate(timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(compile_.pid, signal.SIGKILL)
            compile_.communicate()
            raise NativeUnavailable(f"compiling {SOURCE.name} ({cxx}) took over {COMPILE_TIMEOUT_S} s; "
                                    f"stopped it (set {SWITCH_ENV}=0 to skip the build)") from None
        if compile_.returncode != 0:
            lines = stderr.strip().splitlines()
            first_error = next((line for line in lines if "error" in line), lines[-1] if lines else "no output")
            raise NativeUnavailable(f"compiling {SOURCE.name} failed ({cxx}): {first_error.strip()}")
        staging.chmod(0o777 & ~current_umask())  # mkdtemp's 0700 would hide the build from other users of the cache
        write_marker(staging)
        try:
            staging.rename(out_dir)
        except OSError as e:  # another process finished first: use its build
            if not target.is_file():  # something else of that name (a partial copy of a cache)
                raise NativeUnavailable(f"{out_dir} exists without {LIBRARY} in it ({e.strerror}); remove it to build "
                                        "the library again") from None
        else:
            with contextlib.suppress(Exception):  # tidying must never fail a finished build
                prune(out_dir.parent, keep=out_dir.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_marker(folder: Path) -> None:
    """Create `folder`'s `machine` file (never through a link, never over a file). Whoever may
    read the folder may write the file: a user of a shared cache touches it when loading the
    library (`mark_used`), which keeps the build of anyone still using it from `prune`."""
    readable = folder.stat().st_mode & 0o044
    fd = os.open(folder / MACHINE_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (machine_hash() + "\n").encode())
        os.fchmod(fd, 0o600 | readable | readable >> 1)
    finally:
        os.close(fd)


def mark_used(folder: Path) -> None:
    """Say in `folder`'s `machine` file that a process here loads its library now (made where a
    build from before these files has none: a library found under this CPU's key is this CPU's).
    A link is never followed; a cache this process may not write into is left as it is."""
    marker = folder / MACHINE_FILE
    try:
        if marker.is_symlink():
            return
        if marker.is_file():
            os.utime(marker, follow_symlinks=False)
        elif not marker.exists():
            write_marker(folder)
    except OSError:
        pass


def _is_mine(marker: Path, mine: bytes) -> bool:
    """Whether `marker` is a plain `machine` file naming this CPU (never read through a link)."""
    if marker.is_symlink() or not marker.is_file():
        return False
    with open(marker, "rb") as f:
        return f.read(64).strip() == mine


def prune(root: Path, keep: str, now: float | None = None) -> list[Path]:
    """Remove from `root` (<cache>/native) what earlier builds left that no session loads: this
    CPU's build folders (`machine` file) other than `keep` that no process has loaded for
    STALE_AFTER_S, and staging folders of compiles killed midway (older than two compile time
    limits, so never one still compiling). Only folders holding nothing but what `build` writes;
    anything else, another CPU's builds and what cannot be removed are left. Returns what went."""
    now = time.time() if now is None else now
    mine = machine_hash().encode()
    removed: list[Path] = []
    try:
        folders = sorted(root.iterdir())
    except OSError:
        return removed
    for folder in folders:
        try:
            if folder.name == keep or folder.is_symlink() or not folder.is_dir():
                continue
            if STAGING_FOLDER.fullmatch(folder.name):
                last_used = folder.stat().st_mtime
                stale_after = 2 * COMPILE_TIMEOUT_S
            elif BUILD_FOLDER.fullmatch(folder.name):
                if not _is_mine(folder / MACHINE_FILE, mine):
                    continue
                last_used, stale_after = (folder / MACHINE_FILE).stat().st_mtime, STALE_AFTER_S
            else:
                continue
            if now - last_used > stale_after and _remove_build(folder):
                removed.append(folder)
        except OSError:  # another user's folder, one removed meanwhile: not ours to insist on
            continue
    return removed


def _remove_build(folder: Path) -> bool:
    """Remove `folder` where it holds only plain files named as `build` names them, file by file
    and then the empty folder (rmdir: anything put there meanwhile keeps it)."""
    entries = list(folder.iterdir())
    if any(entry.name not in (LIBRARY, MACHINE_FILE) or not entry.is_file() or entry.is_symlink() for entry in entries):
        return False
    for entry in entries:
        entry.unlink()
    folder.rmdir()
    return True


def library_path() -> Path:
    """The library built for this machine, compiled now if there is none yet (a few seconds,
    once). NativeUnavailable says why where it cannot be; the answer, either way, is kept for
    the process (`forget` drops it), so a failing build is tried once, not at every session."""
    path, why = _library()
    if path is None:
        raise NativeUnavailable(why)
    return path


def forget() -> None:
    """Look again at the next `library_path` (after changing the variables it reads)."""
    build_key.cache_clear()
    _library.cache_clear()


def load_problem(library: Path) -> str | None:
    """Why ONNX Runtime cannot load a built library (a cache on a noexec mount, a C++ runtime
    older than the compiler's, a damaged file), or None: asked once, in a throwaway
    SessionOptions, so that sessions fall back to the other MoE paths with this reason instead
    of every one failing to load."""
    import onnxruntime

    try:
        onnxruntime.SessionOptions().register_custom_ops_library(str(library))
    except Exception as e:  # onnxruntime raises its own exception types
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (f"ONNX Runtime cannot load {library} ({reason}); remove {library.parent} to build it again, "
                f"or set {SWITCH_ENV}=0")
    return None


def _readiness() -> tuple[Path | None, tuple[Path, int, str] | None, str]:
    """Where the library stands, compiling nothing: (the library built for this machine, None, "")
    or (None, (headers, their C API version, compiler) to build it with, "") or (None, None, why
    neither)."""
    from moedeploy.utils.cache import cache_dir

    if os.environ.get(SWITCH_ENV, "").strip().lower() in ("0", "off", "no", "false"):
        return None, None, f"{SWITCH_ENV}={os.environ[SWITCH_ENV]} turns the native kernels off"
    if (library := built(cache_dir() / "native", build_key())) is not None:
        return (library, None, "") if (why := load_problem(library)) is None else (None, None, why)
    include, why = headers()
    if include is None:
        return None, None, why
    version = api_version(include)
    if version is None or not MIN_API_VERSION <= version <= runtime_api_version():
        return None, None, (f"the ONNX Runtime headers in {include} are of C API version {version}; the kernel needs "
                            f"{MIN_API_VERSION} to {runtime_api_version()} (this onnxruntime's)")
    cxx = compiler()
    if cxx is None:
        return None, None, "no C++ compiler (c++, g++ or clang++; or set CXX)"
    return None, (include, version, cxx), ""


@functools.cache
def _library() -> tuple[Path | None, str]:
    from moedeploy.utils.cache import cache_dir

    try:
        library, recipe, why = _readiness()
        if library is None and recipe is not None:
            include, version, cxx = recipe
            library = build(include, cxx, cache_dir() / "native" / f"{build_key()}-api{version}")
            why = load_problem(library) or ""
            library = None if why else library
        if library is not None:
            mark_used(library.parent)
        return library, why
    except NativeUnavailable as e:
        return None, str(e)
    except (OSError, subprocess.SubprocessError) as e:  # an unwritable cache, a CXX that is not there
        return None, f"building the native kernels failed: {e}"


def status() -> str:
    """Whether the native kernel is here for sessions to take, in one line (`moedeploy version`),
    without compiling it: built for this CPU, buildable by the next session, or why not and what
    to do. (MOEDEPLOY_MOE_PATH or a `moedeploy tune` record may still send sessions elsewhere.)"""
    try:
        library, recipe, why = _readiness()
    except Exception as e:  # an unreadable cache folder, an onnxruntime that will not import: a diagnostic says so
        return f"not available ({type(e).__name__}: {e})"
    if library is not None:
        return f"built for this CPU ({library})"
    if recipe is not None:
        include, version, cxx = recipe
        return (f"not built yet: the first session compiles it, a few seconds once (headers {include}, "
                f"C API {version}; {cxx})")
    return f"not available ({why}); sessions take the other MoE paths"


def available() -> bool:
    """Whether the native kernels are built here, or can be now."""
    try:
        library_path()
    except NativeUnavailable:
        return False
    return True
