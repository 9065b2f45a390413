"""Quantized weights (DequantizeLinear over blocked codes, export/quantize.py) lowered to ONNX
Runtime's com.microsoft::MatMulNBits, which reads the artifact's bytes.

A quantized artifact computes y = x @ DequantizeLinear(codes, scale[, zero_point])^T with
standard ops: correct everywhere, but it dequantizes every weight to float on every run.
MatMulNBits multiplies by the blocked codes directly. Its B is (N, K / block, block * bits /
8) uint8 codes along K, scales (N, K / block), zero points packed per row (absent: 2^(bits-1)).
The artifact's codes and scales are laid out exactly so (one expert's slice of a stack too):
the new initializers are views into the same data file at the same offsets.

Signed codes (symmetric schemes, no zero point: what TensorRT reads) are the unsigned codes
around 2^(bits-1) with each value's top bit flipped. The lowering feeds MatMulNBits (and QMoE)
BitwiseXor(view, 0x88 or 0x80), which ONNX Runtime's constant folding computes once at session
creation; the folded copy is freed once the kernel has prepacked it (measured: the same
resident and peak memory as a view of unsigned codes). A session that does not prepack (the
mapped weights) skips the folding and flips per run instead (runtime/ort.create_session). Unsigned codes with zero points
(asymmetric schemes, and artifacts of format 1) are read as they are; only 4-bit zero points
with an odd number of blocks per row differ (ONNX packs a tensor's nibbles flattened,
MatMulNBits per row): those few bytes are repacked in memory.

accuracy_level 0 computes in float (the dequantized products, to rounding);
4 quantizes the activations to int8 per block for integer dot products (faster, less exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from moedeploy.models.blockquant import pack, unpack
from moedeploy.runtime.gqa import constant_initializer, packs_qkv_for_gqa

DOMAIN = "com.microsoft"
OP_TYPE = "MatMulNBits"
#: codes' ONNX type -> (bits, signed)
CODE_TYPES = {ir.DataType.UINT4: (4, False), ir.DataType.UINT8: (8, False),
              ir.DataType.INT4: (4, True), ir.DataType.INT8: (8, True)}
#: XOR a byte of signed codes with this to get the unsigned codes around 2^(bits-1), by bits
SIGN_FLIP = {4: 0x88, 8: 0x80}
#: providers and activation dtypes ONNX Runtime has a MatMulNBits kernel for
KERNELS = {"CPUExecutionProvider": {ir.DataType.FLOAT, ir.DataType.FLOAT16},
           "CUDAExecutionProvider": {ir.DataType.FLOAT, ir.DataType.FLOAT16}}
ACCURACY_LEVELS = (0, 4)
#: The level a quantized artifact is *run* at: `serve --accuracy-level`'s default (ServeOptions'
#: accuracy_level, passed on as the runtime's nbits_accuracy) and what `bench` times. int8
#: activations per block, as llama.cpp's q8_0/q4_0 dot products. Measured on the `small` preset
#: (README.md), one in-flight row at level 0 against 4: int8 9 against 304 tokens/s (ONNX
#: Runtime's 8-bit CPU kernels have no float path; QMoE takes int8 experts at level 4 only),
#: int4 29 against 407; level 4 adds little KL (int8 0.00012 -> 0.00019, int4 none measurable).
#: Level 0 (the dequantized products, to rounding) stays the library's default wherever a
#: level is a parameter, and what `compare` checks.
RUN_ACCURACY = 4


@dataclass(frozen=True)
class BlockedWeight:
    """A constant weight (..., N, K) given as DequantizeLinear over blocked codes along K: signed
    codes and no zero point, or unsigned codes and a zero point."""

    codes: ir.Value
    scale: ir.Value
    zero_point: ir.Value | None
    bits: int
    block_size: int
    shape: tuple[int, ...]

    @property
    def signed(self) -> bool:
        return self.zero_point is None


@dataclass(frozen=True)
class NBitsWeight:
    """One (N, K) weight's MatMulNBits inputs and attributes."""

    b: ir.Value
    scales: ir.Value
    zero_points: ir.Value | None
    n: int
    k: int
    bits: int
    block_size: int

    def matmul(self, add, x: ir.Value, accuracy_level: int) -> ir.Value:
        """x (..., K) @ W^T through MatMulNBits, appended with `add(op, inputs, **attrs)`."""
        inputs = [x, self.b, self.scales] + ([self.zero_points] if self.zero_points is not None else [])
        return add(OP_TYPE, inputs, domain=DOMAIN, K=self.k, N=self.n,
                   bits=self.bits, block_size=self.block_size, accuracy_level=accuracy_level)


