"""`compare`: run every backend and eager PyTorch on the same seeded inputs, judge, report.

Polygraphy's Comparator runs the runners and its simple compare function judges each
output with per-output tolerances; its RunResults and AccuracyResults are saved as they
are, so Polygraphy's own tools read them. On top we compute the statistics of report.json
and, on request or on failure, localise the first divergent layer.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from moedeploy.compare.data import ArtifactDataLoader
from moedeploy.compare.layerwise import localize
from moedeploy.compare.metrics import error_stats
from moedeploy.compare.report import render_html, render_markdown
from moedeploy.export.artifact import Artifact, quiet_polygraphy
from moedeploy.export.blocks import TOLERANCES
from moedeploy.export.exporter import library_versions
from moedeploy.runtime.runners import BACKENDS, TorchRunner, make_runner
from moedeploy.utils.io import atomic_directory, atomic_write_json, atomic_write_text

REPORT_DIR = "report"
RUN_RESULTS = "run_results.json"
ACCURACY = "accuracy.json"

Progress = Callable[[str], None]


def resolve_tolerances(artifact: Artifact, atol: float | None, rtol: float | None) -> dict[str, tuple[float, float]]:
    """Per-output (atol, rtol): the manifest's, else the dtype default; CLI values override all."""
    default = TOLERANCES[artifact.dtype]
    declared = artifact.manifest.get("tolerances", {})
    result = {}
    for name in artifact.output_names():
        t = declared.get(name, {})
        result[name] = (
            atol if atol is not None else t.get("atol", default[0]),
            rtol if rtol is not None else t.get("rtol", default[1]),
        )
    return result


def compare(
    artifact: Artifact | str | Path,
    backends: list[str] | tuple[str, ...] = ("ort",),
    atol: float | None = None,
    rtol: float | None = None,
    iterations: int = 4,
    seed: int = 0,
    layerwise: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Compare each backend with eager PyTorch; writes <artifact>/report/ and returns report.json's dict."""
    from polygraphy.comparator import Comparator, SimpleCompareFunc

    progress = progress or (lambda _: None)
    artifact = artifact if isinstance(artifact, Artifact) else Artifact.load(artifact)
    unknown = [b for b in backends if b not in BACKENDS or b == "torch"]
    if unknown:
        raise ValueError(f"unknown backend {unknown[0]!r} for --backend; choose from ort, trt")
    if (atol is not None and atol < 0) or (rtol is not None and rtol < 0):
        raise ValueError("--atol and --rtol must be >= 0")
    quiet_polygraphy()
    tolerances = resolve_tolerances(artifact, atol, rtol)
    loader = ArtifactDataLoader(artifact, iterations, seed)
    reference = TorchRunner(artifact)
    runners = [reference] + [make_runner(b, artifact) for b in backends]

    progress(f"running {', '.join(r.name for r in runners)} on {iterations} seeded inputs")
    run_results = Comparator.run(runners, data_loader=loader)
    compare_func = SimpleCompareFunc(
        atol={k: v[0] for k, v in tolerances.items()},
        rtol={k: v[1] for k, v in tolerances.items()},
        check_error_stat="elemwise",
    )
    accuracy = Comparator.compare_accuracy(run_results, compare_func=compare_func)

    results_by_runner = dict(run_results.items())
    comparisons = []
    for runner in runners[1:]:
        comparisons.append(_comparison(reference.name, runner.name, results_by_runner, tolerances, accuracy))
    passed = all(c["passed"] for c in comparisons)

    report: dict[str, Any] = {
        "artifact": {k: artifact.manifest[k] for k in ("name", "kind", "dtype", "opset")},
        "reference": reference.name,
        "backends": list(backends),
        "iterations": iterations,
        "seed": seed,
        "passed": passed,
        "comparisons": comparisons,
        "first_divergent_layer": None,
        "first_divergent_module": None,
        "first_divergent_routing_flips": None,
        "polygraphy": {"run_results": RUN_RESULTS, "accuracy": ACCURACY},
        "versions": library_versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    feed = loader[0]
    for comparison in comparisons:
        if comparison["backend"] != "onnxrt" or not (layerwise or not comparison["passed"]):
            continue
        progress(f"localising the first divergent layer on {comparison['backend']}")
        atol0, rtol0 = next(iter(tolerances.values()))
        comparison["layerwise"] = localize(artifact, feed, atol0, rtol0)
        if report["first_divergent_layer"] is None:
            report["first_divergent_layer"] = comparison["layerwise"]["first_divergent_layer"]
            report["first_divergent_module"] = comparison["layerwise"]["first_divergent_module"]
            report["first_divergent_routing_flips"] = comparison["layerwise"]["first_divergent_routing_flips"]

    progress(f"writing the report to {artifact.path / REPORT_DIR}")
    # report/ is the artifact's own subfolder, replaced on every run; anything else there is refused
    with atomic_directory(artifact.path / REPORT_DIR, owned=lambda p: (p / "report.json").is_file()) as tmp:
        run_results.save(str(tmp / RUN_RESULTS))
        accuracy.save(str(tmp / ACCURACY))
        atomic_write_json(tmp / "report.json", strict_json(report))
        atomic_write_text(tmp / "report.md", render_markdown(report))
        atomic_write_text(tmp / "report.html", render_html(report, _errors(results_by_runner, reference.name)))
    return report


def strict_json(obj: Any) -> Any:
    """NaN and Inf are not JSON (RFC 8259): write them as null, so every parser reads the report."""
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [strict_json(v) for v in obj]
    return obj


def _concat(results, runner: str, output: str) -> np.ndarray:
    return np.concatenate([np.asarray(it[output], dtype=np.float64).ravel() for it in results[runner]])


def _comparison(ref_name: str, name: str, results, tolerances, accuracy) -> dict[str, Any]:
    outputs = {}
    pairs = {tuple(pair): iters for result in accuracy for pair, iters in result.items()}
    poly = pairs.get((ref_name, name), [])
    for output, (atol, rtol) in tolerances.items():
        ref_iters = [it[output] for it in results[ref_name]]
        act_iters = [it[output] for it in results[name]]
        if any(r.shape != a.shape for r, a in zip(ref_iters, act_iters, strict=True)):
            stats: dict[str, Any] = {"shape_mismatch": True, "passed": False, "atol": atol, "rtol": rtol}
        else:
            stats = error_stats(_concat(results, ref_name, output), _concat(results, name, output), atol, rtol)
        stats["polygraphy_passed"] = bool(poly) and all(bool(it[output]) for it in poly if output in it)
        stats["passed"] = bool(stats["passed"] and stats["polygraphy_passed"])
        outputs[output] = stats
    return {
        "reference": ref_name,
        "backend": name,
        "passed": all(s["passed"] for s in outputs.values()),
        "outputs": outputs,
        "layerwise": None,
    }


def _errors(results, ref_name: str) -> dict[str, dict[str, np.ndarray]]:
    """Backend -> output -> elementwise error, for the histograms."""
    errors = {}
    for name, iters in results.items():
        if name == ref_name:
            continue
        errors[name] = {
            output: _concat(results, name, output) - _concat(results, ref_name, output)
            for output in iters[0]
        }
    return errors
