"""Atomic writes: a reader never sees a half-written file, and a failure leaves nothing behind."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, then rename over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600; give it a normal file's mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def folder_locked(folder: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on `folder` (flock on the folder itself: no lock file left behind)
    for a read-modify-write of a record in it. An atomic write alone keeps a reader from seeing
    half a file, but of two writers that read the same old record, the second would drop the
    first's entry. Where flock does not exist (not POSIX) or the filesystem refuses it on a
    folder (NFS and CIFS emulate flock as a byte-range lock, which needs a file open for
    writing) nothing is locked: losing a concurrent writer's entry is better than failing a
    write that minutes of measuring led up to."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def read_json_object(path: Path, error: type[Exception]) -> dict[str, Any]:
    """A JSON file that must hold an object, or `error` with one line naming the file and the fault."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{path} must hold a JSON object")
    return data


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


@contextlib.contextmanager
def atomic_directory(
    path: str | Path, *, owned: Callable[[Path], bool] | None = None, force: bool = False
) -> Iterator[Path]:
    """Yield a temp folder beside `path`; on success it replaces `path`, on failure it vanishes.

    The rename is atomic for the folder itself; an existing `path` is moved aside first and
    deleted only once the new one is in place. An existing `path` is replaced only when it is
    empty or `owned(path)` says moedeploy wrote it (or `force`): see `check_replaceable`.
    Temp folders carry the writer's PID, so ones left by a killed process are swept here.
    """
    path = Path(path)
    check_replaceable(path, owned, force)
    parent = path.parent
    created = [p for p in (parent, *parent.parents) if not p.exists()]
    parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_temp(path)
    try:
        tmp = _marked_temp(path, ".tmp")
    except BaseException:
        _remove_empty(created)
        raise
    try:
        yield tmp
        normalise_modes(tmp)
        with signals_deferred():  # see _swap_into_place
            old = _swap_into_place(tmp, path, owned, force)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no space left on the device while writing {path}; free space "
                                        "or choose another --out") from None
        raise


def _swap_into_place(tmp: Path, path: Path, owned: Callable[[Path], bool] | None, force: bool) -> Path | None:
    """Put the finished `tmp` at `path`; an existing `path` goes into a marked temp folder, which
    is returned for the caller to delete. Run with Ctrl-C and SIGTERM held (`signals_deferred`):
    cut between the two renames, the previous output sat in a temp folder the next write sweeps,
    and `path` was gone. A failed second rename puts the previous output back.

    Another writer of the same output (two `compare` runs of one artifact finishing together)
    can put its folder at `path` between the look and the rename, which then fails (ENOTEMPTY):
    that folder is replaced as any earlier output is, once, so the later writer's output stays
    and neither run fails."""
    superseded: list[Path] = []  # outputs older than another writer's: deleted once ours is in place
    for last_try in (False, True):
        old = None
        if path.exists():
            check_replaceable(path, owned, force)  # it may have changed while we worked
            old = _marked_temp(path, ".old")
            try:
                os.replace(path, old / "x")
            except BaseException:  # e.g. EBUSY: --out is a mount point, which no rename moves
                shutil.rmtree(old, ignore_errors=True)
                raise
        try:
            (tmp / TEMP_MARKER).unlink()  # not part of the output (unmarked for this one call only)
            os.replace(tmp, path)
        except BaseException as e:
            raced = isinstance(e, OSError) and e.errno in (errno.ENOTEMPTY, errno.EEXIST) and path.is_dir()
            if raced:
                (tmp / TEMP_MARKER).touch()
            if old is not None:
                if raced:  # kept (marked) until ours or another's output holds path
                    superseded.append(old)
                else:
                    os.replace(old / "x", path)
                    shutil.rmtree(old, ignore_errors=True)
            if raced and not last_try:
                continue
            if raced:  # path holds another writer's complete output, newer than those
                for folder in superseded:
                    shutil.rmtree(folder, ignore_errors=True)
            raise
        for folder in superseded:
            shutil.rmtree(folder, ignore_errors=True)
        return old
    raise AssertionError("unreachable: the last try returns or raises")


def new_folder_problem(folder: Path) -> str | None:
    """Why a new folder cannot be made in `folder` (an existing folder), or None: a real probe,
    made and removed at once, since os.access says yes to root everywhere and nothing about a
    read-only mount."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".moedeploy-probe-", dir=folder))
    except OSError as e:
        return f"{folder} does not accept new folders ({e.strerror})"
    return None


@contextlib.contextmanager
def signals_deferred(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold these signals' Python handlers until the block ends, then deliver what came, in order.

    For a few system calls that must not be cut between (`_swap_into_place`, and deleting the
    output it replaced, so an interrupted write leaves no copy of it behind). Only the main
    thread can set handlers; elsewhere, and for a signal whose handler is not Python's (None),
    nothing is held.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = {n: h for n in signals if (h := signal.getsignal(n)) is not None}
    for n in held:
        signal.signal(n, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        for n, handler in held.items():
            signal.signal(n, handler)
        for n in caught:
            signal.raise_signal(n)


def few_names(names: list[str], shown: int = 3) -> str:
    """"a, b, c and 4 more": what an error names of a longer list."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


