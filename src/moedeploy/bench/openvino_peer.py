"""OpenVINO as a peer engine: the artifact's own graph on OpenVINO's CPU plugin, the KV cache
kept inside the compiled model as state, the way optimum-intel runs a decoder.

What optimum-intel does to a transformers model is done here to the artifact, so both engines
read the same weights: OpenVINO's ONNX frontend reads the graph as `ort` runs it (the MoE on
the per-expert lowering, standard ONNX ops only; the LM head on the last position), every
past/present pair becomes a state variable (`apply_make_stateful_transformation`, as in
optimum-intel's stateful export) whose initial value is an empty cache of the step's batch,
and the model is compiled with f32 inference precision: on a CPU with bf16 instructions
OpenVINO would otherwise compute in bf16, and this is the fp32 comparison.

OpenVINO's int8/int4 are its own weight compression, NNCF's `compress_weights` (what
optimum-intel's `--weight-format int8|int4` runs), applied to that same stateful model and
saved once as OpenVINO IR in bench's cache (`compressed_ir`), as llama.cpp's q8_0/q4_0 are
made from its f32 GGUF. NNCF compresses the MatMuls of the graph it is given and not those
inside an If's branches, where the per-expert lowering keeps each expert's weights, so every
branch is compressed as a graph of its own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from moedeploy.export.artifact import MODEL_DATA_FILE, MODEL_FILE, Artifact
from moedeploy.models.blockquant import QuantScheme

if TYPE_CHECKING:
    from moedeploy.bench.decode import Stepper

#: the compile options of the fp32 comparison (OpenVINO's CPU plugin properties)
COMPILE_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}


def read_lowered(artifact: Artifact):
    """The artifact's lowered graph as an openvino.Model.

    OpenVINO's ONNX frontend reads external weights only from the model file's own folder (a
    symbolic link out of it is refused), so the lowered graph is written, for the moment of
    reading, into a temporary folder of the artifact's cache with a hard link to the weights
    (no copy); the folder is removed before this returns.
    """
    import openvino as ov

    from moedeploy.runtime.lowering import LoweringError
    from moedeploy.runtime.ort import CACHE_DIR, CPU, cache_link_problem, lowered_model

    try:
        graph, _ = lowered_model(artifact, CPU, "experts", logits="last")
    except LoweringError as e:
        raise ValueError(f"backend 'openvino' runs the graph with every MoE on standard ops (the per-expert "
                         f"lowering): {e}") from None
    if not isinstance(graph, bytes):  # a block: its weights are inside the file
        return ov.Core().read_model(graph)
    cache = artifact.path / CACHE_DIR
    if problem := cache_link_problem(cache):
        raise ValueError(f"OpenVINO reads the graph beside its weights, in {cache}: {problem}")
    try:
        cache.mkdir(exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="openvino-", dir=cache))
    except OSError as e:
        raise ValueError(f"OpenVINO reads the graph beside its weights, in {cache}, which cannot be written "
                         f"({e.strerror}); copy the artifact to a writable folder") from e
    try:
        (folder / MODEL_FILE).write_bytes(graph)
        try:
            os.link(artifact.path / MODEL_DATA_FILE, folder / MODEL_DATA_FILE)
        except OSError as e:
            raise ValueError(f"OpenVINO reads the weights from the graph's folder and {folder} cannot hard-link "
                             f"{MODEL_DATA_FILE} ({e.strerror}); copy the artifact to a local disk") from e
        return ov.Core().read_model(str(folder / MODEL_FILE))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def make_stateful(model, past_names: list[str]) -> None:
    """Keep the KV cache inside the model: each past input and its present output become one
    state variable, initialised to an empty cache (batch of the step's input_ids, 0 positions)."""
    import openvino.opset13 as ops
    from openvino._offline_transformations import apply_make_stateful_transformation

    apply_make_stateful_transformation(model, {p: "present." + p.removeprefix("past_key_values.") for p in past_names})
    (input_ids,) = [p for p in model.get_parameters() if p.get_friendly_name() == "input_ids"]
    batch = ops.gather(ops.shape_of(input_ids), ops.constant(np.array([0], np.int64)), ops.constant(np.array(0, np.int64)))
    for node in model.get_ops():
        if node.get_type_name() != "ReadValue":
            continue
        # (batch, heads, positions, features): the heads and features the graph states, 0 positions
        fixed = [d.get_length() if d.is_static else 0 for d in list(node.get_output_partial_shape(0))[1:]]
        shape = ops.concat([batch, ops.constant(np.array(fixed, np.int64))], 0)
        zero = ops.constant(np.array(0, dtype=node.get_output_element_type(0).to_dtype()))
        node.set_arguments([ops.broadcast(zero, shape)])
    model.validate_nodes_and_infer_types()


def stateful_model(artifact: Artifact):
    """The artifact's lowered decoder as a stateful openvino.Model (the fp32 comparison's)."""
    from moedeploy.export.decoder import past_names

    model = read_lowered(artifact)
    make_stateful(model, past_names(artifact.manifest["config"]["n_layers"]))
    return model


def compression_options(scheme: QuantScheme) -> tuple[dict, dict]:
    """NNCF's compress_weights arguments for the graph and for each If branch, nearest to
    `scheme`. int4: groups of the scheme's block size, every MatMul at 4 bits except what NNCF
    keeps at 8 by default (the embedding and the last MatMul, the LM head: as moedeploy's mixed
    int4 and llama.cpp's q4_0 keep theirs above 4 bits); the branches' MatMuls all at 4 bits.
    int8: NNCF's int8 is per output channel only (it takes no group size)."""
    import nncf

    modes = nncf.CompressWeightsMode
    if scheme.bits == 4:
        graph = {"mode": modes.INT4_SYM if scheme.symmetric else modes.INT4_ASYM, "group_size": scheme.block_size,
                 "ratio": 1.0}
        return graph, {**graph, "all_layers": True}
    graph = {"mode": modes.INT8_SYM if scheme.symmetric else modes.INT8_ASYM}
    return graph, graph


def compress(model, scheme: QuantScheme):
    """`model` with its MatMul weights compressed by NNCF, those in If branches included."""
    import contextlib
    import io
    import logging

    import nncf

    logging.getLogger("nncf").setLevel(logging.ERROR)  # a bit-width table per branch otherwise
    graph_options, branch_options = compression_options(scheme)

    def branches(model) -> None:
        for op in model.get_ordered_ops():
            if op.get_type_name() != "If":
                continue
            for i in range(2):
                body = op.get_function(i)
                branches(body)
                if any(node.get_type_name() == "MatMul" for node in body.get_ordered_ops()):
                    op.set_function(i, nncf.compress_weights(body, **branch_options))

    with contextlib.redirect_stdout(io.StringIO()):  # and a progress bar per branch
        model = nncf.compress_weights(model, **graph_options)
        branches(model)
    return model


def compressed_ir(artifact: Artifact, scheme: QuantScheme, cache: Path, progress: Callable[[str], None]) -> Path:
    """OpenVINO's own int8/int4 of the artifact's fp32 weights as IR in `cache`, made once.

    A cached file is reused only when its rt_info records this artifact's weights fingerprint
    and the same compression; it is written under a temporary name and renamed when complete.
    """
    import openvino as ov

    fingerprint = artifact.manifest["config"].get("source", {}).get("weights_sha256")
    if not fingerprint:
        raise ValueError(f"{artifact.path}'s manifest records no weights fingerprint, so a compressed copy could "
                         "not be checked; re-export it with this moedeploy version")
    groups = f"b{scheme.block_size}" if scheme.bits == 4 else "channel"  # NNCF's int8 is per output channel
    what = f"{scheme.name}-{groups}-{'sym' if scheme.symmetric else 'asym'}"
    path = cache / f"openvino-{fingerprint[:16]}-{what}.xml"
    if path.is_file():
        cached = ov.Core().read_model(str(path))
        recorded = {key: cached.get_rt_info(key).astype(str) if cached.has_rt_info(key) else None
                    for key in (RT_FINGERPRINT, RT_COMPRESSION)}
        if recorded == {RT_FINGERPRINT: fingerprint, RT_COMPRESSION: what}:
            progress(f"openvino: reading the cached {path} (it records this artifact's weights and {what})")
            return path
    try:  # before the work: a cache that cannot be written is said at once
        cache.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="openvino-partial-", dir=cache))
    except OSError as e:
        raise ValueError(f"OpenVINO's compressed model is written into {cache}, which cannot be written "
                         f"({e.strerror}); set MOEDEPLOY_CACHE to a writable folder") from e
    try:
        progress(f"openvino: compressing the weights to {what} with NNCF into {path}")
        model = compress(stateful_model(artifact), scheme)
        model.set_rt_info(fingerprint, RT_FINGERPRINT)
        model.set_rt_info(what, RT_COMPRESSION)
        # compress_to_fp16=False: the weights left in f32 (norms, router) stay f32
        ov.save_model(model, str(folder / "model.xml"), compress_to_fp16=False)
        (folder / "model.bin").replace(path.with_suffix(".bin"))
        (folder / "model.xml").replace(path)  # last: the .xml is what marks the pair complete
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return path


