"""nn.Module -> checked ONNX ModelProto with the custom ops' function bodies attached."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import onnx
import torch

from moedeploy.plugins import CUSTOM_OPS

OPSET = 23


class ExportError(RuntimeError):
    """Tracing or checking the ONNX graph failed."""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.onnx prints progress lines and warnings of its own; our CLI shows its own progress."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def attach_function_bodies(model: onnx.ModelProto) -> None:
    """Give every custom node a standard-op function body (the portable fallback).

    torch.onnx.export inlines model-local functions, so the bodies are added after export;
    each imports ai.onnx at the model's opset, as the checker requires.
    """
    used = {(n.domain, n.op_type) for n in _all_nodes(model.graph)}
    present = {(f.domain, f.name) for f in model.functions}
    for key, op_module in CUSTOM_OPS.items():
        if key in used and key not in present:
            model.functions.append(op_module.function_proto())
    domains = {o.domain for o in model.opset_import}
    for domain in {d for d, _ in used if (d, _) in CUSTOM_OPS}:
        if domain not in domains:
            model.opset_import.append(onnx.helper.make_opsetid(domain, 1))


def _all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attr.g)


def custom_op_counts(model: onnx.ModelProto) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for node in _all_nodes(model.graph):
        key = (node.domain, node.op_type)
        if key in CUSTOM_OPS:
            counts[key] = counts.get(key, 0) + 1
    return counts


def to_onnx(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_shapes: Any,
) -> onnx.ModelProto:
    """Trace with torch.export (dynamo), optimise, attach function bodies, full-check."""
    try:
        with _quiet(), torch.no_grad():
            program = torch.onnx.export(
                module,
                args,
                dynamo=True,
                opset_version=OPSET,
                input_names=list(input_names),
                output_names=list(output_names),
                dynamic_shapes=dynamic_shapes,
                optimize=True,
                verbose=False,
            )
    except Exception as e:
        raise ExportError(f"torch.onnx.export failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    model = program.model_proto
    attach_function_bodies(model)
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"exported graph fails the ONNX checker: {str(e).splitlines()[0]}") from e
    return model
