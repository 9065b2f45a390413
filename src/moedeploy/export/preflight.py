"""Pre-flight checks that need no GPU: will TensorRT's ONNX parser take this artifact?

The graph checked is the one `build_engine` hands the parser: the artifact's, through the
TensorRT lowering (runtime/tensorrt_lowering.py). The parser's published operator support
matrix (onnx-tensorrt docs/operators.md, kept as data in `moedeploy/data/tensorrt_onnx_ops.json`)
says which standard ops it imports; the restrictions that our graphs can actually hit, and
those of the layers NVIDIA's operator documentation states (Dequantize), are checked on the
node itself. Each custom
node is claimed by its plugin (plugin_namespace="moe" makes the parser prefer the plugin
over the function body), so its function body is never parsed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources

import onnx

from moedeploy.export.artifact import Artifact
from moedeploy.runtime.tensorrt_lowering import lower_for_tensorrt

PLUGIN_IMPLEMENTATIONS = {
    ("moe", "RMSNorm"): "plugin moe::RMSNorm (AOT rms_norm_kernel | JIT kernels.rms_norm)",
    ("moe", "MoE"): "plugin moe::MoE (AOT moe_fused_kernel | JIT grouped kernels.moe)",
    ("moe", "MoENBits"): "plugin moe::MoENBits (AOT moe_fused_nbits_kernel | JIT grouped kernels.moe, "
                         "int8/int4 codes dequantized in registers)",
}
TOPK_MAX = 3840  # "K input must be less than 3840"
#: The AOT MoE kernel's outputs per program (kernels/moe_fused.FUSED_BLOCKS["BLOCK_H"]; a test ties
#: the two: this module needs no Triton). Each program computes its token's whole expert hidden
#: vector, so a token's gate/up weights are read once per this many outputs.
AOT_MOE_BLOCK_H = 256
#: From this many reads of a token's gate/up weights on, `aot_moe_note` says to build --jit
AOT_MOE_REREADS_NOTED = 4


def support_matrix() -> dict:
    text = resources.files("moedeploy.data").joinpath("tensorrt_onnx_ops.json").read_text()
    return json.loads(text)


@dataclass
class NodeFinding:
    node: str
    op: str
    verdict: str  # "plugin" | "unsupported" | "restricted"
    detail: str


@dataclass
class PreflightReport:
    target: str
    tensorrt_version: str
    source: str
    findings: list[NodeFinding] = field(default_factory=list)
    op_counts: dict[str, int] = field(default_factory=dict)
    #: what the TensorRT lowering rewrote before the check (runtime/tensorrt_lowering.py)
    lowering: dict[str, int] = field(default_factory=dict)
    #: what builds but would run slowly (`aot_moe_note`)
    notes: list[str] = field(default_factory=list)

    @property
    def blocking(self) -> list[NodeFinding]:
        return [f for f in self.findings if f.verdict in ("unsupported", "restricted")]

    @property
    def plugins(self) -> list[NodeFinding]:
        return [f for f in self.findings if f.verdict == "plugin"]

    @property
    def ok(self) -> bool:
        return not self.blocking


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    values = list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in values if v.type.tensor_type.HasField("shape")}
    return ranks | {i.name: len(i.dims) for i in model.graph.initializer}


def _const_int(model: onnx.ModelProto, name: str) -> int | None:
    for init in model.graph.initializer:
        if init.name == name:
            values = onnx.numpy_helper.to_array(init).ravel()
            return int(values[0]) if values.size == 1 else None
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            values = onnx.numpy_helper.to_array(node.attribute[0].t).ravel()
            return int(values[0]) if values.size == 1 else None
    return None


def _restriction(model: onnx.ModelProto, node: onnx.NodeProto, ranks: dict[str, int], ops: dict | None = None,
                 initializer_types: dict[str, int] | None = None) -> str | None:
    """The documented restrictions our exported graphs could run into."""
    if node.op_type == "DequantizeLinear" and ops is not None:
        return _dequantize_restriction(node, ranks, ops, initializer_types or {})
    if node.op_type == "Attention":
        if len(node.input) > 3 and node.input[3] and ranks.get(node.input[3], 4) != 4:
            return f"attn_mask has rank {ranks[node.input[3]]}; TensorRT takes only 4-D masks"
        if any(len(node.input) > i and node.input[i] for i in (4, 5, 6)):
            return "past_key / past_value / nonpad_kv_seqlen inputs are unsupported"
        if any(len(node.output) > i and node.output[i] for i in (1, 2, 3)):
            return "present_key / present_value / qk_matmul_output outputs are unsupported"
    if node.op_type == "TopK" and len(node.input) > 1:
        k = _const_int(model, node.input[1])
        if k is not None and k >= TOPK_MAX:
            return f"K = {k}; TensorRT needs K < {TOPK_MAX}"
    return None


def _dequantize_restriction(node: onnx.NodeProto, ranks: dict[str, int], ops: dict,
                            initializer_types: dict[str, int]) -> str | None:
    """A quantized artifact's DequantizeLinear against TensorRT's Dequantize layer (NVIDIA's
    operator documentation): signed INT8/INT4 (or FP8/FP4) codes, a zero point of 0 if any, and
    scales that are a scalar, per channel (1-D), or blocked (INT4 only, rank 2)."""
    allowed = ops.get("DequantizeLinear", {}).get("types", [])
    elem = initializer_types.get(node.input[0])
    name = onnx.TensorProto.DataType.Name(elem) if elem is not None else None
    if name is not None and name not in allowed:
        return (f"its codes are {name}; TensorRT's DequantizeLinear takes {', '.join(allowed)} with a zero point of 0: "
                "export again with --symmetric (the default), which writes signed codes (an --asymmetric export "
                "has unsigned ones, and so has one from before moedeploy's quantization format 2)")
    if len(node.input) > 2 and node.input[2]:
        return "it has a zero-point input; TensorRT takes none but zeros: export with --symmetric (the default)"
    block = next((a.i for a in node.attribute if a.name == "block_size"), 0)
    if block:
        rank = ranks.get(node.input[0])
        why = ("moedeploy's TensorRT lowering rewrites blocked INT8, and rank-3 INT4, only when the node's "
               "codes and scales are its own and blocked along their last axis")
        if name == "INT8":
            return f"INT8 codes with blocked scales (TensorRT's Dequantize takes INT8 per tensor or per channel); {why}"
        if rank is not None and rank != 2:
            return f"blocked scales on a rank-{rank} tensor (TensorRT's Dequantize blocks rank 2 only); {why}"
    return None


def aot_moe_note(artifact: Artifact) -> str | None:
    """Why an AOT engine of this decoder would be slow, if it would: TensorRT launches one kernel
    per AOT plugin, and moe::MoE's (kernels/moe_fused) gives each program one token and
    AOT_MOE_BLOCK_H outputs, so it reads the token's gate/up weights hidden / AOT_MOE_BLOCK_H
    times, on that few programs. Measured at Mixtral-8x7B's size on an H100 (benchmarks/README.md):
    73 ms a token, against 0.33 ms for the JIT plugin's grouped kernels."""
    if artifact.kind != "decoder":
        return None
    hidden = int(artifact.manifest["config"]["hidden_size"])
    rereads = -(-hidden // AOT_MOE_BLOCK_H)
    if rereads < AOT_MOE_REREADS_NOTED:
        return None
    return (f"the AOT moe::MoE plugin is one fused kernel, which reads each token's gate/up expert weights "
            f"{rereads} times at hidden size {hidden} (once per {AOT_MOE_BLOCK_H} outputs); at Mixtral-8x7B's size it "
            "took 73 ms a token on an H100, against 0.33 ms for the JIT plugin's kernels. Build with --jit "
            "(Python at run time) for speed; the AOT plan suits small models and engines run without Python")


def check_tensorrt(artifact: Artifact | str, experts_on_codes: bool = True) -> PreflightReport:
    """Every node of the artifact's graph, as `build_engine` with the same `experts_on_codes`
    hands it to the parser, against TensorRT's ONNX parser support matrix."""
    artifact = artifact if isinstance(artifact, Artifact) else Artifact.load(artifact)
    onnx.checker.check_model(str(artifact.model_path), full_check=True)  # by path: any size
    model = onnx.load(str(artifact.model_path), load_external_data=False)  # the graph, not the weights
    model, lowering = lower_for_tensorrt(model, experts_on_codes)  # what build_engine hands the parser
    matrix = support_matrix()
    ops = matrix["operators"]
    report = PreflightReport("trt", matrix["tensorrt_version"], matrix["source"], lowering=lowering)
    if note := aot_moe_note(artifact):
        report.notes.append(note)
    ranks = _ranks(model)
    initializer_types = {i.name: i.data_type for i in model.graph.initializer}
    for node in model.graph.node:
        key = (node.domain, node.op_type)
        label = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
        report.op_counts[label] = report.op_counts.get(label, 0) + 1
        name = node.name or node.output[0]
        if key in PLUGIN_IMPLEMENTATIONS:
            namespace = next((a.s.decode() for a in node.attribute if a.name == "plugin_namespace"), "")
            detail = PLUGIN_IMPLEMENTATIONS[key]
            if namespace != node.domain:
                report.findings.append(NodeFinding(name, label, "restricted", "no plugin_namespace attribute: the parser would inline the function body instead of using the plugin"))
            else:
                report.findings.append(NodeFinding(name, label, "plugin", detail))
        elif node.domain not in ("", "ai.onnx"):
            report.findings.append(NodeFinding(name, label, "unsupported", f"domain {node.domain!r} has no TensorRT importer"))
        elif not ops.get(node.op_type, {}).get("supported", False):
            why = ops.get(node.op_type, {}).get("restrictions") or "not in the support matrix"
            report.findings.append(NodeFinding(name, label, "unsupported", why))
        elif (problem := _restriction(model, node, ranks, ops, initializer_types)) is not None:
            report.findings.append(NodeFinding(name, label, "restricted", problem))
    return report
