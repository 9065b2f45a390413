"""Lower the custom ops of an artifact's graph to what an ONNX Runtime provider runs fastest.

  moe::MoE      -> com.microsoft::MoE where its kernel takes the dtype and the activation on
                   that provider (fp32 on CPU): with its own router when that expresses the
                   node's (softmax top-k, with or without renormalisation), else with the
                   node's routing computed on graph ops before it ("routed": sigmoid scores,
                   selection biases, groups, scaling, sparsemixer). Otherwise the node stays
                   and ONNX Runtime inlines its dense standard-op function body
  moe::RMSNorm  -> ONNX RMSNormalization-23 where ONNX Runtime has a kernel for the dtype

The artifact on disk is never changed: lowering works on an in-memory copy.
"""

from __future__ import annotations

from typing import Literal

import onnx
import onnx_ir as ir
import onnx_ir.passes.common

from moedeploy.plugins import moe, rmsnorm

MoELowering = Literal["auto", "contrib", "function"]
#: Bump when lower_for_ort emits a different graph for the same input, so cached lowered graphs
#: of older lowerings are rebuilt (2: the contrib MoE propagates NaN/Inf rows; 3: moe opset 2's
#: routing variants stay on the function body, zero biases made by ConstantOfShape are dropped;
#: 4: moe opset 3, whose clamped SwiGLU is passed on to com.microsoft::MoE; 5: routings the
#: contrib op cannot compute run on graph ops before it instead of on the dense function body).
LOWERING_VERSION = 5
MOE_LOWERINGS = ("auto", "contrib", "function")


class LoweringError(ValueError):
    """The requested lowering cannot apply to this graph on this provider."""


def lower_for_ort(
    model: onnx.ModelProto, provider: str = "CPUExecutionProvider", moe_lowering: MoELowering = "auto"
) -> tuple[onnx.ModelProto, dict[str, int]]:
    """Returns the lowered model and counts of what was lowered to what."""
    if moe_lowering not in MOE_LOWERINGS:
        raise LoweringError(f"invalid MoE lowering {moe_lowering!r}; choose one of {MOE_LOWERINGS}")
    ir_model = ir.from_proto(model)
    graph = ir_model.graph
    counts = {"moe_contrib": 0, "moe_routed": 0, "moe_function": 0, "rmsnorm_native": 0, "rmsnorm_function": 0}
    for node in list(graph):
        if node.domain == moe.DOMAIN and node.op_type == moe.OP_TYPE:
            eligible = moe.contrib_experts_eligible(node, provider)
            if moe_lowering == "contrib" and not eligible:
                raise LoweringError(
                    f"com.microsoft::MoE on {provider} does not take node {node.name!r} "
                    f"({node.inputs[0].dtype}); use --moe-lowering auto or function"
                )
            if eligible and moe_lowering != "function":
                routed = not moe.contrib_eligible(node, provider)
                moe.lower_to_contrib(graph, node, routed=routed)
                counts["moe_routed" if routed else "moe_contrib"] += 1
            else:
                counts["moe_function"] += 1
        elif node.domain == rmsnorm.DOMAIN and node.op_type == rmsnorm.OP_TYPE:
            if _elem_type(node.inputs[0]) in rmsnorm.ORT_NATIVE_DTYPES:
                rmsnorm.lower_to_native(graph, node)
                counts["rmsnorm_native"] += 1
            else:
                counts["rmsnorm_function"] += 1
    # Nodes left without a consumer (the strided Slices of an interleaved expert weight that
    # com.microsoft::MoE now reads whole) go, so ONNX Runtime never folds them into copies.
    ir.passes.common.RemoveUnusedNodesPass()(ir_model)
    return ir.to_proto(ir_model), counts


def _elem_type(value: ir.Value) -> int:
    return int(value.dtype) if value.dtype is not None else onnx.TensorProto.UNDEFINED
