"""Export a block or the MoE decoder to an artifact directory, atomically.

Stages: build (seeded weights or a checkpoint) -> calibrate and fold BatchNorm -> cast to
the target dtype -> trace to ONNX (custom nodes + function bodies, full check) -> run eager
PyTorch on golden inputs -> write model, golden I/O and manifest into a temp folder that
replaces the target only when everything succeeded.
"""

from __future__ import annotations

import copy
import datetime
import importlib
import json
import math
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import onnx
import torch

import moedeploy
from moedeploy.export.artifact import (
    DERIVED_DIRS,
    DERIVED_FILES,
    MANIFEST,
    MODEL_DATA_FILE,
    MODEL_FILE,
    QUANTIZATION_DIGEST_KEY,
    REPORT_DIR,
    SCHEMA_VERSION,
    Artifact,
    ArtifactError,
    derived_strangers,
    first_manifest_problem,
    io_spec,
    parse_dtype,
    report_strangers,
    save_golden,
    save_model,
    seal_problem,
    sealed,
    section_digest,
    sha256,
    to_numpy,
)
from moedeploy.export.blocks import (
    DECODER_TOLERANCES,
    TOLERANCES,
    BlockSpec,
    DynamicRange,
    build_block,
    get_block,
)
from moedeploy.export.decoder import (
    DecoderWithPast,
    decoder_dynamic_ranges,
    decoder_feed,
    kv_cache_summary,
    past_names,
    past_shapes,
    present_names,
)
from moedeploy.export.fold import calibrate, fold_batchnorms, has_batchnorm
from moedeploy.export.onnx_export import OPSET, custom_op_counts, to_onnx
from moedeploy.export.quantize import (
    QuantizeError,
    block_size_problem,
    manifest_section,
    maybe_quantized,
    parse_scheme,
    surely_quantized,
)
from moedeploy.export.reference import build_decoder, eager_decoder, save_reference_weights
from moedeploy.export.streaming import (
    DATA_ALIGNMENT,
    quantize_weights,
    save_graph,
    trace_decoder,
    weight_summary,
    write_weights,
)
from moedeploy.export.tokenizer_files import copy_tokenizer
from moedeploy.models.blockquant import QuantScheme
from moedeploy.models.checkpoint import CheckpointWeights
from moedeploy.models.weights import ModuleWeights, WeightSource, fingerprint, finite_check
from moedeploy.names import DECODER, export_options_problem
from moedeploy.plugins import moe
from moedeploy.utils.io import (
    OutputRefused,
    atomic_directory,
    atomic_write_json,
    check_replaceable,
    few_names,
    require_free_space,
)
from moedeploy.utils.progress import size_text
from moedeploy.utils.versions import CORE

Progress = Callable[[str], None]
#: Room the golden I/O and manifest need besides the weights (Polygraphy JSON is base64, ~1.4x).
GOLDEN_BYTES_ALLOWANCE = 64 * 2**20


def _noop(_: str) -> None:
    pass


def library_versions() -> dict[str, str]:
    """The versions of the libraries this process runs (utils/versions.CORE), as a manifest records them."""
    return {"moedeploy": moedeploy.__version__,
            **{name: importlib.import_module(name).__version__ for name in CORE}}


