"""Outputs: moedeploy replaces only what it wrote, leaves nothing behind when interrupted,
names the path when the disk is full, and writes files with the modes the umask asks for."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import pytest

from moedeploy.compare.suite import check_run_folder
from moedeploy.export import export
from moedeploy.serving.repository import write_repository
from moedeploy.utils.io import TEMP_MARKER, OutputRefused, atomic_directory, check_replaceable


def _user_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "important.txt").write_text("the user's work")
    return path


def _write_one(path: Path, **kwargs) -> None:
    with atomic_directory(path, **kwargs) as tmp:
        (tmp / "new.txt").write_text("new")


def _dead_pid() -> int:
    """A PID that no process has any more (a child that already exited and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture(scope="module")
def rmsnorm_artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("safety") / "rmsnorm"
    export("rmsnorm", out)
    return out


# --- what may be replaced -----------------------------------------------------------------------


def test_a_folder_moedeploy_did_not_write_is_refused_and_kept(tmp_path: Path) -> None:
    mine = _user_folder(tmp_path / "mine")
    with pytest.raises(OutputRefused, match=r"not written by moedeploy.*--force"):
        _write_one(mine, owned=lambda p: (p / "marker").exists())
    assert (mine / "important.txt").read_text() == "the user's work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temp folder either


def test_new_empty_and_owned_folders_are_replaced(tmp_path: Path) -> None:
    _write_one(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    _write_one(tmp_path / "empty")
    owned = _user_folder(tmp_path / "owned")
    (owned / "marker").write_text("")
    _write_one(owned, owned=lambda p: (p / "marker").exists())
    for name in ("new", "empty", "owned"):
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new", "owned"]


def test_force_replaces_a_user_folder(tmp_path: Path) -> None:
    _write_one(_user_folder(tmp_path / "mine"), force=True)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["new.txt"]


@pytest.mark.parametrize("target", [".", "..", "~"])
def test_the_current_home_and_enclosing_folders_are_never_replaced(tmp_path: Path, monkeypatch, target: str) -> None:
    cwd = _user_folder(tmp_path / "work" / "scratch")
    monkeypatch.chdir(cwd)
    with pytest.raises(OutputRefused, match="current folder"):
        check_replaceable(Path(target).expanduser(), owned=lambda p: True, force=True)
    assert (cwd / "important.txt").exists()


def test_a_mount_point_is_refused_before_any_work(tmp_path: Path) -> None:
    """Replacing renames the old output aside, which a mount point refuses (EBUSY): an export
    into one failed only after all its work. /proc is a mount point on every Linux."""
    with pytest.raises(OutputRefused, match=r"^/proc is a mount point, which moedeploy cannot replace"):
        check_replaceable(Path("/proc"), owned=lambda p: True, force=True)
    mount = tmp_path / "mounted"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mount)], capture_output=True).returncode:
        return  # not allowed to mount here: /proc above is the check
    try:
        (mount / "rmsnorm").mkdir()  # the user's, which stays
        with pytest.raises(OutputRefused, match="is a mount point"):
            export("decoder", mount, preset_name="small")  # refused before the minute a small export takes
        assert sorted(p.name for p in mount.iterdir()) == ["rmsnorm"]
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_symlinked_out_is_refused(tmp_path: Path) -> None:
    mine = _user_folder(tmp_path / "mine")
    (tmp_path / "link").symlink_to(mine)
    for force in (False, True):  # the message said 'not a folder moedeploy wrote', as if --force would do
        with pytest.raises(OutputRefused, match=r"is a link \(to .*mine\), which moedeploy never replaces, --force or not"):
            _write_one(tmp_path / "link", owned=lambda p: True, force=force)
    assert (mine / "important.txt").exists() and (tmp_path / "link").is_symlink()


def test_export_refuses_a_user_folder_before_any_work(tmp_path: Path) -> None:
    mine = _user_folder(tmp_path / "mine")
    with pytest.raises(OutputRefused, match="not written by moedeploy"):
        export("decoder", mine, preset_name="small")  # refused before the minute a small export takes
    assert sorted(p.name for p in mine.iterdir()) == ["important.txt"]


