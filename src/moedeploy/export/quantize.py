"""Weight-only int8/int4 in the decoder artifact, as standard ONNX DequantizeLinear.

Which weights: every Linear's (attention and dense projections, shared experts, the LM head)
and the stacked expert weights. The router, norms, embeddings and biases stay in the
artifact's dtype: they are small, and the router's choices are the most sensitive to error.
int4 is mixed by default, as llama.cpp's q4_0 is for a MoE model: the LM head and the
attention's K and V projections stay at int8 (llama.cpp: Q6_K and Q8_0), a few percent of the
bytes a decode step reads, the tensors whose error the logits feel most; `mixed=False`
quantizes them to int4 too.

How they are written (`models/blockquant.py` has the formulas): a weight W (N, K), as
nn.Linear stores it, becomes codes (N, K) and scale (N, K / block) in the artifact's dtype:
symmetric (the default), signed int8 or int4 codes and no zero point, what TensorRT's
Dequantize takes; asymmetric, uint8 or uint4 codes and a zero_point (N, K / block) in the
codes' type (ONNX Runtime only). The graph reads them through DequantizeLinear(axis=1,
block_size) and a Transpose into the MatMul that took W^T. Expert stacks (E, out, in) the
same way along their last axis, the interleaved gate/up stack included, into the moe::MoE
node. So plain ONNX Runtime reads the artifact with standard ops, and the ONNX Runtime
lowering hands the same bytes to com.microsoft::MatMulNBits and QMoE (runtime/quantized.py).

Streaming: each part is written one row block or one expert at a time, quantized as it is
read, so a checkpoint is never held whole in float (or twice).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import onnx_ir as ir
import torch

from moedeploy.models.blockquant import QuantScheme, pack, quantize
from moedeploy.models.weights import WeightSource, chunks, interleaved_chunks
from moedeploy.runtime.quantized import is_linear_gemm

#: recipe kinds of the quantized parts (export/streaming.py): (part, (layout, *our tensor names))
PARTS = ("codes", "scale", "zero_point")
#: Linear weights that stay unquantized, by a part of their name (the routers and a shared
#: expert's one-row gate: tiny, and what decides the routing)
KEPT_LINEARS = ("router", "shared_gate")
#: Linear weights a mixed int4 export keeps at int8, by the end of their name
INT8_IN_MIXED_INT4 = ("lm_head.weight", ".attn.wk.weight", ".attn.wv.weight")
#: the LM head, by the end of its name: blocks of its own (head_block)
LM_HEAD = "lm_head.weight"
#: an int8 LM head's default block size, at most (head_block)
HEAD_BLOCK_INT8 = 256
#: the manifest's quantization "format": 2, symmetric codes signed with no zero point (what
#: TensorRT's Dequantize takes; int4 with a searched scale). Format 1 (the field absent) had
#: unsigned symmetric codes around a zero point of 8 or 7 per block (q4_0's levels).
QUANT_FORMAT = 2
#: the ONNX type of the codes, by (bits, signed)
CODE_TYPES = {(4, True): ir.DataType.INT4, (8, True): ir.DataType.INT8,
              (4, False): ir.DataType.UINT4, (8, False): ir.DataType.UINT8}


class QuantizeError(ValueError):
    """A weight the requested scheme cannot quantize."""


def scheme_for(name: str, scheme: QuantScheme, mixed: bool, in_features: int,
               head_block_size: int | None = None) -> QuantScheme:
    """The format of our tensor `name`, whose rows have `in_features` values, in an export at
    `scheme`: mixed int4 keeps a few at int8, and the LM head has blocks of its own
    (head_block)."""
    bits = 8 if mixed and scheme.bits == 4 and name.endswith(INT8_IN_MIXED_INT4) else scheme.bits
    block = head_block(scheme.block_size, bits, in_features, head_block_size) if name.endswith(LM_HEAD) \
        else scheme.block_size
    return QuantScheme(bits, block, scheme.symmetric)


def head_block(block_size: int, bits: int, in_features: int, head_block_size: int | None = None) -> int:
    """The LM head's block size. Asked for (`head_block_size`): that. By default, an int8 head
    takes the largest power of two up to HEAD_BLOCK_INT8 that divides its rows, never below
    `block_size`; an int4 head takes `block_size`. The head is read whole every token, and
    ONNX Runtime's 8-bit MatMulNBits kernel spends per block: on the `small` preset blocks of
    256 instead of 32 decoded 6-21% faster at level KL (benchmarks/README.md, session 17)."""
    if head_block_size is not None:
        return head_block_size
    if bits != 8:
        return block_size
    block = max(HEAD_BLOCK_INT8, block_size)
    while block > block_size and in_features % block:
        block //= 2
    return block


def parse_scheme(quantize_as: str, block_size: int = 32, symmetric: bool = True,
                 flag: str = "--block-size") -> QuantScheme:
    """`--quantize int8|int4` with its block size (given by `flag`) and symmetry, checked."""
    if quantize_as not in ("int8", "int4"):
        raise QuantizeError(f"--quantize {quantize_as!r}: choose int8 or int4")
    try:
        return QuantScheme(int(quantize_as[3:]), block_size, symmetric)
    except ValueError as e:
        raise QuantizeError(f"{flag}: {e}") from None


def quantized_target(how: str, names: tuple[str, ...], source: WeightSource, value: ir.Value | None = None) -> str | None:
    """Which layout a weight initializer made by recipe (how, names) is quantized in, if it is:
    "rows" (a weight of ours as stored, blocks along its last axis) or "interleave". A Linear's
    weight reaches the graph transposed for a MatMul, or as it is for a Gemm with transB (what
    the exporter emits on a flattened input: a shared expert's projections)."""
    if any(kept in names[0] for kept in KEPT_LINEARS):
        return None
    if how == "transpose":
        return "rows"
    if how == "interleave":
        return "interleave"
    if how == "copy" and len(source.shape(names[0])) == 3 and names[0].endswith(("w_gate", "w_up", "w_down")):
        return "rows"
    if how == "copy" and value is not None and len(source.shape(names[0])) == 2 and names[0].endswith(".weight") \
            and value.uses() and all(use.idx == 1 and is_linear_gemm(use.node) for use in value.uses()):
        return "rows"
    return None


def float_chunks(layout: str, names: tuple[str, ...], source: WeightSource, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The weight in our (…, out, in) layout, in the artifact's dtype, a row block or an expert at a time."""
    if layout == "rows":
        yield from chunks(source, names[0], dtype)
    else:
        yield from interleaved_chunks(source, names[0], names[1], dtype)


def part_chunks(part: str, layout: str, names: tuple[str, ...], source: WeightSource, dtype: torch.dtype,
                scheme: QuantScheme) -> Iterator[torch.Tensor]:
    """One part's bytes in order: codes packed per row (K is even), scales in the artifact's dtype,
    zero points (unsigned codes only) packed as ONNX packs a 4-bit tensor (flattened, across chunk
    boundaries)."""
    pending: torch.Tensor | None = None  # a zero point waiting for its byte's high nibble
    for weight in float_chunks(layout, names, source, dtype):
        try:
            q = quantize(weight, scheme)
        except ValueError as e:
            raise QuantizeError(f"weight {names[0]} cannot be quantized: {e}") from None
        if part == "codes":
            yield q.packed_codes()
        elif part == "scale":
            yield q.scale.to(dtype)
        elif scheme.bits == 8:
            yield q.zero_point
        else:
            values = q.zero_point.flatten() if pending is None else torch.cat([pending, q.zero_point.flatten()])
            even = values.numel() // 2 * 2
            pending = values[even:] if even < values.numel() else None
            yield pack(values[:even], 4)
    if pending is not None:
        yield pack(pending, 4)


def dequantized(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """What the artifact's DequantizeLinear gives for `weight`: its scale rounded to the weight's
    dtype as stored, the product rounded back to it."""
    q = quantize(weight, scheme)
    q.scale = q.scale.to(weight.dtype).float()
    return q.dequantize().to(weight.dtype)


def block_size_problem(weights: list[tuple[str, list[int]]], scheme: QuantScheme, mixed: bool = True,
                       head_block_size: int | None = None,
                       advice_from: list[tuple[str, list[int]]] | None = None) -> str | None:
    """The first of these (name, shape) weights whose input dimension its block size does not
    divide, named with the flag to change and the sizes that divide every weight that flag sets
    (those of `advice_from`, default `weights`: so the advice works for the next one too); None
    when every block fits."""
    for name, shape in weights:
        block = scheme_for(name, scheme, mixed, shape[-1], head_block_size).block_size
        if shape[-1] % block:
            head = name.endswith(LM_HEAD) and head_block_size is not None
            dims = {s[-1] for n, s in (advice_from or weights) if n.endswith(LM_HEAD) == head or not head_block_size}
            fits = [b for b in (16, 32, 64, 128, 256, 512) if all(d % b == 0 for d in dims)]
            advice = (f"choose {' or '.join(map(str, fits))}" if fits else "no block size of 16 or more divides them "
                      "all, so this model cannot be quantized in blocks: export it without --quantize")
            return (f"weight {name}: its input dimension {shape[-1]} is not a multiple of "
                    f"{'--head-block-size' if head else '--block-size'} {block}; {advice}")
    return None


def maybe_quantized(source: WeightSource) -> list[tuple[str, list[int]]]:
    """(name, shape) of every weight an export may quantize, whatever its graph: each 2-D or 3-D
    weight but the embeddings and the routers (a superset of what the rewrite quantizes: what
    a block size's advice must divide)."""
    return [(name, list(source.shape(name))) for name in source.names()
            if len(source.shape(name)) in (2, 3) and "embed" not in name
            and not any(kept in name for kept in KEPT_LINEARS)]


def surely_quantized(source: WeightSource) -> list[tuple[str, list[int]]]:
    """(name, shape) of the weights an export quantizes whatever its traced graph: of
    `maybe_quantized`, the expert stacks, the attention projections and the LM head (a tied one
    too: the rewrite quantizes it as lm_head.weight). Before tracing, `block_size_problem` on
    these refuses a block size in a second instead of after the trace (the rewrite checks every
    weight it quantizes again)."""
    experts = ("w_gate", "w_up", "w_down")
    linears = (LM_HEAD, ".attn.wq.weight", ".attn.wk.weight", ".attn.wv.weight", ".attn.wo.weight")
    return [(name, shape) for name, shape in maybe_quantized(source)
            if name.endswith(experts if len(shape) == 3 else linears)]


def rewrite_graph(graph: ir.Graph, recipes: dict, source: WeightSource, scheme: QuantScheme,
                  register: Callable[[ir.Graph, ir.Value], None], mixed: bool = True,
                  head_block_size: int | None = None) -> tuple[dict[str, int], dict[str, QuantScheme]]:
    """Replace every quantized weight initializer by DequantizeLinear over its parts (codes and
    scale, and a zero point when asymmetric), and
    their recipes; returns counts by layout and the format of each quantized tensor of ours.
    `register(graph, value)` adds an initializer to be written later. Raises QuantizeError
    naming a weight whose input dimension the block size does not divide."""
    counts = {"linear": 0, "experts": 0}
    formats: dict[str, QuantScheme] = {}
    first = next(iter(graph))
    targets = []  # (initializer, how, names, layout, shape) of every weight to quantize
    for name, (how, names) in list(recipes.items()):
        value = graph.initializers[name]
        layout = quantized_target(how, names, source, value)
        if layout is not None:
            shape = list(source.shape(names[0])) if how == "transpose" else [int(d) for d in value.shape]
            targets.append((name, how, names, layout, shape))
    if problem := block_size_problem([(t[2][0], t[4]) for t in targets], scheme, mixed, head_block_size):
        raise QuantizeError(problem)
    for name, how, names, layout, shape in targets:
        value = graph.initializers[name]
        tensor_scheme = scheme_for(names[0], scheme, mixed, shape[-1], head_block_size)
        codes_type = CODE_TYPES[(tensor_scheme.bits, tensor_scheme.signed)]
        formats.update(dict.fromkeys(names, tensor_scheme))
        blocks = [*shape[:-1], shape[-1] // tensor_scheme.block_size]
        parts = []
        layout_parts = [("codes", codes_type, shape), ("scale", value.dtype, blocks)]
        if not tensor_scheme.signed:
            layout_parts.append(("zero_point", codes_type, blocks))
        for part, dtype, part_shape in layout_parts:
            v = ir.Value(name=f"{name}.{part}", shape=ir.Shape(part_shape), type=ir.TensorType(dtype))
            register(graph, v)
            recipes[v.name] = (part, (layout, *names))
            parts.append(v)
        dq = ir.node("DequantizeLinear", parts, {"axis": len(shape) - 1, "block_size": tensor_scheme.block_size},
                     name=f"{name}/DequantizeLinear")
        out = dq.outputs[0]
        out.name, out.shape, out.type = f"{name}.dequantized", ir.Shape(shape), value.type
        new_nodes = [dq]
        if how == "transpose":  # the MatMul takes W^T
            tr = ir.node("Transpose", [out], {"perm": [1, 0]}, name=f"{name}/Transpose")
            tr.outputs[0].name, tr.outputs[0].shape, tr.outputs[0].type = f"{name}.dequantized.T", value.shape, value.type
            new_nodes.append(tr)
            out = tr.outputs[0]
        graph.insert_before(first, new_nodes)
        ir.convenience.replace_all_uses_with(value, out)
        consumer = next(iter(out.uses())).node  # the module that reads the weight owns its dequantization
        for new in new_nodes:  # (the exporter's scope metadata: layer-wise compare, the attention lowering)
            new.metadata_props.update(consumer.metadata_props)
        graph.initializers.pop(name)
        del recipes[name]
        counts["experts" if len(shape) == 3 else "linear"] += 1
    return counts, formats


class DequantizedWeights:
    """A WeightSource whose quantized tensors read as the artifact's DequantizeLinear gives them:
    the eager reference of a quantized artifact (golden outputs, compare)."""

    def __init__(self, source: WeightSource, formats: dict[str, QuantScheme], dtype: torch.dtype) -> None:
        """formats: each quantized tensor's; dtype: the artifact's, which the export quantized in."""
        self.source, self.formats, self.dtype = source, formats, dtype
        self.config = source.config

    def names(self) -> list[str]:
        return self.source.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(name)

    def tensor(self, name: str) -> torch.Tensor:
        t = self.source.tensor(name)
        return dequantized(t.to(self.dtype), self.formats[name]) if name in self.formats else t

    def experts(self, name: str) -> Iterator[torch.Tensor]:
        for t in self.source.experts(name):
            yield dequantized(t.to(self.dtype), self.formats[name]) if name in self.formats else t

    def block(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if name not in self.formats:
            return self.source.block(name, index)
        rows = self.source.block(name, index[:1])  # whole rows: blocks run along them
        return dequantized(rows.to(self.dtype), self.formats[name])[(slice(None), *index[1:])]


def reference_weights(weights: WeightSource, manifest: dict, dtype: torch.dtype) -> WeightSource:
    """The weights an artifact's eager reference runs on: as they are, or as its
    DequantizeLinear nodes give them when the manifest records a quantization."""
    q = manifest.get("quantization")
    if not q:
        return weights
    if q.get("format", 1) != QUANT_FORMAT and q["symmetric"]:  # format 1's asymmetric codes are format 2's
        raise QuantizeError(f"this artifact was quantized by an earlier moedeploy (format {q.get('format', 1)}, "
                            f"this one reads {QUANT_FORMAT}): its eager reference cannot be rebuilt; export it again")
    return DequantizedWeights(weights, manifest_formats(q), dtype)


def manifest_section(scheme: QuantScheme, mixed: bool, counts: dict[str, int],
                     formats: dict[str, QuantScheme]) -> dict:
    """The manifest's "quantization": the scheme, each quantized tensor's bits ("tensors") and,
    for those whose blocks differ from the scheme's (the LM head), their block size ("block_sizes")."""
    return {"format": QUANT_FORMAT, "bits": scheme.bits, "block_size": scheme.block_size,
            "symmetric": scheme.symmetric, "mixed": mixed and scheme.bits == 4, "weights": counts,
            "tensors": {name: f.bits for name, f in sorted(formats.items())},
            "block_sizes": {name: f.block_size for name, f in sorted(formats.items())
                            if f.block_size != scheme.block_size}}


def manifest_formats(q: dict) -> dict[str, QuantScheme]:
    """Each quantized tensor's format, from the manifest's "quantization" (manifest_section; an
    artifact written before "block_sizes" has the scheme's blocks everywhere)."""
    blocks = q.get("block_sizes", {})
    formats = {}
    for name, bits in q["tensors"].items():
        block = blocks.get(name, q["block_size"]) if isinstance(blocks, dict) else None
        if not isinstance(bits, int) or not isinstance(block, int):
            raise QuantizeError(f"the manifest's quantization section is malformed at {name!r} "
                                "(bits and block sizes are integers): export the artifact again")
        try:
            formats[name] = QuantScheme(bits, block, q.get("symmetric", True))
        except ValueError as e:
            raise QuantizeError(f"the manifest's quantization section is malformed at {name!r}: {e}; "
                                "export the artifact again") from None
    return formats
