"""Weights in 2 MB pages: glibc's malloc asks the kernel for transparent huge pages only when told.

A decode step streams every weight it uses from memory once per token, 189 MB for the `small`
preset in fp32. In 4 KB pages that is 46,000 pages a token, each a TLB miss and a page walk. Most
Linux distributions set transparent huge pages to `madvise`: memory gets 2 MB pages only where the
program asks (madvise MADV_HUGEPAGE). ONNX Runtime's buffers, its pre-packed weights among them,
come from glibc's malloc, which asks only under the tunable `glibc.malloc.hugetlb=1` (glibc 2.35
and later), read once when a process starts. So the `moedeploy` command starts itself again with it
set (same process id, before the CLI's imports), and `moedeploy bench` starts every backend's
worker, peers included, with it.

Measured (benchmarks/README.md, session 26): `small` fp32 decode 4-7.5% faster in paired runs,
int4 4%; llama.cpp, which maps its weights from its file, is unchanged. Nothing computed changes.
`MOEDEPLOY_HUGE_PAGES=0` (or off) leaves the environment as it is; where the kernel's mode is
`always` or `never`, or the C library is not glibc 2.35+, there is nothing to ask.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
#: 0 (or off, false, no) keeps moedeploy from asking for huge pages
OPT_OUT = "MOEDEPLOY_HUGE_PAGES"
OFF_WORDS = ("0", "off", "false", "no")
#: set in the environment of the restarted command: it never restarts twice, whatever glibc did
#: with the tunable (glibc drops GLIBC_TUNABLES for setuid programs and ones with file capabilities)
RESTARTED = "MOEDEPLOY_HUGE_PAGES_RESTARTED"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_MODE_FILE) -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`), None if unknown."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def glibc_has_tunable(libc: tuple[str, str] | None = None) -> bool:
    """glibc 2.35 added glibc.malloc.hugetlb; other C libraries (musl) have no such tunable."""
    name, version = libc if libc is not None else platform.libc_ver()
    if name != "glibc":
        return False
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 35)


def tunable_value(environ: Mapping[str, str]) -> str | None:
    """The value GLIBC_TUNABLES gives glibc.malloc.hugetlb (the last one wins), None if unset."""
    value = None
    for item in environ.get("GLIBC_TUNABLES", "").split(":"):
        name, _, given = item.partition("=")
        if name == TUNABLE:
            value = given
    return value


def opted_out(environ: Mapping[str, str]) -> bool:
    return environ.get(OPT_OUT, "1").strip().lower() in OFF_WORDS


def should_ask(environ: Mapping[str, str], mode: str | None, libc: tuple[str, str] | None = None) -> bool:
    """Whether starting a process with the tunable would give it huge pages it has not got
    (a value the user gave the tunable stays theirs)."""
    return (
        sys.platform.startswith("linux")
        and not opted_out(environ)
        and mode == "madvise"
        and tunable_value(environ) is None
        and glibc_has_tunable(libc)
    )


def with_huge_pages(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of `environ` whose processes' malloc asks for huge pages (other tunables kept).

    Children of those processes inherit it too (a compiler, Triton's server): harmless, since
    it only makes malloc advise the kernel."""
    env = dict(environ)
    if should_ask(env, thp_mode()):
        tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
        env["GLIBC_TUNABLES"] = ":".join([*tunables, f"{TUNABLE}=1"])
    return env


def state(environ: Mapping[str, str] | None = None) -> str:
    """What a process started with `with_huge_pages(environ)` gets, in words (bench reports it
    for its workers)."""
    environ = os.environ if environ is None else environ
    mode = thp_mode()
    if mode in ("always", "never"):
        return f"kernel: {mode}"
    value = tunable_value(with_huge_pages(environ))
    if value is not None and value != "0":
        return f"on ({TUNABLE}={value}, kernel: madvise)"
    if value == "0":
        return f"off ({TUNABLE}=0)"
    if opted_out(environ):
        return f"off ({OPT_OUT}={environ[OPT_OUT]})"
    return "off (no glibc 2.35+ or no transparent huge pages)"


def this_process() -> str:
    """Whether this process's malloc gets huge pages, in words: "kernel: always" or "kernel:
    never", else "malloc: on" where glibc's tunable asks for them (as the `moedeploy` command and
    bench's workers run), "malloc: off" otherwise (a Python process of one's own)."""
    mode = thp_mode()
    if mode in ("always", "never"):
        return f"kernel: {mode}"
    value = tunable_value(os.environ)
    return "malloc: on" if mode == "madvise" and glibc_has_tunable() and value not in (None, "0") else "malloc: off"


def started_as_the_command(argv: list[str] | None = None, orig_argv: list[str] | None = None) -> bool:
    """True for the `moedeploy` script and `python -m moedeploy`, whose whole command line is the
    command's: restarting them runs nothing twice. False for a script or `python -c` that calls
    the entry point after code of its own, or a tool (a debugger, coverage) that runs it."""
    argv = sys.argv if argv is None else argv
    orig_argv = getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv
    if not argv or not orig_argv:
        return False
    first = Path(argv[0])
    script = first.name == "moedeploy" and len(orig_argv) == len(argv) + 1 and orig_argv[1] == argv[0]
    module = first.name == "__main__.py" and first.parent.name == "moedeploy" and orig_argv[1:3] == ["-m", "moedeploy"]
    tail = orig_argv[len(orig_argv) - (len(argv) - 1):] if len(argv) > 1 else []
    return (script or module) and tail == argv[1:]


def restart_with_huge_pages() -> None:
    """Replace this process with itself, the tunable set, where that gives it huge pages.

    Called first by the command's entry point, before the CLI's imports: exec keeps the process
    id and the arguments (`sys.orig_argv`). Returns without doing anything where nothing would
    change, where this process is itself such a restart, where it was not started as the command
    (`started_as_the_command`), or where exec fails."""
    if os.environ.get(RESTARTED) or not sys.executable or not started_as_the_command():
        return
    env = with_huge_pages(os.environ)
    if env.get("GLIBC_TUNABLES") == os.environ.get("GLIBC_TUNABLES"):
        return
    env[RESTARTED] = "1"
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os.execve(sys.executable, sys.orig_argv, env)
    except (OSError, ValueError):
        return