@pytest.mark.parametrize("out", ["checkpoint", "."])
def test_export_never_replaces_the_checkpoint_it_reads_even_with_force(tmp_path: Path, out: str) -> None:
    """--force replaces any folder, but not the checkpoint folder itself or one that holds it."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(OutputRefused, match="delete the checkpoint it reads"):
        export("decoder", tmp_path / out, checkpoint=checkpoint, force=True)
    assert sorted(p.name for p in checkpoint.iterdir()) == ["config.json", "model.safetensors"]


def test_export_replaces_its_own_artifact(rmsnorm_artifact: Path, tmp_path: Path) -> None:
    out = tmp_path / "art"
    shutil.copytree(rmsnorm_artifact, out)
    export("rmsnorm", out, seed=7)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["seed"] == 7
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert files == {*manifest["files"], "manifest.json"}


def test_export_keeps_what_the_user_put_in_an_old_artifact(rmsnorm_artifact: Path, tmp_path: Path) -> None:
    """An artifact folder is replaced whole; a file or folder the user added to it would go with
    it, so the export is refused, naming them, and both stay (--force replaces anyway)."""
    out = tmp_path / "art"
    shutil.copytree(rmsnorm_artifact, out)
    (out / "notes.txt").write_text("the user's notes")
    (out / "mine").mkdir()
    (out / "report").mkdir()  # compare's: moedeploy's own
    before = {p.relative_to(out).as_posix() for p in out.rglob("*")}
    with pytest.raises(OutputRefused, match=r"is an artifact, but it also holds mine, notes\.txt, which moedeploy "
                                            r"did not write and a new export would delete; move it out"):
        export("rmsnorm", out, seed=7)
    assert {p.relative_to(out).as_posix() for p in out.rglob("*")} == before
    (out / "mine").rmdir()
    (out / "notes.txt").unlink()
    export("rmsnorm", out, seed=7)  # only moedeploy's entries left: replaced
    assert json.loads((out / "manifest.json").read_text())["seed"] == 7


def test_a_file_of_the_users_inside_an_artifacts_own_folders_is_kept_too(rmsnorm_artifact: Path, tmp_path: Path) -> None:
    out = tmp_path / "art"
    shutil.copytree(rmsnorm_artifact, out)
    (out / "golden" / "mynote.txt").write_text("the user's note")
    with pytest.raises(OutputRefused, match=r"it also holds golden/mynote\.txt, which moedeploy did not write"):
        export("rmsnorm", out, seed=7)
    assert (out / "golden" / "mynote.txt").read_text() == "the user's note"
    (out / "golden" / "mynote.txt").unlink()
    # compare's report/: its own files are replaced with the artifact, anything else is the user's
    (out / "report").mkdir()
    (out / "report" / "report.json").write_text("{}")
    (out / "report" / "notes.txt").write_text("mine")
    with pytest.raises(OutputRefused, match=r"it also holds report/notes\.txt, which moedeploy did not write"):
        export("rmsnorm", out, seed=7)
    assert (out / "report" / "notes.txt").read_text() == "mine"
    # a manifest whose files list is damaged: moedeploy cannot tell its files from the user's
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "files": list(manifest["files"])}))
    with pytest.raises(OutputRefused, match=r"manifest\.json is damaged .* cannot tell its own files from yours"):
        export("rmsnorm", out, seed=7)


def test_a_re_export_keeps_the_users_files_in_cache_and_engines_and_replaces_its_own(
    rmsnorm_artifact: Path, tmp_path: Path
) -> None:
    """cache/ and engines/ were deleted whole: a plan or notes of the user's there went with them."""
    from moedeploy.runtime.ort import create_session
    from moedeploy.runtime.tensorrt import engine_name

    out = tmp_path / "art"
    shutil.copytree(rmsnorm_artifact, out, ignore=shutil.ignore_patterns("cache", "engines", "report"))
    create_session(out)  # the lowered-graph cache ONNX Runtime sessions write
    assert sorted(p.suffix for p in (out / "cache").iterdir()) == [".json", ".onnx"]  # (the block holds no external data)
    (out / "engines").mkdir()
    for suffix in (".plan", ".log", ".json"):  # what build writes, named as it names them
        (out / "engines" / engine_name("NVIDIA H100 80GB HBM3", "10.9.0.34", "fp32", True)).with_suffix(suffix).write_text("")
    (out / "engines" / "my.plan").write_text("mine")
    (out / "cache" / "notes.txt").write_text("mine")
    from moedeploy.export.artifact import Artifact
    from moedeploy.runtime.moe_tuning import Tuning, record

    record(Artifact.load(out), 2, Tuning("experts", "measured", 1.1, [1.1], [1.0], True))  # `moedeploy tune`'s
    with pytest.raises(OutputRefused, match=r"it also holds cache/notes\.txt, engines/my\.plan, which moedeploy did not"):
        export("rmsnorm", out, seed=7)
    assert (out / "engines" / "my.plan").read_text() == "mine" == (out / "cache" / "notes.txt").read_text()
    (out / "engines" / "my.plan").unlink()
    (out / "cache" / "notes.txt").unlink()
    export("rmsnorm", out, seed=7)  # moedeploy's own files alone: replaced
    assert not (out / "cache").exists() and not (out / "engines").exists()


