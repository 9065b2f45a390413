"""`compare`: run every backend and eager PyTorch on the same seeded inputs, judge, report.

Polygraphy's Comparator runs the runners and its simple compare function judges each
output with per-output tolerances; its RunResults and AccuracyResults are saved as they
are, so Polygraphy's own tools read them. On top we compute the statistics of report.json
and, on request or on failure, localise the first divergent layer.
"""

from __future__ import annotations

import contextlib
import datetime
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from moedeploy import names
from moedeploy.compare.all_checks import not_runnable_here
from moedeploy.compare.data import ArtifactDataLoader
from moedeploy.compare.inflight import BACKEND as INFLIGHT
from moedeploy.compare.inflight import inflight_accuracy
from moedeploy.compare.layerwise import localize
from moedeploy.compare.metrics import error_stats
from moedeploy.compare.quantization import quantization_accuracy
from moedeploy.compare.report import render_html, render_markdown
from moedeploy.export.artifact import (
    REPORT_DIR,
    Artifact,
    ArtifactError,
    parse_dtype,
    quiet_polygraphy,
    report_strangers,
)
from moedeploy.export.blocks import TOLERANCES
from moedeploy.export.exporter import library_versions
from moedeploy.export.reference import check_same_config, eager_decoder, load_reference, unquantized
from moedeploy.models.checkpoint import CheckpointWeights
from moedeploy.models.weights import fingerprint
from moedeploy.runtime.ort import SessionError
from moedeploy.runtime.runners import (
    BACKENDS,
    DECODER_ONLY,
    ORT_LOWERINGS,
    TorchRunner,
    lowering_text,
    make_runner,
)
from moedeploy.utils.io import (
    OutputRefused,
    atomic_directory,
    atomic_write_json,
    atomic_write_text,
    few_names,
    new_folder_problem,
)

RUN_RESULTS = "run_results.json"
#: run_results.json keeps the first iterations whose outputs (all runners) fit in this many
#: bytes: every iteration of a small model, not hundreds of MB of logits of a large one.
RUN_RESULTS_BUDGET = 32 * 2**20
ACCURACY = "accuracy.json"

Progress = Callable[[str], None]
#: What the first localised comparison tells report.json about where outputs start to diverge.
LAYERWISE_KEYS = ("first_divergent_layer", "first_divergent_module", "first_divergent_routing_flips",
                  "first_divergent_routing_modules")


#: what `compare --backend` takes: every runner but the reference, and the in-flight batching check
COMPARE_BACKENDS = (*BACKENDS, INFLIGHT)
names.check_same_names("compare backends", COMPARE_BACKENDS, names.COMPARE_BACKENDS)
names.check_same_names("decoder-only backends", (*DECODER_ONLY, INFLIGHT), names.DECODER_ONLY_BACKENDS)


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


def eager_reference(artifact: Artifact, checkpoint: str | Path | None = None, dequantized: bool = True) -> nn.Module:
    """The eager PyTorch module to compare with, built once for the runner and the layer-wise pass.

    `checkpoint` points a decoder exported from a checkpoint at the folder's new place. Its
    weights must have the fingerprint recorded at export (manifest `weights_sha256`): a
    reference built from other weights would make every verdict meaningless. `dequantized`:
    a quantized decoder's eager model on its dequantized weights (what its graph computes), or
    on the float weights it was quantized from.
    """
    source = artifact.manifest["config"].get("source", {}) if artifact.kind == "decoder" else {}
    recorded = source.get("checkpoint")
    if checkpoint is None:
        if recorded is not None and not Path(recorded).is_dir():
            raise ArtifactError(
                f"{artifact.path} was exported from checkpoint {recorded}, which is gone; "
                "pass --checkpoint DIR with the folder's new place"
            )
        return load_reference(artifact, dequantized)
    if recorded is None:
        made_from = f"the {source['preset']!r} preset" if source.get("preset") else f"a {artifact.kind} with stored weights"
        raise ArtifactError(f"--checkpoint is for decoders exported from a checkpoint; {artifact.path} was made from {made_from}")
    return _verified_checkpoint_reference(artifact, Path(checkpoint), source.get("weights_sha256"), dequantized)


