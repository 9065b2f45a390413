"""The decoder to ONNX without holding its weights: trace the graph over empty tensors, then
stream the weights from their source into `model.onnx.data`, one tensor (or expert) at a time.

Why: a real MoE checkpoint is tens of GB. Tracing with torch.onnx needs tensors of the right
shapes, not their values, so the model is built on the meta device and given uninitialised
CPU storage that is never written (the kernel maps no page until one is touched): tracing a
2.8 GB model stays near 0.5 GB resident. No graph value may depend on those empty weights,
so while the graph is optimised they are graph inputs (constant folding cannot touch an
input), and the few folds that matter are redone here as recipes applied while writing:

  copy        the tensor as it is (cast to the artifact's dtype)
  transpose   W^T of a 2-D weight that feeds MatMul (what torch's exporter emits for Linear)
  interleave  the experts' gate and up rows alternating, (E, 2I, H): the layout ONNX
              Runtime's com.microsoft::MoE takes, so its lowering reads the artifact's weight
              file as it is; the graph slices gate and up back out with two strided Slices

Every weight then lives in `model.onnx.data` at a 64 KiB-aligned offset (ONNX Runtime can
memory-map it), and model.onnx holds only the graph and the small constants.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import onnx
import onnx_ir as ir
import torch

from moedeploy.export import quantize, stamping
from moedeploy.export.decoder import (
    WRAPPER_PREFIX,
    DecoderWithPast,
    past_names,
    past_shapes,
    present_names,
)
from moedeploy.export.onnx_export import (
    OPSET,
    ExportError,
    _quiet,
    attach_function_bodies,
    export_failure,
    fewer_collections,
    name_custom_nodes,
    normalize_dim_sums,
    tracing,
)
from moedeploy.models.blockquant import QuantScheme
from moedeploy.models.config import DecoderConfig
from moedeploy.models.weights import (
    WeightSource,
    chunks,
    interleaved_chunks,
    tensor_bytes,
    transposed_chunks,
)
from moedeploy.plugins import moe
from moedeploy.utils.progress import size_text, throttled

DATA_ALIGNMENT = 1 << 16
PENDING = "<not written yet>"
#: (how, from which of our tensors); the quantized parts: (part, (layout, *tensors)), export/quantize.py
Recipe = tuple[Literal["copy", "transpose", "interleave", "codes", "scale", "zero_point"], tuple[str, ...]]
Progress = Callable[[str], None]


@dataclass
class TracedDecoder:
    """The decoder's graph with empty weights, and how to make each weight initializer."""

    model: ir.Model
    recipes: dict[str, Recipe]  # initializer name -> (how, from which of our tensor names)
    quantization: dict[str, QuantScheme] | None = None  # each quantized tensor's format, by our name


def empty_decoder(config: DecoderConfig, dtype: torch.dtype) -> torch.nn.Module:
    """A MoEDecoder with the right shapes and dtype whose weights are never written: no memory
    is committed for them until something reads them (nothing here does)."""
    from moedeploy.models.decoder import MoEDecoder, rotary_embedding

    with torch.device("meta"):
        decoder = MoEDecoder(config).to(dtype)
    decoder = decoder.to_empty(device="cpu")
    decoder.rope = rotary_embedding(config)  # real values
    return decoder.eval()


#: Traces made in this process, newest last: (the graph serialized, its recipes) by what a trace
#: is a function of. `moedeploy bench --quantize int8,int4` exports one checkpoint three times, and
#: tracing is most of a small model's export (about 2 s plus 1 s a layer on a 2-core CPU). The
#: graphs hold no weights, only small constants: usually a few MB (rotary tables grow with the
#: positions, tens of MB at 128k). At most 4 are kept, none over 256 MiB.
_TRACES: OrderedDict[str, tuple[bytes, dict[str, Recipe]]] = OrderedDict()
_TRACES_KEPT = 4
_TRACE_BYTES_KEPT = 256 << 20
_TRACES_LOCK = threading.Lock()


def trace_key(config: DecoderConfig, dtype: torch.dtype, weight_names: list[str]) -> str:
    """Everything a trace depends on besides this process's code: every field of the config
    (a dataclass's repr lists them all), the dtype and the weights' names in order."""
    return repr((config, str(dtype), list(weight_names)))