def test_bench_json_never_replaces_a_link_a_pipe_a_users_file_or_an_artifacts_file(rmsnorm_artifact: Path,
                                                                                    tmp_path: Path) -> None:
    """--json is written by rename: it turned a symlink or a FIFO into a regular file, a user's
    own file into a benchmark, and took an artifact's manifest.json for a place to put one; a new
    file inside an artifact made its next export refuse the folder."""
    from typer.testing import CliRunner

    from moedeploy.cli import app

    art = tmp_path / "art"
    shutil.copytree(rmsnorm_artifact, art)
    manifest = (art / "manifest.json").read_bytes()
    (tmp_path / "notes.json").write_text("mine")
    other = '{"machine": "not a dict", "results": []}'  # JSON of the right keys, not of bench's making
    (tmp_path / "other.json").write_text(other)
    (tmp_path / "link.json").symlink_to(tmp_path / "notes.json")
    (tmp_path / "g").symlink_to(art / "golden")  # a folder link into the artifact
    os.mkfifo(tmp_path / "pipe.json")
    for target, message in ((tmp_path / "link.json", "exists and is not a regular file"),
                            (tmp_path / "pipe.json", "exists and is not a regular file"),
                            (art / "manifest.json", f"is inside the artifact {art}"),
                            (art / "golden" / "inputs.json", f"is inside the artifact {art}"),
                            (art / "golden" / "new.json", f"is inside the artifact {art}"),
                            (art / "bench.json", f"is inside the artifact {art}"),
                            (tmp_path / "g" / "new.json", f"is inside the artifact {art}"),
                            (tmp_path / "g" / ".." / "new.json", f"is inside the artifact {art}"),
                            (tmp_path / "notes.json", "already exists and is not a report bench wrote"),
                            (tmp_path / "other.json", "already exists and is not a report bench wrote")):
        result = CliRunner().invoke(app, ["bench", "tiny", "--backend", "ort", "--json", str(target)])
        assert result.exit_code == 1 and message in " ".join(result.output.split()), result.output
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "pipe.json").is_fifo()
    assert (art / "manifest.json").read_bytes() == manifest and (tmp_path / "notes.json").read_text() == "mine"
    assert (tmp_path / "other.json").read_text() == other
    assert not (art / "golden" / "new.json").exists() and not (art / "bench.json").exists()
    assert not (art / "new.json").exists()


def test_bench_refuses_a_cache_that_cannot_be_a_folder_before_any_work(tmp_path: Path, monkeypatch) -> None:
    """MOEDEPLOY_CACHE naming a file failed after the trace and the golden outputs, with
    "Not a directory" and no fix; it fails first, naming the variable to change."""
    from typer.testing import CliRunner

    from moedeploy.cli import app

    (tmp_path / "a-file").write_text("mine")
    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "a-file"))
    result = CliRunner().invoke(app, ["bench", "tiny", "--backend", "ort"])
    message = " ".join(result.output.split())
    assert result.exit_code == 1 and "is not a folder; choose another MOEDEPLOY_CACHE" in message, result.output
    assert "exporting" not in message  # before any work
    assert (tmp_path / "a-file").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_compare_refuses_before_any_work_to_replace_a_report_folder_holding_user_files(
        rmsnorm_artifact: Path, tmp_path: Path) -> None:
    """compare rewrites report/ whole: a file of the user's there is named and kept, and nothing runs."""
    from moedeploy.compare.api import compare

    art = tmp_path / "art"
    shutil.copytree(rmsnorm_artifact, art)
    compare(art, iterations=1)
    assert (art / "report" / "report.json").is_file()
    (art / "report" / "my_notes.md").write_text("mine")
    with pytest.raises(OutputRefused, match=r"my_notes\.md, which compare did not write"):
        compare(art, iterations=1, progress=lambda step: pytest.fail(f"work started: {step}"))
    assert (art / "report" / "my_notes.md").read_text() == "mine"