def _verified_checkpoint_reference(artifact: Artifact, checkpoint: Path, expected: str | None,
                                   dequantized: bool) -> nn.Module:
    """The decoder in `checkpoint`, refused unless its weights are the ones the artifact was exported from."""
    from moedeploy.export.decoder import DecoderWithPast

    if not expected:
        raise ArtifactError(
            f"{artifact.path} records no weights fingerprint (weights_sha256), so --checkpoint {checkpoint} "
            "cannot be checked against it; re-export the artifact"
        )
    if not checkpoint.is_dir():
        raise ArtifactError(f"--checkpoint {checkpoint} is not a folder")
    dtype = parse_dtype(artifact.dtype)
    weights = CheckpointWeights(checkpoint)
    check_same_config(artifact, weights.config, checkpoint)
    if fingerprint(weights, dtype) != expected:
        raise ArtifactError(
            f"--checkpoint {checkpoint} holds other weights than {artifact.path} was exported from "
            "(its weights_sha256 fingerprint differs); pass the checkpoint the artifact was made from"
        )
    manifest = artifact.manifest if dequantized else unquantized(artifact.manifest)
    return DecoderWithPast(eager_decoder(weights, manifest, dtype)).eval()


def handed_out_once(first: nn.Module, rebuild: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """A module loader that returns `first` once, then rebuilds.

    The reference is built before any run, so a bad checkpoint fails up front; handing it
    over (and forgetting it) lets the runner free it on deactivation, so the eager model never
    sits in memory beside ONNX Runtime's copy of the weights.
    """
    pending = [first]

    def load() -> nn.Module:
        return pending.pop() if pending else rebuild()

    return load


@contextlib.contextmanager
def polygraphy_silenced() -> Iterator[None]:
    """Polygraphy's own log off: its `[E] FAILED` lines repeat moedeploy's table, and its first
    printed line is a hint to install `colored`. Its errors still reach the user: Polygraphy
    raises them, and moedeploy reports them."""
    from polygraphy.logger import G_LOGGER

    colors = G_LOGGER.colors
    G_LOGGER.colors = False  # the `colored` hint is printed when a coloured line is first logged
    try:
        with G_LOGGER.verbosity(G_LOGGER.CRITICAL + 1):
            yield
    finally:
        G_LOGGER.colors = colors


def compare(
    artifact: Artifact | str | Path,
    backends: list[str] | tuple[str, ...] = ("ort",),
    atol: float | None = None,
    rtol: float | None = None,
    iterations: int = 4,
    seed: int = 0,
    layerwise: bool = False,
    progress: Progress | None = None,
    checkpoint: str | Path | None = None,
    quantization_thresholds: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Compare each backend with eager PyTorch; writes <artifact>/report/ and returns report.json's dict.

    `checkpoint`: where a decoder's checkpoint is now, when it moved since export (verified
    against the weights fingerprint in the manifest). A quantized decoder is also measured
    against its unquantized eager model (compare/quantization.py) and judged by thresholds
    (kl_mean, top1; `quantization_thresholds` overrides the defaults by bit width).
    """
    from polygraphy.comparator import Comparator, SimpleCompareFunc

    progress = progress or (lambda _: None)
    artifact = artifact if isinstance(artifact, Artifact) else Artifact.load(artifact)
    unknown = [b for b in backends if b not in COMPARE_BACKENDS or b == "torch"]
    if unknown:
        raise ValueError(f"unknown backend {unknown[0]!r} for --backend; choose from {', '.join(COMPARE_BACKENDS[1:])}")
    if artifact.kind != "decoder" and (decoder_only := [b for b in backends if b in names.DECODER_ONLY_BACKENDS]):
        raise ValueError(f"--backend {decoder_only[0]} lowers a decoder's attention or residual norms; "
                         f"{artifact.path} holds a {artifact.kind!r}: compare it with ort, ort-contrib or trt")
    if any(t is not None and not (math.isfinite(t) and t >= 0) for t in (atol, rtol)):
        raise ValueError(f"--atol and --rtol must be finite numbers >= 0; got {atol} and {rtol} (NaN fails every "
                         "output, infinity passes any)")
    check_report_folder(artifact.path / REPORT_DIR)  # before the minutes of work, not after
    quantized = artifact.kind == "decoder" and bool(artifact.manifest.get("quantization"))
    if quantization_thresholds and not quantized:
        raise ValueError(f"--max-kl-mean and --min-top1 judge a quantized decoder against its float model; "
                         f"{artifact.path} is not quantized (compare it without them)")
    if quantized and not any(b in ORT_LOWERINGS for b in backends):  # else its accuracy would pass unmeasured
        raise ValueError(f"--backend {','.join(backends)} cannot measure a quantized decoder's accuracy against its "
                         f"float model (KL, top-1, greedy tokens): add one of {', '.join(ORT_LOWERINGS)}, "
                         f"e.g. --backend ort,{','.join(backends)}")
    unsigned = quantized and artifact.manifest["quantization"].get("symmetric") is False
    if reason := not_runnable_here(artifact.dtype, backends, unsigned_codes=unsigned):
        raise SessionError(f"cannot compare {artifact.path} ({artifact.dtype}): {reason}")
    if "trt" in backends:  # TensorRT, a GPU and this artifact's plan, before any other backend writes its cache
        from moedeploy.runtime.tensorrt import find_engine

        find_engine(artifact)
    quiet_polygraphy()
    tolerances = resolve_tolerances(artifact, atol, rtol)
    loader = ArtifactDataLoader(artifact, iterations, seed)

    def rebuild() -> nn.Module:
        return eager_reference(artifact, checkpoint)

    progress("building the eager PyTorch reference")
    reference = TorchRunner(artifact, module_loader=handed_out_once(rebuild(), rebuild))  # checked before any run
    runners = [reference] + [make_runner(b, artifact) for b in backends if b != INFLIGHT]

    progress(f"running {', '.join(r.name for r in runners)} on {iterations} seeded inputs")
    compare_func = SimpleCompareFunc(
        atol={k: v[0] for k, v in tolerances.items()},
        rtol={k: v[1] for k, v in tolerances.items()},
        check_error_stat="elemwise",
    )
    with polygraphy_silenced():
        run_results = Comparator.run(runners, data_loader=loader)
        # every backend against the eager reference (Polygraphy's default compares neighbours:
        # with two backends the second would be checked against the first, not against eager)
        accuracy = Comparator.compare_accuracy(run_results, compare_func=compare_func,
                                               comparisons=[(0, i) for i in range(1, len(runners))])

    results_by_runner = dict(run_results.items())
    comparisons = []
    for runner in runners[1:]:
        comparisons.append(_comparison(reference.name, runner.name, results_by_runner, tolerances, accuracy))
        if (path := lowering_text(getattr(runner, "lowering", {}))) is not None:
            comparisons[-1]["path"] = path  # which lowering ran: the fast path or the function body
    passed = all(c["passed"] for c in comparisons)

    report: dict[str, Any] = {
        "artifact": {k: artifact.manifest[k] for k in ("name", "kind", "dtype", "opset")},
        "reference": reference.name,
        "reference_checkpoint": str(Path(checkpoint).resolve()) if checkpoint is not None else None,
        "backends": list(backends),
        "iterations": iterations,
        "seed": seed,
        "passed": passed,
        "comparisons": comparisons,
        "first_divergent_layer": None,
        "first_divergent_module": None,
        "first_divergent_routing_flips": None,
        "first_divergent_routing_modules": None,
        "polygraphy": {"run_results": RUN_RESULTS, "accuracy": ACCURACY},
        "run_results_iterations": None,
        "versions": library_versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    feed = loader[0]
    for comparison in comparisons:
        if comparison["backend"] != "onnxrt" or not (layerwise or not comparison["passed"]):
            continue
        progress(f"localising the first divergent layer on {comparison['backend']}")
        atol0, rtol0 = next(iter(tolerances.values()))
        comparison["layerwise"] = localize(artifact, feed, atol0, rtol0, reference=rebuild())
        if report["first_divergent_layer"] is None:
            for key in LAYERWISE_KEYS:
                report[key] = comparison["layerwise"][key]

    report["inflight"] = None
    if INFLIGHT in backends:
        progress("decoding sequences of different lengths together on ONNX Runtime's row cache (in-flight batching)")
        report["inflight"] = inflight_accuracy(artifact, rebuild(), *tolerances["logits"], seed=seed)
        report["passed"] = report["passed"] and report["inflight"]["passed"]

    report["quantization"] = None
    if artifact.kind == "decoder" and artifact.manifest.get("quantization"):
        report["quantization"] = quantization_accuracy(
            artifact, list(backends), lambda: eager_reference(artifact, checkpoint, dequantized=False),
            seed=seed, thresholds=quantization_thresholds, progress=progress,
        )
        report["passed"] = report["passed"] and report["quantization"]["passed"]

    progress(f"writing the report to {artifact.path / REPORT_DIR}")
    # report/ is the artifact's own subfolder, replaced on every run; anything else there is refused
    with atomic_directory(artifact.path / REPORT_DIR, owned=report_folder_is_ours) as tmp, \
            polygraphy_silenced():
        kept = saved_iterations(run_results, RUN_RESULTS_BUDGET)
        report["run_results_iterations"] = kept
        first_iterations(run_results, kept).save(str(tmp / RUN_RESULTS))
        accuracy.save(str(tmp / ACCURACY))
        atomic_write_json(tmp / "report.json", strict_json(report))
        atomic_write_text(tmp / "report.md", render_markdown(report))
        atomic_write_text(tmp / "report.html", render_html(report, _values(results_by_runner, reference.name)))
    return report




def report_folder_is_ours(folder: Path) -> bool:
    """A report folder compare wrote and nobody added to: report.json, and only REPORT_FILES."""
    return (folder / "report.json").is_file() and not report_strangers(folder)


def check_report_folder(folder: Path) -> None:
    """compare replaces report/ whole on every run: refuse, before any work, when it holds
    anything compare did not write, which replacing would delete."""
    if problem := new_folder_problem(folder.parent):  # the report is written last (a temp folder beside it)
        raise OutputRefused(f"compare writes its report into {folder}, but {problem}; make the artifact writable, or "
                            "copy it somewhere writable")
    if not folder.exists() and not folder.is_symlink():
        return
    if not folder.is_dir() or folder.is_symlink():
        raise OutputRefused(f"{folder} is not the report folder compare writes; move it away: compare writes its "
                            f"report there")
    if any(folder.iterdir()) and not report_folder_is_ours(folder):
        strangers = report_strangers(folder) or ["no report.json"]
        raise OutputRefused(f"{folder} holds {few_names(strangers)}, which compare did not write; compare replaces "
                            f"{REPORT_DIR}/ whole on every run: move them out of it first")


def saved_iterations(run_results, budget: int) -> int:
    """How many leading iterations of every runner fit in `budget` bytes of outputs."""
    per_iteration = [0] * min(len(iters) for _, iters in run_results.items())
    for _, iters in run_results.items():
        for i in range(len(per_iteration)):
            per_iteration[i] += sum(np.asarray(v).nbytes for v in iters[i].values())
    total, kept = 0, 0
    for size in per_iteration:
        total += size
        if total > budget:
            break
        kept += 1
    return kept


def first_iterations(run_results, count: int):
    """A RunResults with each runner's first `count` iterations (Polygraphy reads it as usual)."""
    from polygraphy.comparator import RunResults

    trimmed = RunResults()
    for name, iters in run_results.items():
        trimmed.append((name, list(iters)[:count]))
    return trimmed


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


def _values(results, ref_name: str) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Backend -> output -> (eager, backend) values over every iteration, for the histograms
    (an element's tolerance depends on its eager value, so the plots need both)."""
    values = {}
    for name, iters in results.items():
        if name == ref_name:
            continue
        values[name] = {
            output: (_concat(results, ref_name, output), _concat(results, name, output))
            for output in iters[0]
            if all(r[output].shape == a[output].shape for r, a in zip(results[ref_name], iters, strict=True))
        }
    return values