def trace_decoder(config: DecoderConfig, dtype: torch.dtype, weight_names: list[str]) -> TracedDecoder:
    """Trace DecoderWithPast over empty weights; returns the optimised graph and the weight recipes.

    A config, dtype and weight names this process traced before are not traced again: the caller
    gets a new copy of that graph, read back from its serialized bytes, as every caller does (a
    first trace too), so an export never depends on whether its trace was made or remembered;
    quantizing and writing weights change the copy, never the remembered bytes."""
    key = trace_key(config, dtype, weight_names)
    with _TRACES_LOCK:
        remembered = _TRACES.get(key)
        if remembered is not None:
            _TRACES.move_to_end(key)
    if remembered is None:
        traced = _trace(config, dtype, weight_names)
        remembered = (ir.to_proto(traced.model).SerializeToString(), traced.recipes)
        if len(remembered[0]) <= _TRACE_BYTES_KEPT:
            with _TRACES_LOCK:
                _TRACES[key] = remembered
                while len(_TRACES) > _TRACES_KEPT:
                    _TRACES.popitem(last=False)
    graph_bytes, recipes = remembered
    return TracedDecoder(ir.from_proto(onnx.ModelProto.FromString(graph_bytes)), copy.deepcopy(recipes))


def _trace(config: DecoderConfig, dtype: torch.dtype, weight_names: list[str]) -> TracedDecoder:
    """Trace the fewest leading layers that hold every kind of layer, then copy those layers
    for the rest (export/stamping.py); every layer is traced where that cannot be done."""
    signatures = stamping.layer_signatures(config)
    k = stamping.traced_prefix(signatures)
    if k is not None:
        prefix_names = [name for name in weight_names if (stamping.weight_layer(name) or 0) < k]
        try:
            return _trace_layers(stamping.prefix_config(config, k), dtype, prefix_names, signatures)
        except stamping.CannotStamp as e:
            logging.getLogger(__name__).debug("tracing every layer: %s", e)
    return _trace_layers(config, dtype, weight_names)


def _trace_layers(config: DecoderConfig, dtype: torch.dtype, weight_names: list[str],
                  signatures: list[str] | None = None) -> TracedDecoder:
    """Trace DecoderWithPast at `config`'s layers; with `signatures` (of more layers than
    that), grow the graph to their count before its weights are folded."""
    decoder = empty_decoder(config, dtype)
    n = config.n_layers
    ids = torch.zeros(2, 5, dtype=torch.long)
    k, v = past_shapes(config, batch=2, past_len=3)
    past = [(torch.zeros(k, dtype=dtype), torch.zeros(v, dtype=dtype)) for _ in range(n)]
    past_axes = {0: "batch", 2: "past_seq"}
    try:
        with tracing():
            program = torch.onnx.export(
                DecoderWithPast(decoder).eval(), (ids, past), dynamo=True, opset_version=OPSET,
                input_names=["input_ids", *past_names(n)], output_names=["logits", *present_names(n)],
                dynamic_shapes=({0: "batch", 1: "seq"}, [(past_axes, past_axes) for _ in range(n)]),
                optimize=False, verbose=False,
            )
    except Exception as e:
        raise export_failure(e) from e
    model = program.model
    del program, decoder
    params = _lift_weights(model.graph, {WRAPPER_PREFIX + name: name for name in weight_names})
    with _quiet(), fewer_collections():
        import onnxscript.optimizer

        onnxscript.optimizer.optimize(model)
    if signatures is not None:
        stamping.stamp_layers(model.graph, params, signatures)
    recipes = _restore_weights(model.graph, params)
    return TracedDecoder(model, recipes)


def _lift_weights(graph: ir.Graph, names: dict[str, str]) -> dict[str, tuple[ir.Value, str]]:
    """Turn every weight initializer into a graph input for the optimiser: an input is never
    constant, so nothing is folded from the empty values. Returns value name -> (value, our name)."""
    lifted = {}
    for value_name, ours in names.items():
        value = graph.initializers.get(value_name)
        if value is None:
            continue
        graph.initializers.pop(value_name)
        value.const_value = None
        graph.inputs.append(value)
        lifted[value_name] = (value, ours)
    return lifted