def test_the_folders_moedeploy_writes_into_an_artifact_are_the_ones_its_commands_use() -> None:
    from moedeploy.compare.api import REPORT_DIR
    from moedeploy.export.artifact import DERIVED_DIRS
    from moedeploy.runtime.ort import CACHE_DIR
    from moedeploy.runtime.tensorrt import ENGINES_DIR

    assert set(DERIVED_DIRS) == {REPORT_DIR, CACHE_DIR, ENGINES_DIR}
    from moedeploy.compare.api import ACCURACY, RUN_RESULTS
    from moedeploy.export.artifact import REPORT_FILES

    assert {RUN_RESULTS, ACCURACY} <= set(REPORT_FILES)  # what compare saves is what a re-export may replace


def test_triton_repo_replaces_only_its_own_model_folders(rmsnorm_artifact: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    theirs = _user_folder(repo / "rmsnorm")  # a hand-made model of the same name
    with pytest.raises(OutputRefused, match="not written by moedeploy"):
        write_repository(rmsnorm_artifact, repo)
    assert sorted(p.name for p in theirs.iterdir()) == ["important.txt"]
    write_repository(rmsnorm_artifact, repo, force=True)
    write_repository(rmsnorm_artifact, repo)  # now it is ours: replaced without --force
    assert (repo / "rmsnorm" / "config.pbtxt").is_file() and not (repo / "rmsnorm" / "important.txt").exists()


def test_triton_repo_keeps_what_the_user_put_in_its_model_folder(rmsnorm_artifact: Path, tmp_path: Path) -> None:
    """Before, only config.pbtxt's first line was checked: a version 2 of the user's and their
    notes were deleted by the next run."""
    from moedeploy.serving.specs import ServingError

    repo = tmp_path / "repo"
    write_repository(rmsnorm_artifact, repo)
    (repo / "rmsnorm" / "2").mkdir()
    (repo / "rmsnorm" / "2" / "model.onnx").write_text("mine")
    (repo / "rmsnorm" / "1" / "extra.txt").write_text("mine")
    (repo / "rmsnorm" / "NOTES").write_text("mine")
    with pytest.raises(ServingError, match=r"also holds 1/extra\.txt, 2, NOTES, which moedeploy did not write"):
        write_repository(rmsnorm_artifact, repo)
    assert (repo / "rmsnorm" / "2" / "model.onnx").read_text() == "mine" == (repo / "rmsnorm" / "NOTES").read_text()


@pytest.mark.parametrize("force", [False, True])
def test_triton_repo_never_replaces_the_artifact_it_reads(rmsnorm_artifact: Path, tmp_path: Path, force: bool) -> None:
    """`triton-repo t/rmsnorm --out t --force` replaced the artifact with the model folder made from it."""
    from moedeploy.serving.specs import ServingError

    art = tmp_path / "t" / "rmsnorm"
    shutil.copytree(rmsnorm_artifact, art)
    files = sorted(p.name for p in art.iterdir())
    with pytest.raises(ServingError, match=f"the model folder {art} is the artifact {art} it would be made from"):
        write_repository(art, tmp_path / "t", force=force)
    assert sorted(p.name for p in art.iterdir()) == files


def test_all_writes_only_into_a_new_empty_or_earlier_run_folder(rmsnorm_artifact: Path, tmp_path: Path) -> None:
    check_run_folder(tmp_path / "new")
    with pytest.raises(OutputRefused, match="did not write"):
        check_run_folder(_user_folder(tmp_path / "mine"))
    check_run_folder(_user_folder(tmp_path / "forced"), force=True)
    interrupted = tmp_path / "interrupted"  # an earlier run stopped before its summary
    interrupted.mkdir()
    shutil.copytree(rmsnorm_artifact, interrupted / "rmsnorm")
    check_run_folder(interrupted)
    (interrupted / "summary.json").write_text(json.dumps({"results": [], "versions": {}}))
    (interrupted / "index.html").write_text("<html></html>")
    check_run_folder(interrupted)
    (interrupted / "rmsnorm" / "golden" / "mine.json").write_text("{}")
    with pytest.raises(OutputRefused, match=r"already holds rmsnorm/golden/mine\.json, which `moedeploy all` did not"):
        check_run_folder(interrupted)
    (interrupted / "notes.txt").write_text("mine")
    with pytest.raises(OutputRefused, match=r"already holds notes\.txt, rmsnorm/golden/mine\.json, which"):
        check_run_folder(interrupted)


# --- interrupted writes -------------------------------------------------------------------------


WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from moedeploy.cli import exit_on_sigterm
    from moedeploy.utils.io import atomic_directory
    if sys.argv[2] == "handled":
        exit_on_sigterm()  # what `moedeploy` (cli.main) installs first
    with atomic_directory(Path(sys.argv[1])) as tmp:
        (tmp / "model.onnx.data").write_bytes(bytes(1 << 20))
        print("writing", flush=True)
        time.sleep(60)
""")


def _start_writer(out: Path, mode: str) -> subprocess.Popen:
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(out), mode], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    assert [p.name for p in out.parent.glob(f".{out.name}.{writer.pid}.*.tmp")]  # mid-write
    return writer


def test_sigterm_mid_write_removes_the_temp_folder(tmp_path: Path) -> None:
    writer = _start_writer(tmp_path / "art", "handled")
    writer.send_signal(signal.SIGTERM)
    assert writer.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def _exit_when_a_library_turns(signum: int, caught: type[BaseException]) -> int:
    """The exit code of a command in which `signum` arrives, with main's handlers, while a C
    extension initialises: `caught` (what the handler raised: SystemExit for SIGTERM,
    KeyboardInterrupt for Ctrl-C) comes out of the import as ImportError("initialization failed")."""
    import typer

    from moedeploy import cli

    previous = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python starts a program
    try:
        cli.exit_on_sigterm()

        @cli.handle_errors
        def command() -> None:
            try:
                signal.raise_signal(signum)
            except caught as e:  # what a pybind11 module's initialisation makes of the handler's exception
                raise ImportError("initialization failed") from e

        with pytest.raises(typer.Exit) as exited:
            command()
        return exited.value.exit_code
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def test_sigterm_that_a_library_turns_into_another_exception_exits_143_not_as_a_bug(monkeypatch, capsys) -> None:
    """A SIGTERM while a C extension initialises (onnxruntime's import, say) reached the command
    as ImportError("initialization failed"): reported as a bug in moedeploy, exit 1. It is the
    signal's exit, 143, with "terminated" and no error line."""
    import typer

    from moedeploy import cli

    monkeypatch.setitem(cli._state, "signal", None)
    assert _exit_when_a_library_turns(signal.SIGTERM, SystemExit) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == "terminated"

    @cli.handle_errors
    def buggy() -> None:
        raise ImportError("initialization failed")

    monkeypatch.setitem(cli._state, "signal", None)  # without a signal, the same exception is still ours
    with pytest.raises(typer.Exit) as exited:
        buggy()
    assert exited.value.exit_code == 1


def test_a_sigterm_during_a_command_says_terminated(monkeypatch, capsys) -> None:
    """Ctrl-C said "interrupted"; SIGTERM (a CI timeout, `kill`) ended a command with exit 143 and
    no line at all."""
    from moedeploy import cli

    monkeypatch.setitem(cli._state, "signal", None)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        cli.exit_on_sigterm()

        @cli.handle_errors
        def command() -> None:
            signal.raise_signal(signal.SIGTERM)

        with pytest.raises(SystemExit) as exited:
            command()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exited.value.code == 128 + signal.SIGTERM and capsys.readouterr().err.strip() == "terminated"


def test_ctrl_c_that_a_library_turns_into_another_exception_exits_130_as_interrupted(monkeypatch, capsys) -> None:
    """Ctrl-C while export imported onnxruntime (a pybind11 module's initialisation) reached the
    command as ImportError("initialization failed"): "internal error ... a bug in moedeploy",
    exit 1, in 4 of 6 tries. It is "interrupted", exit 130, as any other Ctrl-C."""
    from moedeploy import cli

    monkeypatch.setitem(cli._state, "signal", None)
    assert _exit_when_a_library_turns(signal.SIGINT, KeyboardInterrupt) == 128 + signal.SIGINT
    assert "interrupted" in capsys.readouterr().err


def _replace_then(monkeypatch: pytest.MonkeyPatch, when: str, then) -> None:
    """os.replace as atomic_directory calls it, with `then()` run right after the rename whose
    source (`when="moved aside"`: the old output, into its temp folder) or before the one whose
    destination is the output (`when="into place"`)."""
    real = os.replace

    def replace(src, dst) -> None:
        if when == "into place" and Path(src).name.endswith(".tmp"):
            then()
        real(src, dst)
        if when == "moved aside" and Path(dst).name == "x":
            then()

    monkeypatch.setattr(os, "replace", replace)


def test_ctrl_c_between_the_renames_waits_until_the_new_output_is_in_place(tmp_path: Path, monkeypatch) -> None:
    """Before, a Ctrl-C just after the old output was moved aside deleted the new one and left
    the old one in a temp folder that the next write sweeps: neither was at --out."""
    out = tmp_path / "art"
    with atomic_directory(out) as tmp:
        (tmp / "v.txt").write_text("old")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C raises, as in a shell
    try:
        _replace_then(monkeypatch, "moved aside", lambda: signal.raise_signal(signal.SIGINT))
        with pytest.raises(KeyboardInterrupt), atomic_directory(out, force=True) as tmp:
            (tmp / "v.txt").write_text("new")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (out / "v.txt").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["art"]  # no temp folder holds the old output


def test_a_failed_last_rename_puts_the_old_output_back(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "art"
    with atomic_directory(out) as tmp:
        (tmp / "v.txt").write_text("old")

    def fail() -> None:
        raise OSError(errno.EIO, "Input/output error")

    _replace_then(monkeypatch, "into place", fail)
    with pytest.raises(OSError, match="Input/output error"), atomic_directory(out, force=True) as tmp:
        (tmp / "v.txt").write_text("new")
    assert (out / "v.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["art"]


def test_an_output_that_cannot_be_moved_aside_leaves_no_temp_folder(tmp_path: Path, monkeypatch) -> None:
    """--out a mount point (EBUSY on the rename that moves it aside) left a `.old` folder each time."""
    out = tmp_path / "art"
    with atomic_directory(out) as tmp:
        (tmp / "v.txt").write_text("old")
    real = os.replace

    def replace(src, dst) -> None:
        if Path(src) == out:
            raise OSError(errno.EBUSY, "Device or resource busy")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="busy"), atomic_directory(out, force=True) as tmp:
        (tmp / "v.txt").write_text("new")
    assert (out / "v.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["art"]


def test_a_killed_writers_temp_folder_is_swept_by_the_next_write(tmp_path: Path) -> None:
    out = tmp_path / "art"
    writer = _start_writer(out, "unhandled")
    writer.send_signal(signal.SIGKILL)  # nothing can clean up after SIGKILL
    writer.wait(timeout=30)
    left = list(tmp_path.glob(".art.*.tmp"))
    assert len(left) == 1
    _write_one(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_sweeping_spares_live_writers_and_other_outputs(tmp_path: Path) -> None:
    dead = _dead_pid()
    stale = tmp_path / f".art.{dead}.k2j4_x.tmp"
    live = tmp_path / f".art.{os.getppid()}.abc123.tmp"  # our parent: alive
    other = tmp_path / f".other.{dead}.abc123.tmp"  # another output's
    users_file = tmp_path / f".art.{dead}.abc123.old"  # a file, not a folder we make
    users_folder = tmp_path / f".art.{dead}.backup.tmp"  # named alike, but not made by moedeploy
    for folder in (stale, live, other, users_folder):
        folder.mkdir()
    for folder in (stale, live, other):
        (folder / TEMP_MARKER).touch()
    (users_folder / "thesis.txt").write_text("years of work")
    users_file.write_text("x")
    _write_one(tmp_path / "art")
    assert not stale.exists()
    assert live.is_dir() and other.is_dir() and users_file.is_file()
    assert (users_folder / "thesis.txt").read_text() == "years of work"
    assert TEMP_MARKER not in {p.name for p in (tmp_path / "art").iterdir()}  # the marker stays out of the output


# --- disk full, file modes ----------------------------------------------------------------------


def test_too_little_free_space_is_refused_before_writing_with_the_path(tmp_path: Path, monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("moedeploy.utils.io.shutil.disk_usage", lambda _: usage(10 << 30, 10 << 30, 1 << 20))
    out = tmp_path / "art"
    with pytest.raises(OSError, match=f"not enough free space to write {out}") as e:
        export("rmsnorm", out)
    assert e.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_disk_full_mid_write_names_the_output_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "art"
    with pytest.raises(OSError, match=f"no space left on the device while writing {out}"), atomic_directory(out):
        raise OSError(errno.ENOSPC, "No space left on device")  # what a full disk raises, with no path
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_artifact_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        out = export("rmsnorm", tmp_path / "art").path
    finally:
        os.umask(old)
    for path in [out, *out.rglob("*")]:
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert path.stat().st_mode & 0o777 == expected, path


@pytest.mark.parametrize("earlier", [False, True], ids=["new", "over-an-earlier-output"])
def test_a_writer_that_finished_between_the_look_and_the_rename_is_replaced_not_a_failure(
        tmp_path: Path, monkeypatch, earlier: bool) -> None:
    """Two `compare` runs of one artifact finishing together: the other's report/ appeared at
    --out after this one looked, and the rename into place failed (ENOTEMPTY), so a run whose
    comparison passed exited 1 with "Directory not empty". The later writer's output stays."""
    out = tmp_path / "art"
    if earlier:
        with atomic_directory(out) as tmp:
            (tmp / "v.txt").write_text("earlier")
    arrived = []

    def other_writer_finishes() -> None:
        if not arrived:
            arrived.append(True)
            os.mkdir(out)  # os.replace is patched: the other writer's output, put there in one step
            (out / "v.txt").write_text("theirs")

    _replace_then(monkeypatch, "into place", other_writer_finishes)
    with atomic_directory(out, force=True) as tmp:
        (tmp / "v.txt").write_text("ours")
    assert arrived and (out / "v.txt").read_text() == "ours"
    assert sorted(p.name for p in out.iterdir()) == ["v.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["art"]  # no temp folder left


def test_an_output_that_keeps_reappearing_is_an_error_that_leaves_the_others_output(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "art"

    def another_writer_each_time() -> None:
        if not out.exists():
            os.mkdir(out)
            (out / "v.txt").write_text("theirs")

    _replace_then(monkeypatch, "into place", another_writer_each_time)
    with pytest.raises(OSError) as raised, atomic_directory(out, force=True) as tmp:
        (tmp / "v.txt").write_text("ours")
    assert raised.value.errno in (errno.ENOTEMPTY, errno.EEXIST)
    assert (out / "v.txt").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["art"]


def test_a_users_folder_that_appears_before_the_rename_is_refused_and_kept(tmp_path: Path, monkeypatch) -> None:
    """What appears at --out between the look and the rename is replaced only when a replace
    of it would have been allowed anyway: a user's folder is refused and stays as it is."""
    out = tmp_path / "art"

    def ours(p: Path) -> bool:
        return (p / "v.txt").is_file()

    with atomic_directory(out, owned=ours) as tmp:
        (tmp / "v.txt").write_text("earlier")

    def users_folder_appears() -> None:
        if not out.exists():
            os.mkdir(out)
            (out / "user.txt").write_text("mine")

    _replace_then(monkeypatch, "into place", users_folder_appears)
    with pytest.raises(OutputRefused), atomic_directory(out, owned=ours) as tmp:
        (tmp / "v.txt").write_text("ours")
    assert sorted(p.name for p in out.iterdir()) == ["user.txt"] and (out / "user.txt").read_text() == "mine"
    # the earlier output waits in a marked temp folder, for the next write's sweep (as before)
    left = [p for p in tmp_path.iterdir() if p.name != "art"]
    assert len(left) == 1 and left[0].name.endswith(".old") and (left[0] / TEMP_MARKER).is_file()
    assert (left[0] / "x" / "v.txt").read_text() == "earlier"