def export(
    target: str,
    out: str | Path,
    *,
    preset_name: str | None = None,
    checkpoint: str | Path | None = None,
    dtype: str = "fp32",
    fold_bn: bool = True,
    calibration_batches: int = 8,
    seed: int = 0,
    force: bool = False,
    progress: Progress | None = None,
    max_seq_len: int | None = None,
    golden: bool = True,
    quantization: QuantScheme | None = None,
    mixed: bool = True,
    head_block_size: int | None = None,
) -> Artifact:
    """Export `target` (a block name or "decoder") to the artifact folder `out`.

    `out` is replaced only when it is absent, empty or an artifact moedeploy wrote; `force`
    replaces any other folder too. The decoder's shape comes from `preset_name` (default
    "tiny") or from `checkpoint`, never both: an option that would be ignored is refused.
    max_seq_len (decoder only): positions, cache plus new tokens, that the TensorRT profile in
    the manifest covers; default min(max_positions, 4096). quantization (decoder only): its
    Linear and expert weights weight-only int8/int4 (export/quantize.py); `mixed` (int4): the LM
    head and attention K/V at int8, as llama.cpp's q4_0; `head_block_size`: the LM head's block
    size (default: export/quantize.head_block).
    """
    parse_dtype(dtype)  # fail before any work
    if calibration_batches < 0:
        raise ValueError(f"--calibration-batches must be >= 0, got {calibration_batches}")
    if target != DECODER:
        get_block(target)
    if problem := export_options_problem(target, preset=preset_name, checkpoint=checkpoint is not None,
                                         max_seq_len=max_seq_len is not None, quantize=quantization is not None):
        raise ValueError(problem)
    if head_block_size is not None:
        if quantization is None:
            raise ValueError("--head-block-size applies with --quantize int8|int4 only")
        parse_scheme(quantization.name, head_block_size, quantization.symmetric, flag="--head-block-size")
    if checkpoint is not None:
        check_out_spares(out, checkpoint)
    check_artifact_out(out, force)
    if target == DECODER:
        return export_decoder(
            out, preset_name=preset_name or "tiny", checkpoint=checkpoint, dtype=dtype, seed=seed, force=force,
            progress=progress, max_seq_len=max_seq_len, golden=golden, quantization=quantization, mixed=mixed,
            head_block_size=head_block_size,
        )
    if not golden:
        raise ValueError("--no-golden applies to the decoder only")
    return export_block(
        target, out, dtype=dtype, fold_bn=fold_bn, calibration_batches=calibration_batches, seed=seed, force=force,
        progress=progress,
    )


def is_artifact_folder(path: Path) -> bool:
    """Whether `path` is an artifact moedeploy wrote (its manifest names a schema and a kind) and
    holds nothing else (`foreign_entries`), so export may replace it. Anything else in the way
    is the user's, and is refused."""
    manifest = artifact_manifest(path)
    return manifest is not None and seal_problem(manifest) is None and not foreign_entries(path, manifest)