class OutputRefused(ValueError):
    """An output path moedeploy will not replace: it holds something moedeploy did not write."""


def is_mount_point(path: Path) -> bool:
    """Whether something is mounted at `path` (resolved), which no rename moves. On Linux by the
    mount table: os.path.ismount also says yes to a btrfs subvolume, which renames like any folder."""
    try:
        table = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return os.path.ismount(path)
    for line in table.splitlines():
        fields = line.split(" ")
        if len(fields) > 4 and _unescape_mount(fields[4]) == str(path):
            return True
    return False


def _unescape_mount(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are written as octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def check_replaceable(path: str | Path, owned: Callable[[Path], bool] | None = None, force: bool = False) -> None:
    """Refuse, before any work, to replace what moedeploy did not write.

    A path may be replaced when it does not exist, is an empty folder, or `owned(path)` says
    moedeploy wrote it (an artifact has its manifest, a report folder its report.json).
    `force` replaces any other folder too, but never the current folder, one holding it, the
    home folder or a filesystem root: replacing those would pull the ground from under the
    user's shell.
    """
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    resolved = path.resolve()
    if path.is_symlink():  # replacing it would replace the link, not what it points to: never done
        raise OutputRefused(f"output path {path} is a link (to {resolved}), which moedeploy never replaces, --force or "
                            "not; choose another --out, or name the folder it points to")
    if not path.is_dir():
        raise OutputRefused(f"output path {path} exists and is not a folder moedeploy wrote; choose another --out")
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents or resolved == Path.home().resolve() or resolved == resolved.parent:
        raise OutputRefused(
            f"refusing to replace {resolved}: it is the current folder, holds it, or is the home or root folder; "
            f"choose a new subfolder, e.g. --out {path / 'artifact'}"
        )
    if is_mount_point(resolved):  # the swap renames it aside, which a mount refuses (EBUSY) after all the work
        raise OutputRefused(f"{path} is a mount point, which moedeploy cannot replace (it moves the old output aside "
                            f"first); write into a new folder inside it, e.g. {path / 'artifact'}")
    if force or not any(resolved.iterdir()) or (owned is not None and owned(resolved)):
        return
    raise OutputRefused(
        f"{path} already exists and was not written by moedeploy; it would be replaced with everything in it. "
        "Choose another --out, empty the folder, or pass --force to replace it"
    )


#: The file inside each temp folder `atomic_directory` makes: what tells the sweep of a killed
#: writer's leftovers from a user's folder that happens to be named alike
TEMP_MARKER = ".moedeploy-temp"


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.{os.getpid()}."


def _marked_temp(path: Path, suffix: str) -> Path:
    """A new temp folder beside `path`, named for it and this process, holding TEMP_MARKER."""
    folder = Path(tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=suffix, dir=path.parent))
    (folder / TEMP_MARKER).touch()
    return folder


def sweep_stale_temp(path: str | Path) -> list[Path]:
    """Remove temp folders beside `path` that an interrupted write of `path` left behind.

    Only folders named as `atomic_directory` names them, for this very `path`, that hold its
    TEMP_MARKER and whose writer process no longer runs: a concurrent writer's work in progress
    is never touched, nor a folder of the user's that happens to match the name.
    """
    path = Path(path)
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(\d+)\.[A-Za-z0-9_]+\.(tmp|old)$")
    removed = []
    with contextlib.suppress(OSError):
        for entry in path.parent.iterdir():
            match = pattern.match(entry.name)
            if (match and entry.is_dir() and not entry.is_symlink() and (entry / TEMP_MARKER).is_file()
                    and not _process_alive(int(match.group(1)))):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def normalise_modes(folder: Path) -> None:
    """Give every file and folder under `folder` the mode the umask asks for.

    mkdtemp makes 0700 folders, and some writers (tempfile-based ones) leave 0600 files; an
    artifact is meant to be shared like any other output.
    """
    mask = current_umask()
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            file = os.path.join(root, name)
            if not os.path.islink(file):
                os.chmod(file, 0o666 & ~mask)


def _remove_empty(folders: list[Path]) -> None:
    """Remove folders we created (deepest first) if they are still empty."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


#: Head room kept free beyond an estimate: file-system metadata, a report, a log.
FREE_SPACE_MARGIN = 64 << 20


def require_free_space(path: str | Path, needed_bytes: int) -> None:
    """Fail before writing when the file system that will hold `path` has too little room.

    Writing first and failing on ENOSPC halfway wastes the work and, without this, names no
    path; the estimate is the caller's (the serialised model plus golden data for an export).
    """
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path.cwd())
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return  # cannot tell: let the write itself report
    if free < needed_bytes + FREE_SPACE_MARGIN:
        raise OSError(
            errno.ENOSPC,
            f"not enough free space to write {path}: it needs about {_megabytes(needed_bytes)}, "
            f"{_megabytes(free)} free on {existing}; free space or choose another --out",
        )


def _megabytes(n: int) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 1e6 else f"{n / 1e6:.1f} MB"
