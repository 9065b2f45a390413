"""What the native kernel's builds leave in the cache: a new build removes this machine's builds
that no process has loaded for a month and the leftovers of killed compiles, and nothing else.

Needs neither ONNX Runtime's headers nor a compiler: `build` is given a stand-in compiler that
writes its output file, as a real one would."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from moedeploy.plugins import native

DAY = 24 * 3600


@pytest.fixture
def fake_cxx(tmp_path: Path) -> str:
    """A "compiler" that writes the file named after -o, and nothing else."""
    script = tmp_path / "fake-cxx"
    script.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\necho built > "$2"\n')
    script.chmod(0o755)
    return str(script)


def folder_of(root: Path, name: str, files: dict[str, str], age_s: float = 0, marker_age_s: float | None = None) -> Path:
    """A folder under `root` holding `files`, its `machine` file (if any) last touched `marker_age_s` ago."""
    folder = root / name
    folder.mkdir(parents=True)
    for file, text in files.items():
        (folder / file).write_text(text)
    then = time.time() - (marker_age_s if marker_age_s is not None else age_s)
    if (folder / native.MACHINE_FILE).exists():
        os.utime(folder / native.MACHINE_FILE, (then, then))
    past = time.time() - age_s
    os.utime(folder, (past, past))
    return folder


def test_a_new_build_removes_only_this_machines_builds_unused_for_a_month(tmp_path, fake_cxx) -> None:
    root = tmp_path / "native"
    mine = native.machine_hash() + "\n"
    lib, mark = native.LIBRARY, native.MACHINE_FILE
    stale = folder_of(root, "0" * 16 + "-api21", {lib: "x", mark: mine}, marker_age_s=31 * DAY)
    stale_other_api = folder_of(root, "1" * 16 + "-api17", {lib: "x", mark: mine}, marker_age_s=40 * DAY)
    recent = folder_of(root, "2" * 16 + "-api21", {lib: "x", mark: mine}, marker_age_s=29 * DAY)
    other_cpu = folder_of(root, "3" * 16 + "-api21", {lib: "x", mark: "f" * 16 + "\n"}, marker_age_s=90 * DAY)
    unmarked = folder_of(root, "4" * 16 + "-api21", {lib: "x"}, age_s=90 * DAY)  # built before these files
    with_notes = folder_of(root, "5" * 16 + "-api21", {lib: "x", mark: mine, "notes.txt": "mine"}, marker_age_s=90 * DAY)
    not_a_build = folder_of(root, "my-builds", {lib: "x", mark: mine}, marker_age_s=90 * DAY)
    killed = folder_of(root, "." + "6" * 16 + "-api21.k3j_x9ab", {lib: "partial"}, age_s=2 * 3600)
    compiling = folder_of(root, "." + "7" * 16 + "-api21.a81_zqcd", {}, age_s=5 * 60)
    backup = folder_of(root, "." + "6" * 16 + "-api21.mybackup-of-it", {lib: "x"}, age_s=90 * DAY)  # not mkdtemp's
    undecodable = folder_of(root, "b" * 16 + "-api21", {lib: "x"}, age_s=90 * DAY)
    (undecodable / mark).write_bytes(b"\xff\xfe" + mine.encode())
    os.utime(undecodable / mark, (0, 0))
    folder_named_as_library = folder_of(root, "c" * 16 + "-api21", {mark: mine}, marker_age_s=90 * DAY)
    (folder_named_as_library / lib).mkdir()
    (folder_named_as_library / lib / "precious.txt").write_text("not ours")
    linked_marker = folder_of(root, "d" * 16 + "-api21", {lib: "x"}, age_s=90 * DAY)
    (linked_marker / mark).symlink_to(stale / mark)
    elsewhere = folder_of(tmp_path, "8" * 16 + "-api21", {lib: "x", mark: mine}, marker_age_s=90 * DAY)
    (root / ("9" * 16 + "-api21")).symlink_to(elsewhere)

    out = root / ("a" * 16 + "-api21")
    library = native.build(tmp_path, fake_cxx, out)

    assert library == out / lib and library.read_text() == "built\n"
    assert (out / mark).read_text() == mine  # the new build says whose it is
    gone = {stale, stale_other_api, killed}
    for folder in gone:
        assert not folder.exists(), folder
    kept = {recent, other_cpu, unmarked, with_notes, not_a_build, compiling, elsewhere, root / ("9" * 16 + "-api21"),
            backup, undecodable, folder_named_as_library, linked_marker}
    for folder in kept:
        assert folder.is_dir(), folder
    assert (with_notes / "notes.txt").read_text() == "mine" and (elsewhere / lib).read_text() == "x"
    assert (folder_named_as_library / lib / "precious.txt").read_text() == "not ours"
    assert {p.name for p in root.iterdir()} == {p.name for p in kept if p.parent == root} | {out.name}


def test_a_build_another_process_finished_first_prunes_nothing(tmp_path) -> None:
    root = tmp_path / "native"
    out = root / ("a" * 16 + "-api21")
    racing = tmp_path / "racing-cxx"  # compiles, and meanwhile another process puts its build in place
    racing.write_text(f'#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\necho ours > "$2"\n'
                      f'mkdir -p {out} && echo theirs > {out / native.LIBRARY}\n')
    racing.chmod(0o755)
    stale = folder_of(root, "0" * 16 + "-api21", {native.LIBRARY: "x", native.MACHINE_FILE: native.machine_hash()},
                      marker_age_s=90 * DAY)
    assert native.build(tmp_path, str(racing), out).read_text() == "theirs\n"  # the rename lost: theirs is used
    assert stale.is_dir() and [p.name for p in root.iterdir() if p.name.startswith(".")] == []


def test_prune_leaves_what_it_cannot_remove_and_an_unreadable_cache(tmp_path, monkeypatch) -> None:
    root = tmp_path / "native"
    stale = folder_of(root, "0" * 16 + "-api21", {native.LIBRARY: "x", native.MACHINE_FILE: native.machine_hash()},
                      marker_age_s=90 * DAY)
    removed = native.prune(root, keep="", now=time.time())
    assert removed == [stale] and not stale.exists()
    assert native.prune(tmp_path / "no-such-folder", keep="") == []
    again = folder_of(root, "1" * 16 + "-api21", {native.LIBRARY: "x", native.MACHINE_FILE: native.machine_hash()},
                      marker_age_s=90 * DAY)

    def refuse(*_args, **_kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(native.Path, "unlink", refuse)  # another user's folder in a shared cache
    assert native.prune(root, keep="") == [] and again.is_dir()


def test_the_machine_file_is_writable_by_whoever_reads_the_folder(tmp_path) -> None:
    """Loading touches the file (`mark_used`), which needs write permission: in a shared cache
    another user's touch is what keeps their build from the owner's next prune."""
    for folder_mode, file_mode in ((0o755, 0o666), (0o750, 0o660), (0o700, 0o600)):
        folder = tmp_path / f"{folder_mode:o}"
        folder.mkdir(mode=folder_mode)
        folder.chmod(folder_mode)
        native.write_marker(folder)
        assert (folder / native.MACHINE_FILE).stat().st_mode & 0o777 == file_mode
        assert (folder / native.MACHINE_FILE).read_text() == native.machine_hash() + "\n"
    with pytest.raises(FileExistsError):  # never over a file that is there
        native.write_marker(tmp_path / "755")


def test_loading_marks_the_folder_used_and_a_folder_from_before_gets_its_file(tmp_path) -> None:
    used = folder_of(tmp_path, "0" * 16 + "-api21", {native.LIBRARY: "x", native.MACHINE_FILE: native.machine_hash()},
                     marker_age_s=90 * DAY)
    native.mark_used(used)
    assert time.time() - (used / native.MACHINE_FILE).stat().st_mtime < 60
    older = folder_of(tmp_path, "1" * 16 + "-api21", {native.LIBRARY: "x"})
    native.mark_used(older)
    assert (older / native.MACHINE_FILE).read_text() == native.machine_hash() + "\n"
    victim = tmp_path / "someone-elses-file"
    victim.write_text("theirs")
    os.utime(victim, (0, 0))
    linked = folder_of(tmp_path, "3" * 16 + "-api21", {native.LIBRARY: "x"})
    (linked / native.MACHINE_FILE).symlink_to(victim)
    native.mark_used(linked)  # a link is never followed
    assert victim.stat().st_mtime == 0 and victim.read_text() == "theirs"
    read_only = folder_of(tmp_path, "2" * 16 + "-api21", {native.LIBRARY: "x"})
    read_only.chmod(0o555)
    try:
        native.mark_used(read_only)  # a cache this process may not write: left as it is, no error
        assert (read_only / native.MACHINE_FILE).exists() == (os.geteuid() == 0)
    finally:
        read_only.chmod(0o755)


def test_headers_are_found_in_the_environment_before_the_system(tmp_path, monkeypatch) -> None:
    """MOEDEPLOY_ORT_INCLUDE, then this Python's prefix, then $CONDA_PREFIX, then /usr and /usr/local."""
    def prefix_with_headers(name: str) -> Path:
        folder = tmp_path / name / "include" / "onnxruntime"
        folder.mkdir(parents=True)
        (folder / native.HEADER).write_text("#define ORT_API_VERSION 21\n")
        return folder

    venv, conda = prefix_with_headers("venv"), prefix_with_headers("conda")
    monkeypatch.delenv(native.INCLUDE_ENV, raising=False)
    monkeypatch.setattr(native.sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setenv("CONDA_PREFIX", str(tmp_path / "conda"))
    assert native.candidate_includes() == [venv, conda, *native.SYSTEM_INCLUDES]
    assert native.headers() == (venv, "")
    (venv / native.HEADER).unlink()
    assert native.headers() == (conda, "")
    monkeypatch.setenv("CONDA_PREFIX", str(tmp_path / "venv"))  # the same environment: looked at once
    assert native.candidate_includes() == [venv, *native.SYSTEM_INCLUDES]
    monkeypatch.setenv(native.INCLUDE_ENV, str(conda))
    assert native.headers() == (conda, "") and native.api_version(conda) == 21
    monkeypatch.delenv(native.INCLUDE_ENV)
    monkeypatch.setenv("CONDA_PREFIX", "relative/env")  # not a prefix: ignored
    assert native.candidate_includes() == [venv, *native.SYSTEM_INCLUDES]


def test_headers_this_runtime_cannot_serve_do_not_hide_ones_it_can(tmp_path, monkeypatch) -> None:
    newer, usable = tmp_path / "venv" / "include" / "onnxruntime", tmp_path / "conda" / "include" / "onnxruntime"
    for folder, version in ((newer, native.runtime_api_version() + 8), (usable, native.MIN_API_VERSION)):
        folder.mkdir(parents=True)
        (folder / native.HEADER).write_text(f"#define ORT_API_VERSION {version}\n")
    monkeypatch.delenv(native.INCLUDE_ENV, raising=False)
    monkeypatch.setattr(native, "candidate_includes", lambda: [newer, usable])
    assert native.headers() == (usable, "")
    monkeypatch.setattr(native, "candidate_includes", lambda: [newer])
    assert native.headers() == (newer, "")  # only those: found, and its version is refused where it is checked