#: rt_info keys of a compressed IR: the weights it was made from and how they were compressed
RT_FINGERPRINT, RT_COMPRESSION = "moedeploy_weights_sha256", "moedeploy_compression"


def openvino_stepper(artifact: Artifact, threads: int, compressed: str | None = None) -> Stepper:
    """reset(batch, total), step(ids, start) -> last-position logits (B, vocab) on OpenVINO, and
    greedy(ids, start) -> (B, 1): NumPy's argmax over the logits OpenVINO returned (no copy);
    `compressed`: an IR from `compressed_ir` instead of the artifact's fp32 graph."""
    import openvino as ov

    model = ov.Core().read_model(compressed) if compressed else stateful_model(artifact)
    compiled = ov.Core().compile_model(model, "CPU", {**COMPILE_CONFIG, "INFERENCE_NUM_THREADS": threads})
    del model
    request = compiled.create_infer_request()
    logits = compiled.output("logits")
    state = {"length": 0}

    def reset(batch: int, _total: int) -> None:
        request.reset_state()
        state["length"] = 0

    def last_logits(ids: torch.Tensor, start: int) -> np.ndarray:
        if start != state["length"]:
            raise RuntimeError(f"OpenVINO's cache holds {state['length']} positions, step starts at {start}")
        # the request's own output tensor, not a copy: valid until the next infer (step copies it)
        out = request.infer({"input_ids": ids.cpu().numpy().astype(np.int64)}, share_outputs=True)
        state["length"] += ids.shape[1]
        return out[logits][:, -1]

    def step(ids: torch.Tensor, start: int) -> torch.Tensor:
        return torch.from_numpy(last_logits(ids, start).copy())

    def greedy(ids: torch.Tensor, start: int) -> torch.Tensor:
        return torch.from_numpy(last_logits(ids, start).argmax(-1))[:, None]

    return reset, step, greedy
