"""The `moe::RMSNorm` op: every facet of it in one place.

Eager semantics (Llama / Mixtral): normalise in fp32, cast back to the input dtype, then
apply the weight, so fp16/bf16 models round exactly where Hugging Face rounds.

ONNX: `moe::RMSNorm(X, scale) -> Y`, attribute `epsilon`, plus `plugin_namespace="moe"` so
TensorRT picks our plugin over the function body. The function body is ONNX
`RMSNormalization`-23 (axis -1, fp32 stash), which TensorRT >= 10.15 and ONNX Runtime
(float, double, float16 on CPU) run natively.
"""

from __future__ import annotations

import onnx
import onnxscript
import torch
from onnxscript import opset23 as op

DOMAIN = "moe"
OP_TYPE = "RMSNorm"
#: The "moe" domain's opset version, shared with moe::MoE (which added routing variants in 2,
#: group scoring and the clamped SwiGLU in 3; RMSNorm is unchanged since 1). One model imports
#: one version per domain.
VERSION = 3
PLUGIN_NAMESPACE = "moe"


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, accumulated in fp32."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def output_spec(x: torch.Tensor) -> tuple[torch.dtype, tuple]:
    """The shape function: Y has X's shape and dtype."""
    return x.dtype, tuple(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The op as the models call it: eager math, or one `moe::RMSNorm` node under ONNX export."""
    if torch.onnx.is_in_onnx_export():
        dtype, shape = output_spec(x)
        return torch.onnx.ops.symbolic(
            f"{DOMAIN}::{OP_TYPE}",
            (x, weight.to(x.dtype)),
            {"epsilon": float(eps), "plugin_namespace": PLUGIN_NAMESPACE},
            dtype=dtype,
            shape=shape,
            version=VERSION,
        )
    return rms_norm_reference(x, weight, eps)


_opset = onnxscript.values.Opset(DOMAIN, VERSION)


@onnxscript.script(_opset, default_opset=op)
def RMSNorm(X, scale, epsilon: float = 1e-5):
    return op.RMSNormalization(X, scale, axis=-1, epsilon=epsilon, stash_type=1)


def function_proto() -> onnx.FunctionProto:
    """The standard-op body attached to every exported model (imports ai.onnx 23)."""
    return RMSNorm.to_function_proto()


# ONNX Runtime: RMSNormalization-23 kernels exist for these element types (CPU).
ORT_NATIVE_DTYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16}


def residual_add(node):
    """The Add whose sum this RMSNorm normalises, when it adds two same-shaped graph values (a
    residual stream plus a sublayer's output): the pair SkipSimplifiedLayerNormalization fuses.
    None when the input comes from anything else, or the shapes are not both known and equal."""
    add = node.inputs[0].producer() if node.inputs[0] is not None else None
    if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2:
        return None
    a, b = add.inputs
    if a is None or b is None or a.const_value is not None or b.const_value is not None:
        return None
    if a.shape is None or b.shape is None or len(a.shape) != 3 or list(a.shape) != list(b.shape):
        return None
    return add


def lower_to_skip(graph, node, add) -> None:
    """Replace `add` and the RMSNorm after it by one com.microsoft::SkipSimplifiedLayerNormalization
    (ONNX Runtime's fused residual add + RMSNorm): its 4th output is the sum, which every other
    consumer of the Add (the next residual) reads instead."""
    import onnx_ir as ir

    eps = node.attributes["epsilon"].as_float() if "epsilon" in node.attributes else 1e-5
    fused = ir.node("SkipSimplifiedLayerNormalization", [add.inputs[0], add.inputs[1], node.inputs[1]],
                    {"epsilon": eps}, domain="com.microsoft", num_outputs=4, name=f"{node.name}/skip")
    normed, _mean, _inv_std, total = fused.outputs
    names = node.outputs[0].name, add.outputs[0].name
    graph.insert_before(add, fused)
    add.outputs[0].replace_all_uses_with(total, replace_graph_outputs=True)
    node.outputs[0].replace_all_uses_with(normed, replace_graph_outputs=True)
    graph.remove([node, add], safe=True)
    normed.name, total.name = names  # downstream tools (layer-wise compare) look values up by name
    normed.shape, normed.type = node.outputs[0].shape, node.outputs[0].type
    total.shape, total.type = add.outputs[0].shape, add.outputs[0].type  # the next fusion matches on it
    _mean.name, _inv_std.name = f"{fused.name}:mean", f"{fused.name}:inv_std"


def lower_to_native(graph, node) -> None:
    """Replace one moe::RMSNorm node by ONNX RMSNormalization-23, in place (onnx_ir graph)."""
    import onnx_ir as ir

    eps = node.attributes["epsilon"].as_float() if "epsilon" in node.attributes else 1e-5
    native = ir.node(
        "RMSNormalization", list(node.inputs), {"axis": -1, "epsilon": eps, "stash_type": 1}
    )
    name = node.outputs[0].name
    ir.convenience.replace_nodes_and_values(
        graph, node, [node], [native], [node.outputs[0]], [native.outputs[0]]
    )
    native.outputs[0].name = name  # downstream tools (layer-wise compare) look values up by name
