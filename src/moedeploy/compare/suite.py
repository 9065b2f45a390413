"""`moedeploy all`: export every block and the decoder, compare each backend, index the reports."""

from __future__ import annotations

import datetime
import json
import time
import traceback
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from moedeploy.compare.all_checks import TRT_STOPS, all_backends_problem, not_runnable_here
from moedeploy.compare.api import compare
from moedeploy.compare.report import divergence_note, plain
from moedeploy.export import BLOCKS, DECODER, export
from moedeploy.export.exporter import library_versions
from moedeploy.names import DECODER_ONLY_BACKENDS
from moedeploy.runtime.ort import SessionError
from moedeploy.runtime.tensorrt import require_gpu
from moedeploy.runtime.tensorrt_import import (
    TensorRTUnavailable,
    tensorrt_available,
)
from moedeploy.utils.io import OutputRefused, atomic_write_json, atomic_write_text, few_names

Progress = Callable[[str], None]


def default_backends() -> list[str]:
    """ONNX Runtime always; TensorRT when it is installed and a GPU is visible."""
    if tensorrt_available():
        import torch

        if torch.cuda.is_available():
            return ["ort", "trt"]
    return ["ort"]


def run_all(
    out: str | Path,
    backends: list[str] | None = None,
    dtype: str = "fp32",
    preset_name: str = "tiny",
    iterations: int = 3,
    seed: int = 0,
    targets: list[str] | None = None,
    progress: Progress | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Returns summary.json's dict; writes <out>/<target>/ artifacts, <out>/index.html.

    `out` must be new, empty or an earlier run's folder (it has our summary.json), so a typo'd
    --out never mixes artifacts into, or replaces, a user's files; `force` writes there anyway.
    """
    progress = progress or (lambda _: None)
    out = Path(out)
    check_run_folder(out, force)
    backends = backends or default_backends()
    targets = targets or [*BLOCKS, DECODER]
    if reason := not_runnable_here(dtype, backends):  # before exporting anything it could not compare
        raise SessionError(f"moedeploy all --dtype {dtype} stops before exporting: {reason}")
    if problem := all_backends_problem(backends, targets):
        raise SessionError(problem)
    if "trt" in backends:  # else every target is exported, then fails to build
        try:
            require_gpu()
        except TensorRTUnavailable as e:
            raise SessionError(f"{TRT_STOPS}: {e}") from None
    rows = []
    for i, target in enumerate(targets, 1):
        progress(f"[{i}/{len(targets)}] {target}")
        start = time.perf_counter()
        row: dict[str, Any] = {"name": target, "artifact": target, "report": None}  # linked once it is written
        try:
            artifact = export(target, out / target, preset_name=preset_name if target == DECODER else None,
                              dtype=dtype, seed=seed, force=force)
            if "trt" in backends:
                from moedeploy.runtime.tensorrt import build_engine

                build_engine(artifact)
            # the decoder-only lowerings (GroupQueryAttention, fused residual norms) have nothing to lower in a block
            compared = [b for b in backends if target == DECODER or b not in DECODER_ONLY_BACKENDS]
            report = compare(artifact, compared, iterations=iterations, seed=seed, layerwise=True)
            row["report"] = f"{target}/report/report.html"
            first = report["comparisons"][0]["outputs"]
            name, stats = next(iter(first.items()))
            row.update(
                passed=report["passed"],
                kind=artifact.kind,
                custom_ops=[f"{o['domain']}::{o['op_type']}" for o in artifact.manifest["custom_ops"]],
                output=name,
                max_abs=stats.get("max_abs"),
                cosine=stats.get("cosine"),
                first_divergent_layer=report["first_divergent_layer"],
                # outputs pass, yet a module inside is out of its own tolerance: say what that means
                note=divergence_note(report, plain) if report["passed"] else None,
            )
        except Exception as e:  # one broken target must not hide the others' results
            row.update(passed=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(row)
    summary = {
        "passed": all(r["passed"] for r in rows),
        "backends": backends,
        "dtype": dtype,
        "preset": preset_name,
        "seed": seed,
        "results": rows,
        "versions": library_versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    atomic_write_json(out / SUMMARY, summary)
    atomic_write_text(out / INDEX, render_index(summary))
    return summary


SUMMARY = "summary.json"
INDEX = "index.html"


def strangers_in_run_folder(path: Path) -> list[str]:
    """What in `path` `run_all` did not write: anything besides its summary, its index and
    artifacts (an interrupted run has artifacts but no summary yet, and may be run again), and
    inside an artifact anything it did not write (export.exporter.foreign_entries)."""
    from moedeploy.export.artifact import seal_problem
    from moedeploy.export.exporter import artifact_manifest, foreign_entries

    strangers = []
    for entry in sorted(path.iterdir()):
        if entry.name == SUMMARY:
            try:
                summary = json.loads(entry.read_text())
            except (OSError, ValueError):
                summary = None
            if not (isinstance(summary, dict) and isinstance(summary.get("results"), list)):
                strangers.append(entry.name)
        elif entry.name == INDEX or entry.name.startswith("."):  # index.html, temp files of our writes
            continue
        elif not entry.is_dir() or entry.is_symlink() or (manifest := artifact_manifest(entry)) is None:
            strangers.append(entry.name)
        elif not isinstance(manifest.get("files"), dict) or seal_problem(manifest):
            strangers.append(f"{entry.name}/manifest.json (damaged or edited)")
        else:
            strangers += [f"{entry.name}/{name}" for name in foreign_entries(entry, manifest)]
    return strangers


def check_run_folder(out: Path, force: bool = False) -> None:
    """Refuse an --out that holds something other than an earlier `moedeploy all` run."""
    if not out.exists() or force:
        return
    if not out.is_dir():
        raise OutputRefused(f"output path {out} exists and is not a folder; choose another --out")
    if strangers := strangers_in_run_folder(out):
        raise OutputRefused(
            f"{out} already holds {few_names(strangers)}, which `moedeploy all` did not write; choose another --out, "
            "or pass --force to write the artifacts into it (folders named like a target, index.html and summary.json "
            "are replaced)"
        )


def render_index(summary: dict[str, Any]) -> str:
    import jinja2

    template = resources.files("moedeploy.compare").joinpath("templates/index.html.j2").read_text()
    env = jinja2.Environment(autoescape=True, undefined=jinja2.ChainableUndefined)
    return env.from_string(template).render(s=summary)
