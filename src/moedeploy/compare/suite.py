"""`moedeploy all`: export every block and the decoder, compare each backend, index the reports."""

from __future__ import annotations

import datetime
import time
import traceback
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from moedeploy.compare.api import compare, not_runnable_here
from moedeploy.compare.report import divergence_note, plain
from moedeploy.export import BLOCKS, DECODER, export
from moedeploy.export.exporter import library_versions
from moedeploy.runtime.ort import SessionError
from moedeploy.runtime.tensorrt import tensorrt_available
from moedeploy.utils.io import atomic_write_json, atomic_write_text

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
) -> dict[str, Any]:
    """Returns summary.json's dict; writes <out>/<target>/ artifacts, <out>/index.html."""
    progress = progress or (lambda _: None)
    out = Path(out)
    backends = backends or default_backends()
    targets = targets or [*BLOCKS, DECODER]
    if reason := not_runnable_here(dtype, backends):  # before exporting anything it could not compare
        raise SessionError(f"moedeploy all --dtype {dtype} stops before exporting: {reason}")
    rows = []
    for i, target in enumerate(targets, 1):
        progress(f"[{i}/{len(targets)}] {target}")
        start = time.perf_counter()
        row: dict[str, Any] = {"name": target, "artifact": target, "report": None}  # linked once it is written
        try:
            artifact = export(target, out / target, preset_name=preset_name, dtype=dtype, seed=seed)
            if "trt" in backends:
                from moedeploy.runtime.tensorrt import build_engine

                build_engine(artifact)
            report = compare(artifact, backends, iterations=iterations, seed=seed, layerwise=True)
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
    atomic_write_json(out / "summary.json", summary)
    atomic_write_text(out / "index.html", render_index(summary))
    return summary


def render_index(summary: dict[str, Any]) -> str:
    import jinja2

    template = resources.files("moedeploy.compare").joinpath("templates/index.html.j2").read_text()
    env = jinja2.Environment(autoescape=True, undefined=jinja2.ChainableUndefined)
    return env.from_string(template).render(s=summary)