def _restore_weights(graph: ir.Graph, lifted: dict[str, tuple[ir.Value, str]]) -> dict[str, Recipe]:
    """Make the lifted weights initializers again, folding what is worth storing folded."""
    lifted_values = {id(v): (v, ours) for v, ours in lifted.values()}
    for value, _ in lifted.values():
        graph.inputs.remove(value)
    recipes: dict[str, Recipe] = {}

    def weight(value: ir.Value | None) -> str | None:
        return lifted_values[id(value)][1] if value is not None and id(value) in lifted_values else None

    for node in list(graph):
        source = weight(node.inputs[0]) if node.inputs else None
        if node.op_type == "Transpose" and node.domain == "" and source is not None:
            perm = node.attributes["perm"].as_ints() if "perm" in node.attributes else None
            if len(node.inputs[0].shape) == 2 and perm in (None, [1, 0], (1, 0)):
                folded = _new_weight(graph, f"{node.inputs[0].name}.T", node.outputs[0])
                ir.convenience.replace_all_uses_with(node.outputs[0], folded)
                graph.remove(node, safe=True)
                _register(graph, folded)
                recipes[folded.name] = ("transpose", (source,))
        elif node.domain == moe.DOMAIN and node.op_type == moe.OP_TYPE:
            gate, up = weight(node.inputs[2]), weight(node.inputs[3])
            if gate is not None and up is not None:
                _fuse_gate_up(graph, node, gate, up, recipes)
    for value, ours in lifted.values():
        if value.uses():
            _register(graph, value)
            recipes[value.name] = ("copy", (ours,))
    return recipes


def _new_weight(graph: ir.Graph, name: str, like: ir.Value, shape: list[int] | None = None) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(shape if shape is not None else list(like.shape)), type=like.type)


def _register(graph: ir.Graph, value: ir.Value) -> None:
    """An initializer whose data is not written yet: `write_weights` points it at its bytes."""
    value.const_value = ir.ExternalTensor(
        PENDING, None, None, value.dtype, shape=ir.Shape(list(value.shape)), name=value.name
    )
    graph.register_initializer(value)


def _fuse_gate_up(graph: ir.Graph, node: ir.Node, gate: str, up: str, recipes: dict[str, Recipe]) -> None:
    """Feed the MoE node's gate and up weights from one interleaved (E, 2I, H) initializer."""
    gate_value = node.inputs[2]
    n_experts, hidden, dim = (int(d) for d in gate_value.shape)
    fused = _new_weight(graph, gate_value.name.replace("w_gate", "w_gate_up"), gate_value, [n_experts, 2 * hidden, dim])
    new_nodes = []

    def const(values: list[int]) -> ir.Value:
        n = ir.node("Constant", [], {"value": ir.tensor(values, dtype=ir.DataType.INT64)})
        new_nodes.append(n)
        return n.outputs[0]

    for index, start, name in ((2, 0, "w_gate"), (3, 1, "w_up")):
        sliced = ir.node("Slice", [fused, const([start]), const([2 * hidden]), const([1]), const([2])],
                         name=f"{fused.name}/{name}")
        sliced.outputs[0].shape = ir.Shape([n_experts, hidden, dim])
        sliced.outputs[0].type = gate_value.type
        sliced.outputs[0].name = f"{fused.name}.{name}"
        new_nodes.append(sliced)
        node.replace_input_with(index, sliced.outputs[0])
    graph.insert_before(node, new_nodes)
    _register(graph, fused)
    recipes[fused.name] = ("interleave", (gate, up))


