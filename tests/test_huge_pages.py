"""Huge pages for the weights: when moedeploy asks glibc for them, and that asking gives them.

The end-to-end tests (`needs_madvise`) check the effect itself, not the environment variable: a
process started with `with_huge_pages`, or restarted by the command's entry point, holds a freshly
written buffer in 2 MB pages by the kernel's own count (AnonHugePages in /proc/self/smaps_rollup),
and one started without it does not.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moedeploy.utils import huge_pages
from moedeploy.utils.huge_pages import (
    TUNABLE,
    glibc_has_tunable,
    should_ask,
    thp_mode,
    with_huge_pages,
)

MADVISE = "madvise"
GLIBC = ("glibc", "2.36")


@pytest.mark.parametrize(("text", "mode"), [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                            ("always madvise [never]", "never"), ("garbled", None)])
def test_thp_mode_is_the_bracketed_word(tmp_path: Path, text: str, mode: str | None) -> None:
    (tmp_path / "enabled").write_text(text)
    assert thp_mode(str(tmp_path / "enabled")) == mode
    assert thp_mode(str(tmp_path / "missing")) is None


@pytest.mark.parametrize(("libc", "has"), [(("glibc", "2.35"), True), (("glibc", "2.36"), True), (("glibc", "3.0"), True),
                                           (("glibc", "2.34"), False), (("glibc", "2.4"), False),
                                           (("", ""), False), (("musl", "1.2"), False), (("glibc", "x"), False)])
def test_the_tunable_needs_glibc_2_35(libc: tuple[str, str], has: bool) -> None:
    assert glibc_has_tunable(libc) is has


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables are Linux's")
def test_asked_only_where_it_changes_something() -> None:
    assert should_ask({}, MADVISE, GLIBC)
    assert should_ask({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, MADVISE, GLIBC)
    assert not should_ask({"MOEDEPLOY_HUGE_PAGES": "0"}, MADVISE, GLIBC)  # the user's opt-out
    assert not should_ask({"GLIBC_TUNABLES": f"{TUNABLE}=0"}, MADVISE, GLIBC)  # the user's own setting stays
    assert not should_ask({}, "always", GLIBC)  # the kernel gives them anyway
    assert not should_ask({}, "never", GLIBC)
    assert not should_ask({}, None, GLIBC)
    assert not should_ask({}, MADVISE, ("glibc", "2.31"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables are Linux's")
def test_other_tunables_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: MADVISE)
    monkeypatch.setattr(huge_pages, "glibc_has_tunable", lambda libc=None: True)
    env = with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"})
    assert env == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}=1", "PATH": "/bin"}
    assert with_huge_pages(env) == env  # asked once
    assert with_huge_pages({"MOEDEPLOY_HUGE_PAGES": "0"}) == {"MOEDEPLOY_HUGE_PAGES": "0"}
    assert huge_pages.state({}) == f"on ({TUNABLE}=1, kernel: madvise)"
    assert huge_pages.state({"GLIBC_TUNABLES": f"{TUNABLE}=2"}) == f"on ({TUNABLE}=2, kernel: madvise)"
    assert huge_pages.state({"GLIBC_TUNABLES": f"{TUNABLE}=0"}) == f"off ({TUNABLE}=0)"
    assert huge_pages.state({"MOEDEPLOY_HUGE_PAGES": "off"}) == "off (MOEDEPLOY_HUGE_PAGES=off)"
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    assert huge_pages.state({}) == "kernel: never"


def _pmd_size() -> int | None:
    try:
        return int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return None


needs_madvise = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and thp_mode() == MADVISE and glibc_has_tunable()
         and _pmd_size() == 2 << 20 and Path("/proc/self/smaps_rollup").is_file()),
    reason="needs Linux with 2 MB transparent huge pages in madvise mode, /proc/self/smaps_rollup and glibc 2.35+")

#: writes a 64 MB buffer and prints its tunables and the process's anonymous huge-page kB
ALLOCATE = """
import os, sys
sys.path[:0] = {path!r}
{before}
buffer = bytearray(64 << 20)
buffer[::4096] = b"x" * len(buffer[::4096])
huge = [line.split()[1] for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")]
print(os.environ.get("GLIBC_TUNABLES"), huge[0] if huge else "0")
"""
#: the kernel's count of huge-page faults that fell back to small pages (memory too fragmented)
FALLBACK = "thp_fault_fallback"


def _fallbacks() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == FALLBACK:
            return int(value)
    return 0


def _plain_env(**extra: str) -> dict[str, str]:
    drop = ("GLIBC_TUNABLES", huge_pages.OPT_OUT, huge_pages.RESTARTED)
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def _run(argv: list[str], env: dict[str, str]) -> tuple[str | None, int]:
    """(GLIBC_TUNABLES, AnonHugePages kB) as the child saw them after its 64 MB buffer."""
    before = _fallbacks()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=True)
    tunables, huge_kb = done.stdout.split()
    if int(huge_kb) < 32 << 10 and _fallbacks() > before:
        pytest.skip("the kernel fell back to small pages (memory too fragmented right now)")
    return None if tunables == "None" else tunables, int(huge_kb)


@needs_madvise
def test_a_worker_started_with_huge_pages_holds_its_buffer_in_them() -> None:
    code = ALLOCATE.format(path=sys.path, before="")
    tunables, huge_kb = _run([sys.executable, "-c", code], with_huge_pages(_plain_env()))
    assert tunables == f"{TUNABLE}=1"
    assert huge_kb >= 32 << 10  # most of the 64 MB buffer (its ends need not fill a 2 MB page)
    _, huge_kb = _run([sys.executable, "-c", code], _plain_env())
    assert huge_kb < 32 << 10


RESTART = "from moedeploy.utils.huge_pages import restart_with_huge_pages; restart_with_huge_pages()"


@needs_madvise
def test_the_command_restarts_itself_with_huge_pages(tmp_path: Path) -> None:
    """What the `moedeploy` entry point does first, run from a script named like the command:
    exec itself again with the tunable (the user's other tunables kept); MOEDEPLOY_HUGE_PAGES=0
    keeps it as it is, and so does a tunable value of the user's own."""
    command = tmp_path / "moedeploy"
    command.write_text(ALLOCATE.format(path=sys.path, before=RESTART))
    argv = [sys.executable, str(command), "all", "--out", "x"]
    tunables, huge_kb = _run(argv, _plain_env(GLIBC_TUNABLES="glibc.malloc.arena_max=4"))
    assert tunables == f"glibc.malloc.arena_max=4:{TUNABLE}=1" and huge_kb >= 32 << 10
    tunables, huge_kb = _run(argv, _plain_env(MOEDEPLOY_HUGE_PAGES="off"))
    assert tunables is None and huge_kb < 32 << 10
    tunables, _ = _run(argv, _plain_env(GLIBC_TUNABLES=f"{TUNABLE}=0"))
    assert tunables == f"{TUNABLE}=0"


@needs_madvise
def test_code_that_calls_the_entry_point_is_not_run_twice() -> None:
    """`python -c` (or a script of the user's) calling the entry point: a restart would run the
    code before it again, so there is none."""
    code = ALLOCATE.format(path=sys.path, before=f"print('before'); {RESTART}")
    done = subprocess.run([sys.executable, "-c", code], env=_plain_env(), capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.count("before") == 1 and done.stdout.split()[1] == "None"


def test_started_as_the_command_only_for_the_script_and_the_module() -> None:
    from moedeploy.utils.huge_pages import started_as_the_command as command

    assert command(["/v/bin/moedeploy", "all"], ["/v/bin/python", "/v/bin/moedeploy", "all"])
    assert command(["/v/bin/moedeploy"], ["/v/bin/python", "/v/bin/moedeploy"])
    assert command(["/s/moedeploy/__main__.py", "all"], ["python", "-m", "moedeploy", "all"])
    assert not command(["-c", "all"], ["python", "-c", "code", "all"])
    assert not command(["/home/me/run.py", "all"], ["python", "/home/me/run.py", "all"])
    assert not command(["/v/bin/moedeploy", "all"], ["python", "-m", "coverage", "run", "/v/bin/moedeploy", "all"])
    assert not command(["/v/bin/moedeploy", "all"], ["/v/bin/python", "-X", "dev", "/v/bin/moedeploy", "all"])
    assert not command([], [])


def test_a_restarted_command_never_restarts_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc drops GLIBC_TUNABLES for setuid programs and ones with file capabilities: the
    restarted process sees no tunable, and must not ask again (it would exec forever)."""
    execs = []
    monkeypatch.setattr(os, "execve", lambda *args: execs.append(args))
    monkeypatch.setattr(huge_pages, "started_as_the_command", lambda: True)
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: MADVISE)
    monkeypatch.setattr(huge_pages, "glibc_has_tunable", lambda libc=None: True)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(huge_pages.OPT_OUT, raising=False)
    monkeypatch.setenv(huge_pages.RESTARTED, "1")
    huge_pages.restart_with_huge_pages()
    assert execs == []
    monkeypatch.delenv(huge_pages.RESTARTED)
    monkeypatch.setattr(sys, "stdout", None)  # a daemon's closed stdout: no flush of None
    huge_pages.restart_with_huge_pages()
    assert len(execs) == 1 and execs[0][2][huge_pages.RESTARTED] == "1"
    assert execs[0][2]["GLIBC_TUNABLES"] == f"{TUNABLE}=1"