def blocked_format(codes_type: int, zero_point_type: int | None, shape: tuple[int, ...], axis: int,
                   block: int) -> tuple[int, bool] | None:
    """(bits, signed) of DequantizeLinear codes of this ONNX type and shape as the export writes
    them: signed codes without a zero point or unsigned ones with a zero point of their type,
    blocked (16 or more) along the last axis; None for anything else. One rule for every
    lowering of the artifact's quantized weights (ONNX Runtime's here, TensorRT's in
    runtime/tensorrt_lowering.py)."""
    kind = CODE_TYPES.get(codes_type)  # ir.DataType is an IntEnum: TensorProto ints look up too
    if kind is None or kind[1] != (zero_point_type is None) or zero_point_type not in (None, codes_type):
        return None
    if axis not in (len(shape) - 1, -1) or block < 16 or shape[-1] % block:
        return None
    return kind


def blocked_source(value: ir.Value | None) -> BlockedWeight | None:
    """The blocked DequantizeLinear over constant initializers that `value` is, if it is one."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx") or len(node.inputs) not in (2, 3):
        return None
    codes, scale, zero_point = (*node.inputs, None)[:3]
    if any(v is None or v.const_value is None or v.shape is None for v in (codes, scale)):
        return None
    if zero_point is not None and zero_point.const_value is None:
        return None
    shape = tuple(int(d) for d in codes.shape)
    axis = node.attributes["axis"].as_int() if "axis" in node.attributes else 1
    block = node.attributes["block_size"].as_int() if "block_size" in node.attributes else 0
    kind = blocked_format(codes.dtype, None if zero_point is None else zero_point.dtype, shape, axis, block)
    return None if kind is None else BlockedWeight(codes, scale, zero_point, kind[0], block, shape)


def transposed_blocked_source(value: ir.Value | None) -> BlockedWeight | None:
    """W^T given as Transpose(perm 1, 0) of a blocked 2-D DequantizeLinear (a Linear's weight)."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return None
    perm = node.attributes["perm"].as_ints() if "perm" in node.attributes else None
    w = blocked_source(node.inputs[0])
    return w if w is not None and len(w.shape) == 2 and list(perm or [1, 0]) == [1, 0] else None


def nbits_weight(graph: ir.Graph, w: BlockedWeight, expert: int | None = None) -> NBitsWeight:
    """MatMulNBits inputs for the 2-D weight, or for expert `expert` of an (E, N, K) stack:
    views of the artifact's codes (sign-flipped when signed, `_codes`) and scales, registered as
    initializers of `graph`."""
    n, k = w.shape[-2:]
    blocks = k // w.block_size
    tag = "" if expert is None else f".expert{expert}"
    index = 0 if expert is None else expert
    b = _codes(graph, w, index, [n, blocks, w.block_size * w.bits // 8], f"{tag}.nbits_b")
    scales = _view(graph, w.scale, index, w.scale.dtype, [n, blocks], f"{tag}.nbits_scales")
    zero_points = None if w.signed else _row_packed_zero_points(graph, w, index, (n,), blocks, f"{tag}.nbits_zero_points")
    return NBitsWeight(b, scales, zero_points, n, k, w.bits, w.block_size)


@dataclass(frozen=True)
class QMoEStack:
    """One expert stack's com.microsoft::QMoE inputs: codes (E, N, K * bits / 8) uint8 in the
    raw layout (weights_prepacked=0), scales (E, N, K / block), zero points packed per row
    (None for codes around 2^(bits-1), QMoE's default)."""

    codes: ir.Value
    scales: ir.Value
    zero_points: ir.Value | None
    bits: int
    block_size: int


def qmoe_stack(graph: ir.Graph, value: ir.Value | None) -> QMoEStack | None:
    """QMoE's inputs for an (E, N, K) expert stack given as blocked DequantizeLinear, if it is
    one: views of the artifact's codes (sign-flipped when signed, `_codes`) and its scales, 4-bit zero points
    repacked per row when a row has an odd number of blocks (QMoE, like MatMulNBits, packs them
    per row)."""
    w = blocked_source(value)
    if w is None or len(w.shape) != 3:
        return None
    e, n, k = w.shape
    blocks = k // w.block_size
    codes = _codes(graph, w, 0, [e, n, k * w.bits // 8], ".qmoe_codes")
    zero_points = None if w.signed else _row_packed_zero_points(graph, w, 0, (e, n), blocks, ".qmoe_zero_points")
    return QMoEStack(codes, w.scale, zero_points, w.bits, w.block_size)


def constant_view(value: ir.Value, index: int, dtype: ir.DataType, shape: list[int], name: str) -> ir.Value:
    """Part `index` of a constant cut into equal parts along its first axis (an expert of a
    stack; 0 and the whole for a 2-D weight), its bytes seen as `dtype` with `shape`: a view into
    the same external data file (offset, length) when the weights live there, else a copy of
    those bytes. Not registered in any graph."""
    tensor = value.const_value
    assert tensor is not None
    length = int(np.prod(shape)) * dtype.bitwidth // 8
    if isinstance(tensor, ir.ExternalTensor):
        stored = tensor.length  # the bytes the graph says the data file holds for the whole constant
        if stored is not None and (index + 1) * length > stored:
            raise ValueError(f"{value.name}: the data file holds {stored} bytes of it, but part {index} ends at byte "
                             f"{(index + 1) * length}: the graph's record of its weights is inconsistent; re-export it")
        view: ir.TensorProtocol = ir.ExternalTensor(
            tensor.location, (tensor.offset or 0) + index * length, length, dtype, shape=ir.Shape(shape),
            name=name, base_dir=tensor.base_dir)
    else:
        raw = tensor.tobytes()[index * length:(index + 1) * length]
        view = ir.tensor(np.frombuffer(raw, dtype=dtype.numpy()).reshape(shape), name=name)
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype), const_value=view)


def _view(graph: ir.Graph, value: ir.Value, index: int, dtype: ir.DataType, shape: list[int], suffix: str) -> ir.Value:
    """`constant_view` named `value.name + suffix`, registered as an initializer of `graph`."""
    out = constant_view(value, index, dtype, shape, f"{value.name}{suffix}")
    graph.register_initializer(out)
    return out


def _codes(graph: ir.Graph, w: BlockedWeight, index: int, shape: list[int], suffix: str) -> ir.Value:
    """Part `index` of the codes as unsigned bytes the quantized kernels read: a view of the
    artifact's bytes, through BitwiseXor(view, SIGN_FLIP) when they are signed. The BitwiseXor
    goes first in `graph` (the main graph, where ONNX Runtime folds it into a constant at session
    creation, also for a branch that reads it from the outer scope)."""
    view = _view(graph, w.codes, index, ir.DataType.UINT8, shape, suffix)
    if not w.signed:
        return view
    return _sign_flipped(graph, view, w.bits)


def _sign_flipped(graph: ir.Graph, codes: ir.Value, bits: int) -> ir.Value:
    """BitwiseXor(codes, SIGN_FLIP[bits]), inserted first in `graph`."""
    name = f"moedeploy.sign_flip_{bits}"
    flip = graph.initializers.get(name) or constant_initializer(graph, name, np.array(SIGN_FLIP[bits], dtype=np.uint8))
    node = ir.node("BitwiseXor", [codes, flip], name=f"{codes.name}/unsigned")
    out = node.outputs[0]
    out.name, out.shape, out.type = f"{codes.name}.unsigned", codes.shape, ir.TensorType(ir.DataType.UINT8)
    graph.insert_before(next(iter(graph)), node)
    return out


def sign_flips(graph: ir.Graph) -> int:
    """How many `_sign_flipped` codes the graph reads (BitwiseXor nodes ONNX Runtime can fold)."""
    return sum(node.op_type == "BitwiseXor" and _flipped_source(node.outputs[0])[1] is not None for node in graph)


def _flipped_source(value: ir.Value) -> tuple[ir.Value, int | None]:
    """(the constant codes, bits) when `value` is `_sign_flipped` codes, else (value, None)."""
    node = value.producer()
    if node is not None and node.op_type == "BitwiseXor" and node.inputs[1] is not None \
            and node.inputs[1].name.startswith("moedeploy.sign_flip_"):
        return node.inputs[0], int(node.inputs[1].name.rsplit("_", 1)[1])
    return value, None


def _row_packed_zero_points(graph: ir.Graph, w: BlockedWeight, index: int, rows: tuple[int, ...], blocks: int,
                            suffix: str) -> ir.Value:
    """Part `index` of the zero points, packed per row as MatMulNBits and QMoE read them, shaped
    (*rows, bytes per row). 8-bit ones, and 4-bit ones with an even number of blocks per row, are
    packed per row already in the artifact's flattened packing: a view of the same bytes. Other
    4-bit ones (an odd number of blocks per row) are repacked in memory: a few bytes."""
    bytes_per_row = -(-blocks * w.bits // 8)
    if w.bits == 8 or blocks % 2 == 0:
        return _view(graph, w.zero_point, index, ir.DataType.UINT8, [*rows, bytes_per_row], suffix)
    import torch

    count = int(np.prod(rows))
    flat = np.frombuffer(w.zero_point.const_value.tobytes(), dtype=np.uint8)
    values = unpack(torch.from_numpy(flat.copy()), 4, flat.size * 2)[index * count * blocks:(index + 1) * count * blocks]
    packed = pack(values.reshape(count, blocks), 4).numpy().reshape(*rows, bytes_per_row)
    name = f"{w.zero_point.name}{suffix}"
    out = ir.Value(name=name, shape=ir.Shape(list(packed.shape)), type=ir.TensorType(ir.DataType.UINT8),
                   const_value=ir.tensor(packed, name=name))
    graph.register_initializer(out)
    return out


def lower_linears(graph: ir.Graph, provider: str, accuracy_level: int = 0) -> int:
    """Every MatMul (or transB Gemm) by a quantized Linear weight -> MatMulNBits on the artifact's
    bytes; returns how many."""
    lowered = 0
    for node in list(graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "MatMul":  # x @ W^T, W^T a Transpose of the dequantized W
            w, bias = transposed_blocked_source(node.inputs[1]), None
        elif is_linear_gemm(node):  # x @ W^T + c, transB on the dequantized W
            w = blocked_source(node.inputs[1])
            w = w if w is not None and len(w.shape) == 2 else None
            bias = node.inputs[2] if len(node.inputs) > 2 else None
        else:
            continue
        if w is None or w.scale.dtype not in KERNELS.get(provider, ()):  # the scales' dtype is the activations'
            continue
        nodes: list[ir.Node] = []
        add = _appender(nodes, node.name)
        y = nbits_weight(graph, w).matmul(add, node.inputs[0], accuracy_level)
        if bias is not None:
            y = add("Add", [y, bias])
        name = node.outputs[0].name
        y.shape, y.type = node.outputs[0].shape, node.outputs[0].type
        ir.convenience.replace_nodes_and_values(graph, node, [node], nodes, [node.outputs[0]], [y])
        y.name = name  # the graph's outputs (logits) and layer-wise compare look values up by name
        lowered += 1
    return lowered


def fuse_shared_input(graph: ir.Graph) -> int:
    """MatMulNBits nodes that read the same activation with the same K, bits, block size and
    accuracy level and feed only GroupQueryAttention (a layer's q, k and v projections, or the
    Concat that packs them for a ragged step) -> one MatMulNBits over their weights stacked
    along N, then a Split into the outputs they had; returns how many nodes went.

    Each output row of MatMulNBits is its own weight row's dot product with the input, and the
    input is quantized (accuracy level 4) per block of K, whatever N is: the fused node computes
    the same values. What it saves is fixed per-node cost and quantizing the same activation
    once per projection. The stacked codes, scales and zero points are new initializers in
    memory (views into the artifact's data file cannot be concatenated): a layer's attention
    projections, a small part of the weights; other MatMulNBits that share an input (a dense
    MLP's gate and up, say) stay as they are, mapped."""
    groups: dict[tuple, list[ir.Node]] = {}
    for node in graph:
        if node.domain != DOMAIN or node.op_type != OP_TYPE or len(node.inputs) not in (3, 4):
            continue
        if not _feeds_attention(node.outputs[0]):
            continue
        codes, flip = _flipped_source(node.inputs[1])
        if any(v is None or v.const_value is None for v in (codes, *node.inputs[2:])) or node.inputs[0] is None:
            continue
        attrs = {k: a.value for k, a in node.attributes.items()}
        key = (node.inputs[0], attrs.get("K"), attrs.get("bits"), attrs.get("block_size"), attrs.get("accuracy_level", 0),
               flip, len(node.inputs))
        groups.setdefault(key, []).append(node)
    removed = 0
    for (x, *_, flip, _inputs), nodes in groups.items():
        if len(nodes) < 2:
            continue
        first = nodes[0]
        sizes = [node.attributes["N"].as_int() for node in nodes]
        name = f"{first.name}/fused"
        codes = _stacked(graph, [_flipped_source(node.inputs[1])[0] for node in nodes], f"{name}.b")
        stacked = [codes if flip is None else _sign_flipped(graph, codes, flip)]
        stacked += [_stacked(graph, [node.inputs[i] for node in nodes], f"{name}.{part}")
                    for i, part in ((2, "scales"), (3, "zero_points")) if i < len(first.inputs)]
        attrs = {k: a.value for k, a in first.attributes.items()} | {"N": sum(sizes)}
        fused = ir.node(OP_TYPE, [x, *stacked], attrs, domain=DOMAIN, name=name)
        split = ir.node("Split", [fused.outputs[0], constant_initializer(graph, f"{name}.sizes", np.array(sizes, dtype=np.int64))],
                        {"axis": -1}, num_outputs=len(nodes), name=f"{name}/Split")
        graph.insert_before(first, [fused, split])
        for node, out in zip(nodes, split.outputs, strict=True):
            old = node.outputs[0]
            out.shape, out.type = old.shape, old.type
            ir.convenience.replace_all_uses_with(old, out)
            name = old.name
            graph.remove(node, safe=True)  # detaches its inputs too: its weights go unless read elsewhere
            out.name = name
        removed += len(nodes) - 1
    return removed


def _feeds_attention(value: ir.Value) -> bool:
    """Whether a projection's output goes only to GroupQueryAttention (as its query, key or
    value) or to the Concat that packs q, k and v for it in a ragged step."""
    uses = list(value.uses())
    return bool(uses) and not value.is_graph_output() and all(
        (use.node.op_type == "GroupQueryAttention" and use.idx in (0, 1, 2))
        or (use.node.op_type == "Concat" and packs_qkv_for_gqa(use.node))
        for use in uses)


def _stacked(graph: ir.Graph, parts: list[ir.Value], name: str) -> ir.Value:
    """The constants `parts` concatenated along their first axis, a new initializer."""
    return constant_initializer(graph, name, np.concatenate([part.const_value.numpy() for part in parts], axis=0))


def is_linear_gemm(node: ir.Node) -> bool:
    """x @ W^T + c as a Gemm: transB, no other scaling or transpose (what the exporter emits for
    a Linear on a flattened input)."""
    attrs = {k: a.value for k, a in node.attributes.items()}
    return (node.op_type == "Gemm" and node.domain in ("", "ai.onnx") and attrs.get("transB", 0) == 1
            and attrs.get("transA", 0) == 0 and attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0)


def _appender(nodes: list[ir.Node], prefix: str):
    """`add(op, inputs, domain=..., **attrs)`: appends a node to `nodes`, returns its output."""

    def add(op: str, inputs: list, domain: str = "", **attrs) -> ir.Value:
        new = ir.node(op, inputs, attrs, domain=domain, name=f"{prefix}/{op}_{len(nodes)}")
        nodes.append(new)
        return new.outputs[0]

    return add