def recipe_chunks(recipe: Recipe, source: WeightSource, dtype: torch.dtype,
                  formats: dict[str, QuantScheme] | None = None) -> Iterator[torch.Tensor]:
    """The initializer's values in order, in bounded pieces (one expert at most)."""
    how, names = recipe
    if how in quantize.PARTS:
        if formats is None or names[1] not in formats:
            raise ValueError(f"a quantized part ({how}) of {names[1]} needs its quantization format")
        yield from quantize.part_chunks(how, names[0], names[1:], source, dtype, formats[names[1]])
    elif how == "copy":
        yield from chunks(source, names[0], dtype)
    elif how == "transpose":
        yield from transposed_chunks(source, names[0], dtype)
    elif how == "interleave":
        yield from interleaved_chunks(source, names[0], names[1], dtype)
    else:
        raise ValueError(f"unknown weight recipe {how!r}")


def recipe_bytes(model: ir.Model, recipes: dict[str, Recipe]) -> int:
    """The bytes of weights the data file will hold (without alignment padding)."""
    graph = model.graph
    return sum(_nbytes(graph.initializers[name]) for name in recipes)



def _nbytes(value: ir.Value) -> int:
    count = 1
    for d in value.shape:
        count *= int(d)
    return -(-count * value.dtype.bitwidth // 8)  # 4-bit values two to a byte, an odd one padded


def write_weights(
    traced: TracedDecoder, source: WeightSource, dtype: torch.dtype, data_file: Path,
    progress: Progress,
) -> int:
    """Stream every weight into `data_file` and point its initializer there; returns bytes written.

    Each tensor starts at a 64 KiB-aligned offset. A piece whose size disagrees with the
    graph's shape stops the export: the file must be exactly what the graph says.
    """
    graph = traced.model.graph
    total = recipe_bytes(traced.model, traced.recipes)
    written = offset = 0
    report = throttled(progress)
    with data_file.open("wb") as f:
        for name in list(graph.initializers):
            if name not in traced.recipes:
                continue
            value = graph.initializers[name]
            offset = -(-f.tell() // DATA_ALIGNMENT) * DATA_ALIGNMENT
            f.seek(offset)
            length = 0
            for piece in recipe_chunks(traced.recipes[name], source, dtype, traced.quantization):
                length += f.write(tensor_bytes(piece))
            if length != _nbytes(value):
                raise ExportError(f"weight {name}: wrote {length} bytes, the graph's shape needs {_nbytes(value)}")
            value.const_value = ir.ExternalTensor(
                data_file.name, offset, length, value.dtype, shape=value.shape, name=name, base_dir=data_file.parent,
            )
            written += length
            report(f"writing weights: {size_text(written)} of {size_text(total)} ({written * 100 // max(total, 1)}%)")
    return written


def save_graph(traced: TracedDecoder, model_file: Path, metadata: dict[str, str] | None = None) -> onnx.ModelProto:
    """Serialise the graph (weights stay in the data file), attach the custom ops' function
    bodies, name the custom nodes after their modules, and check the file by path (a model
    past 2 GB cannot be checked in memory). `metadata`: the model's metadata_props to add.
    Returns the proto without weight data."""
    proto = ir.serde.serialize_model(traced.model)
    onnx.helper.set_model_props(proto, {**{p.key: p.value for p in proto.metadata_props}, **(metadata or {})})
    attach_function_bodies(proto)
    name_custom_nodes(proto, WRAPPER_PREFIX)
    normalize_dim_sums(proto)
    onnx.save_model(proto, str(model_file))
    try:
        onnx.checker.check_model(str(model_file), full_check=True)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"exported graph fails the ONNX checker: {str(e).splitlines()[0]}") from e
    return proto


def quantize_weights(traced: TracedDecoder, source: WeightSource, scheme: QuantScheme, mixed: bool = True,
                     head_block_size: int | None = None) -> dict[str, int]:
    """Make the traced graph read its Linear and expert weights through DequantizeLinear, their
    parts streamed by recipes like every weight (export/quantize.py); returns counts."""
    counts, traced.quantization = quantize.rewrite_graph(traced.model.graph, traced.recipes, source, scheme,
                                                         _register, mixed, head_block_size)
    return counts


def weight_summary(traced: TracedDecoder) -> dict[str, Any]:
    """How many initializers each recipe made (for the manifest: a reader sees the layout)."""
    counts: dict[str, int] = {}
    for how, _ in traced.recipes.values():
        counts[how] = counts.get(how, 0) + 1
    return counts