def artifact_manifest(path: Path) -> dict | None:
    """The manifest of a folder moedeploy wrote as an artifact (a schema and a kind), else None."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and "schema_version" in manifest and "kind" in manifest else None


def foreign_entries(path: Path, manifest: dict) -> list[str]:
    """The names in an artifact folder that moedeploy did not put there: anything besides its
    manifest, the files the manifest lists (by their first path part: golden/, tokenizer/) and
    the folders moedeploy's commands write into an artifact (DERIVED_DIRS). Replacing the
    artifact would delete them, so an export refuses to."""
    files = manifest.get("files")
    listed = {rel for rel in files if isinstance(rel, str) and PurePosixPath(rel).parts} if isinstance(files, dict) else set()
    folders = {PurePosixPath(rel).parts[0] for rel in listed if len(PurePosixPath(rel).parts) > 1}
    ours = {MANIFEST, *DERIVED_DIRS, *(PurePosixPath(rel).parts[0] for rel in listed)}
    foreign = []
    try:
        for entry in sorted(Path(path).iterdir()):
            if entry.name not in ours:
                foreign.append(entry.name)
            elif entry.name in folders and entry.is_dir() and not entry.is_symlink():  # golden/, tokenizer/: file by file
                foreign += [rel for f in sorted(entry.rglob("*")) if f.is_file() and
                            (rel := f.relative_to(path).as_posix()) not in listed]
            elif entry.name == REPORT_DIR and entry.is_dir() and not entry.is_symlink():  # compare's files alone
                foreign += [f"{REPORT_DIR}/{name}" for name in report_strangers(entry)]
            elif entry.name in DERIVED_FILES and entry.is_dir() and not entry.is_symlink():  # cache/, engines/
                foreign += [f"{entry.name}/{name}" for name in derived_strangers(entry)]
    except OSError:
        return []
    return foreign


def check_out_spares(out: str | Path, checkpoint: str | Path) -> None:
    """Refuse an --out that is the checkpoint folder or holds it: replacing --out (which --force
    allows for any folder) would delete the weights the export reads, --force or not."""
    out_path, source = Path(out).resolve(), Path(checkpoint).resolve()
    if out_path == source or out_path in source.parents:
        where = "is the checkpoint folder" if out_path == source else f"holds the checkpoint folder {checkpoint}"
        raise OutputRefused(f"--out {out} {where}; an export replaces its --out and would delete the checkpoint it "
                            "reads: choose an --out outside the checkpoint")


def check_artifact_out(out: str | Path, force: bool) -> None:
    """`check_replaceable` for an export's --out, naming what in an old artifact is the user's."""
    manifest = artifact_manifest(Path(out)) if Path(out).is_dir() and not Path(out).is_symlink() else None
    if manifest is not None and not force:
        if not isinstance(manifest.get("files"), dict) or seal_problem(manifest):
            damage = "is damaged (its files list)" if not isinstance(manifest.get("files"), dict) else \
                "was edited after export or predates sealed manifests"
            raise OutputRefused(f"{out} holds an artifact whose manifest.json {damage}, so moedeploy cannot tell "
                                "its own files from yours; choose another --out, or pass --force to replace it")
        if foreign := foreign_entries(Path(out), manifest):
            raise OutputRefused(f"{out} is an artifact, but it also holds {few_names(foreign)}, which moedeploy did "
                                "not write and a new export would delete; move it out, choose another --out, or "
                                "pass --force")
    check_replaceable(out, is_artifact_folder, force)


def export_block(
    name: str,
    out: str | Path,
    *,
    dtype: str = "fp32",
    fold_bn: bool = True,
    calibration_batches: int = 8,
    seed: int = 0,
    force: bool = False,
    progress: Progress | None = None,
) -> Artifact:
    progress = progress or _noop
    spec: BlockSpec = get_block(name)
    torch_dtype = parse_dtype(dtype)
    generator = torch.Generator().manual_seed(seed + 1)

    progress(f"building {name} (seed {seed})")
    module = build_block(spec, seed)
    bn_report: dict[str, Any] | None = None
    if has_batchnorm(module):
        if calibration_batches:
            progress(f"calibrating BatchNorm EMA statistics on {calibration_batches} batches")
            calibrate(
                module,
                lambda _: (spec.make_inputs(4, 16, generator, torch.float32)[spec.input_name],),
                calibration_batches,
            )
        module.eval()
        if fold_bn:
            progress("folding BatchNorm into the preceding Linear / a per-channel scale and shift")
            reference = copy.deepcopy(module)  # golden outputs come from the unfolded model
            module, folding = fold_batchnorms(module)
            bn_report = folding.to_dict()
    module.eval().to(torch_dtype)
    reference = module if bn_report is None else reference.to(torch_dtype)

    progress("tracing to ONNX")
    example = spec.make_inputs(3, 7, generator, torch_dtype)  # sizes unlike any test or golden size
    model = to_onnx(
        module, (example[spec.input_name],), [spec.input_name], [spec.output_name],
        ({0: "batch", 1: "seq"},),
    )

    progress("running eager PyTorch on golden inputs")
    opt = spec.dynamic_ranges
    feed = spec.make_inputs(opt["batch"].opt, opt["seq"].opt, generator, torch_dtype)
    with torch.no_grad():
        y = reference(feed[spec.input_name])
    golden_in = [{k: to_numpy(v) for k, v in feed.items()}]
    golden_out = [{spec.output_name: to_numpy(y)}]

    atol, rtol = TOLERANCES[dtype]
    manifest = _manifest(
        name=name, kind="block", dtype=dtype, model=model, seed=seed,
        config={"block": name, "summary": spec.summary, "batchnorm_folding": bn_report},
        dynamic_ranges=spec.dynamic_ranges,
        tolerances={spec.output_name: {"atol": atol, "rtol": rtol}},
    )
    return _write(out, model, manifest, golden_in, golden_out, progress, reference, force=force)


def export_decoder(
    out: str | Path,
    *,
    preset_name: str = "tiny",
    checkpoint: str | Path | None = None,
    dtype: str = "fp32",
    seed: int = 0,
    force: bool = False,
    progress: Progress | None = None,
    max_seq_len: int | None = None,
    golden: bool = True,
    quantization: QuantScheme | None = None,
    mixed: bool = True,
    head_block_size: int | None = None,
) -> Artifact:
    """The decoder with its KV cache; its TensorRT profile spans max_seq_len positions (see
    `decoder_dynamic_ranges`), while the manifest's config keeps the model's max_positions.

    The weights are streamed (export/streaming.py): the graph is traced over empty tensors
    and each weight goes from the checkpoint's shards to model.onnx.data on its own, so
    memory does not grow with the model. Golden outputs come from the eager model run one
    layer at a time over the checkpoint; `golden=False` skips them (and that pass). With
    `quantization`, the golden outputs are the eager model's on the dequantized weights: what
    the artifact computes, checked by `compare` with the usual tolerances.
    """
    progress = progress or _noop
    torch_dtype = parse_dtype(dtype)
    if checkpoint is not None:
        progress(f"reading checkpoint {checkpoint}")
        weights: WeightSource = CheckpointWeights(checkpoint)
        source: dict[str, Any] = {"checkpoint": str(Path(checkpoint).resolve())}
    else:
        progress(f"building the {preset_name!r} decoder with random weights (seed {seed})")
        weights = ModuleWeights(build_decoder(preset_name, None, seed, torch_dtype))
        source = {"preset": preset_name}
    config = weights.config
    dynamic_ranges = decoder_dynamic_ranges(config.max_positions, max_seq_len)  # a bad max_seq_len fails here
    n = config.n_layers
    weight_bytes = sum(math.prod(weights.shape(name)) for name in weights.names()) * torch_dtype.itemsize
    padding = len(weights.names()) * 2 * DATA_ALIGNMENT  # each initializer starts aligned (a few are stored twice)
    require_free_space(out, weight_bytes + padding + GOLDEN_BYTES_ALLOWANCE)  # before minutes of work, not after

    if quantization is not None and (problem := block_size_problem(surely_quantized(weights), quantization, mixed,
                                                                   head_block_size, maybe_quantized(weights))):
        raise QuantizeError(problem)  # before the trace, not after it
    progress("tracing the decoder with its KV cache to ONNX (over empty weights)")
    traced = trace_decoder(config, torch_dtype, weights.names())
    source["weights_sha256"] = fingerprint(weights, torch_dtype, progress, inspect=finite_check(weights))
    quantized: dict[str, Any] | None = None
    if quantization is not None:
        progress(f"quantizing the Linear and expert weights to {quantization.name} in blocks of {quantization.block_size}"
                 + (f" (the LM head's: {head_block_size})" if head_block_size is not None else ""))
        counts = quantize_weights(traced, weights, quantization, mixed, head_block_size)
        quantized = manifest_section(quantization, mixed, counts, traced.quantization)

    golden_out = None
    generator = torch.Generator().manual_seed(seed + 1)
    if golden:
        # the in-memory model of a preset, or the checkpoint's model run one layer at a time (its
        # weights read per layer, so memory stays one layer's); dequantized as the artifact reads them
        module = weights.module if isinstance(weights, ModuleWeights) else None
        reference = eager_decoder(weights, {"quantization": quantized}, torch_dtype, module, progress)
        eager = "running eager PyTorch on them" + ("" if checkpoint is None else ", one layer at a time")
        progress(f"making golden inputs and {eager}")
        ids, past = decoder_feed(reference, batch=2, past_len=6, seq=4, generator=generator)  # a real KV cache
        with torch.no_grad():
            logits, present = DecoderWithPast(reference).eval()(ids, past)
        outputs = {"logits": logits, **dict(zip(present_names(n), [t for kv in present for t in kv], strict=True))}
        golden_out = [{k: to_numpy(v) for k, v in outputs.items()}]
        del reference
    else:  # no pass over the weights at all: a random KV cache (attention is defined for any)
        ids = torch.randint(0, config.vocab_size, (2, 4), generator=generator)
        k, v = past_shapes(config, batch=2, past_len=6)
        past = [(torch.randn(k, generator=generator).to(torch_dtype), torch.randn(v, generator=generator).to(torch_dtype))
                for _ in range(n)]
    feed = {"input_ids": ids, **dict(zip(past_names(n), [t for kv in past for t in kv], strict=True))}
    golden_in = [{k: to_numpy(v) for k, v in feed.items()}]

    tokenizer: dict[str, Any] = {}

    def write_model(folder: Path) -> tuple[onnx.ModelProto, list[str]]:
        on_the_way = "" if quantization is None else f", quantized to {quantization.name} on the way"
        progress(f"streaming {size_text(weight_bytes)} of {dtype} weights into {MODEL_DATA_FILE}{on_the_way}")
        write_weights(traced, weights, torch_dtype, folder / MODEL_DATA_FILE, progress)
        progress("checking the graph with the ONNX checker")
        digest = {QUANTIZATION_DIGEST_KEY: section_digest(quantized)} if quantized is not None else None
        model = save_graph(traced, folder / MODEL_FILE, digest)
        files = [MODEL_FILE, MODEL_DATA_FILE]
        if checkpoint is not None:  # text in and out on the server: the checkpoint's own tokenizer
            summary, copied = copy_tokenizer(Path(checkpoint), folder)
            if summary is not None:
                progress(f"copying the tokenizer ({', '.join(summary['files'])})")
                tokenizer.update(summary)
                files += copied
        return model, files

    atol, rtol = DECODER_TOLERANCES[dtype]

    def manifest_for(model: onnx.ModelProto) -> dict[str, Any]:
        manifest = _manifest(
            name=DECODER, kind="decoder", dtype=dtype, model=model, seed=seed,
            config={**config.to_dict(), "source": source},
            dynamic_ranges=dynamic_ranges,
            tolerances={name: {"atol": atol, "rtol": rtol} for name in ["logits", *present_names(n)]},
        )
        manifest["max_seq_len"] = dynamic_ranges["seq"].max + dynamic_ranges["past_seq"].max
        manifest["kv_cache"] = kv_cache_summary(config, torch_dtype.itemsize)
        manifest["golden_outputs"] = golden
        manifest["weights_layout"] = weight_summary(traced)
        if quantized is not None:
            manifest["quantization"] = quantized
        if tokenizer:
            manifest["tokenizer"] = tokenizer
        return manifest

    return _write_artifact(out, write_model, manifest_for, golden_in, golden_out, progress, force=force)


def _manifest(
    *, name: str, kind: str, dtype: str, model: onnx.ModelProto, seed: int, config: dict[str, Any],
    dynamic_ranges: dict[str, DynamicRange], tolerances: dict[str, dict[str, float]],
) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "kind": kind,
        "dtype": dtype,
        "opset": OPSET,
        "custom_ops": [
            {"domain": d, "op_type": t, "version": moe.VERSION, "count": c, "plugin_namespace": d}
            for (d, t), c in sorted(custom_op_counts(model).items())
        ],
        "inputs": io_spec(model.graph.input),
        "outputs": io_spec(model.graph.output),
        "dynamic_ranges": {k: r.to_dict() for k, r in dynamic_ranges.items()},
        "tolerances": tolerances,
        "config": config,
        "seed": seed,
        "versions": library_versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "files": {},
    }


def _write(
    out: str | Path, model: onnx.ModelProto, manifest: dict[str, Any],
    golden_in: list[dict[str, np.ndarray]], golden_out: list[dict[str, np.ndarray]], progress: Progress,
    reference: torch.nn.Module | None = None,
    *,
    force: bool = False,
) -> Artifact:
    """Write an artifact whose graph is in memory (the blocks: a few MB at most)."""
    require_free_space(out, model.ByteSize() + GOLDEN_BYTES_ALLOWANCE)

    def write_model(folder: Path) -> tuple[onnx.ModelProto, list[str]]:
        files = save_model(model, folder)
        if reference is not None:
            files += save_reference_weights(reference, folder)
        return model, files

    return _write_artifact(out, write_model, lambda _: manifest, golden_in, golden_out, progress, force=force)


def _write_artifact(
    out: str | Path,
    write_model: Callable[[Path], tuple[onnx.ModelProto, list[str]]],
    manifest_for: Callable[[onnx.ModelProto], dict[str, Any]],
    golden_in: list[dict[str, np.ndarray]], golden_out: list[dict[str, np.ndarray]] | None, progress: Progress,
    *,
    force: bool = False,
) -> Artifact:
    """Model, golden I/O and manifest into a temp folder that replaces `out` only when all succeeded."""
    out = Path(out)
    progress(f"writing the artifact to {out}")
    with atomic_directory(out, owned=is_artifact_folder, force=force) as tmp:
        model, files = write_model(tmp)
        manifest = manifest_for(model)
        _check_dim_names(manifest)
        files += save_golden(tmp, golden_in, golden_out)
        progress("hashing the artifact's files")
        manifest["files"] = {rel: sha256(tmp / rel) for rel in files}
        manifest = sealed(manifest)
        # what Artifact.load will refuse is refused here, before the folder replaces `out`: a
        # manifest its own check fails left an unusable artifact in place of a good one
        if problem := first_manifest_problem(manifest):
            raise ArtifactError(f"the export made a manifest its own check refuses ({problem}); {out} is as it was")
        atomic_write_json(tmp / MANIFEST, manifest)
    return Artifact.load(out)


def _check_dim_names(manifest: dict[str, Any]) -> None:
    """Every symbolic input dim must have a range (TensorRT profiles need all of them)."""
    names = {
        d for i in manifest["inputs"] for d in i["shape"] if isinstance(d, str) and re.fullmatch(r"\w+", d)
    }
    missing = names - set(manifest["dynamic_ranges"])
    if missing:
        raise RuntimeError(f"dynamic dims without a range: {sorted(missing)}")
