"""OpenVINO as a peer engine: the artifact's own graph on OpenVINO's CPU plugin, the KV cache
kept inside the compiled model as state, the way optimum-intel runs a decoder.

What optimum-intel does to a transformers model is done here to the artifact, so both engines
read the same weights: OpenVINO's ONNX frontend reads the graph as `ort` runs it (the MoE on
the per-expert lowering, standard ONNX ops only; the LM head on the last position), every
past/present pair becomes a state variable (`apply_make_stateful_transformation`, as in
optimum-intel's stateful export) whose initial value is an empty cache of the step's batch,
and the model is compiled with f32 inference precision: on a CPU with bf16 instructions
OpenVINO would otherwise compute in bf16, and this is the fp32 comparison.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from moedeploy.export.artifact import MODEL_DATA_FILE, MODEL_FILE, Artifact

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
    from moedeploy.runtime.ort import CACHE_DIR, CPU, lowered_model

    try:
        graph, _ = lowered_model(artifact, CPU, "experts", logits="last")
    except LoweringError as e:
        raise ValueError(f"backend 'openvino' runs the graph with every MoE on standard ops (the per-expert "
                         f"lowering): {e}") from None
    if not isinstance(graph, bytes):  # a block: its weights are inside the file
        return ov.Core().read_model(graph)
    cache = artifact.path / CACHE_DIR
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


def openvino_stepper(artifact: Artifact, threads: int) -> tuple[Callable[[int, int], None], Callable]:
    """reset(batch, total) and step(ids, start) -> last-position logits (B, vocab) on OpenVINO."""
    import openvino as ov

    from moedeploy.export.decoder import past_names

    n_layers = artifact.manifest["config"]["n_layers"]
    model = read_lowered(artifact)
    make_stateful(model, past_names(n_layers))
    compiled = ov.Core().compile_model(model, "CPU", {**COMPILE_CONFIG, "INFERENCE_NUM_THREADS": threads})
    del model
    request = compiled.create_infer_request()
    logits = compiled.output("logits")
    state = {"length": 0}

    def reset(batch: int, _total: int) -> None:
        request.reset_state()
        state["length"] = 0

    def step(ids: torch.Tensor, start: int) -> torch.Tensor:
        if start != state["length"]:
            raise RuntimeError(f"OpenVINO's cache holds {state['length']} positions, step starts at {start}")
        out = request.infer({"input_ids": ids.cpu().numpy().astype(np.int64)})
        state["length"] += ids.shape[1]
        return torch.from_numpy(out[logits][:, -1].copy())

    return reset, step
