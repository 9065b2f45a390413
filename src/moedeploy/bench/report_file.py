"""Where a benchmark may write its --json report: `moedeploy bench` and the scripts under
benchmarks/ share one rule, checked before any timing.

A new file, or a report the same tool wrote before, in an existing folder we can write, and
nowhere inside an artifact. Replacing is by rename, which turned a symlink, a FIFO or a device
(/dev/full, as root) into a regular file, an artifact's manifest.json into a benchmark, and a
user's own file into one; a new file inside an artifact made its next export refuse the folder
as holding a file moedeploy did not write.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the key a script's report names its script under (what makes a file "a report it wrote")
SCRIPT_KEY = "benchmark"
#: larger files are not read to find out whether they are a report
LARGEST_REPORT = 64 << 20


def report_target_problem(path: Path, is_ours: Callable[[dict[str, Any]], bool], owner: str,
                          option: str = "--json") -> str:
    """Why `path` may not receive a report ('' when it may); `is_ours(report)` says whether an
    existing JSON object is a report `owner` (bench, a script) wrote, and so may be replaced."""
    from moedeploy.names import MANIFEST  # not export.artifact's: checked before torch is imported
    from moedeploy.utils.io import new_folder_problem

    if path.is_dir() or not path.parent.is_dir():
        return f"{option} {path}: name a file in an existing folder"
    if path.is_symlink() or (path.exists() and not path.is_file()):
        return (f"{option} {path} exists and is not a regular file (a link, a pipe or a device), which writing "
                "would replace; name a new file")
    # the folder as the write will find it: a link to an artifact's golden/ (or `link/..`) is inside it
    absolute = path.parent.resolve() / path.name
    for folder in list(absolute.parents)[:3]:  # an artifact's files lie at most two folders down
        if (folder / MANIFEST).is_file():
            return (f"{option} {path} is inside the artifact {folder}, whose files export and compare own; "
                    "name a file outside it")
    if path.exists() and not _holds_our_report(path, is_ours):
        return (f"{option} {path} already exists and is not a report {owner} wrote, which moedeploy does not "
                "replace; name a new file, or move that one away first")
    if problem := new_folder_problem(path.parent.resolve()):
        return f"cannot write to {path.parent}: {problem}; choose another {option}"
    return ""


def _holds_our_report(path: Path, is_ours: Callable[[dict[str, Any]], bool]) -> bool:
    try:
        if path.stat().st_size > LARGEST_REPORT:
            return False
        report = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and is_ours(report)


def script_report_check(parser: argparse.ArgumentParser, path: Path | None, script: str) -> None:
    """A script's --json, before any timing: parser.error (one line, exit 2) where it may not go."""
    if path is not None and (problem := report_target_problem(path, lambda r: r.get(SCRIPT_KEY) == script, script)):
        parser.error(problem)


def write_script_report(path: Path | None, script: str, report: dict[str, Any]) -> None:
    """Write a script's report atomically, marked as its own (so a later run may replace it)."""
    if path is not None:
        from moedeploy.utils.io import atomic_write_text

        atomic_write_text(path, json.dumps({SCRIPT_KEY: script, **report}, indent=2))


def at_least(parser: argparse.ArgumentParser, args: argparse.Namespace, least: dict[str, int]) -> None:
    """Each option (its flag) holds at least its least value (every value, for a list), or parser.error."""
    for option, minimum in least.items():
        value = getattr(args, option.lstrip("-").replace("-", "_"))
        if any(v < minimum for v in (value if isinstance(value, list) else [value])):
            parser.error(f"{option} must be at least {minimum}, got {value}")


def run_script(main: Callable[[], int | None]) -> None:
    """Run a benchmark script's main: a target or model it cannot take (ValueError), or a file it
    cannot read or write (OSError), ends in one line and exit 1, not a traceback."""
    try:
        sys.exit(main())
    except ValueError as e:
        sys.exit(f"error: {e}")
    except OSError as e:
        sys.exit(f"error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
