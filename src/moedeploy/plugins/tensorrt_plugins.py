"""TensorRT plugins for moe::RMSNorm and moe::MoE through `tensorrt.plugin` (TensorRT >= 10.9).

Glue only, written to NVIDIA's documented API (quickly_deployable_plugins sample): the
math lives in the Triton kernels of `moedeploy.plugins.kernels`, tested on CPU.

  register   output descriptor (same shape and dtype as X)
  autotune   FP32 | FP16 | BF16 combinations, LINEAR layout
  impl       JIT: launches the Triton kernels on TensorRT's stream (needs Python at run time)
  aot_impl   AOT: one compiled Triton kernel (PTX) + launch parameters, so the engine runs
             without Python (trtexec, Triton Inference Server). Each plugin gets exactly one
             kernel, so MoE uses the single fused kernel (kernels/moe_fused.py).

Plugin ids are "moe::RMSNorm" / "moe::MoE" / "moe::MoENBits" (moe::MoE over int8/int4 codes,
the node the TensorRT lowering gives a quantized artifact's experts: plugins/moe_nbits.py): the
ONNX parser maps a node with op_type RMSNorm and attribute plugin_namespace="moe" to them. Attribute names and order match
the ONNX nodes (TensorRT passes every registered attribute to aot_impl, in order).

This module deliberately has no `from __future__ import annotations`: tensorrt.plugin
validates the real annotation objects of every decorated function.
"""

from typing import TYPE_CHECKING, List, Tuple, Union

if TYPE_CHECKING:
    from moedeploy.models.blockquant import QuantScheme

_REGISTERED = False
_DTYPES = None  # trt.DataType -> kernel dtype name, filled on registration


def register_plugins() -> None:
    """Register both plugins with TensorRT's plugin registry (idempotent). Needs TensorRT."""
    global _REGISTERED, _DTYPES
    if _REGISTERED:
        return
    from moedeploy.runtime.tensorrt import require_tensorrt

    trt = require_tensorrt()
    import tensorrt.plugin as trtp

    _DTYPES = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}
    _register_rms_norm(trt, trtp)
    _register_moe(trt, trtp)
    _register_moe_nbits(trt, trtp)
    _REGISTERED = True


def _torch(tensor):
    """A torch view of a TensorRT plugin tensor (JIT path). bf16 has no __cuda_array_interface__."""
    import torch

    return torch.as_tensor(tensor, device="cuda")


def _attr_str(value) -> str:
    # The ONNX parser passes STRING attributes as char arrays ending in NUL.
    text = value.decode() if isinstance(value, bytes) else str(value)
    return text.rstrip("\x00")


def _static(expr, name: str) -> int:
    if expr.is_fake or not expr.is_constant:
        raise ValueError(f"moe::MoE and moe::MoENBits need a build-time constant {name} (the expert weights' shape)")
    return int(expr.constant_value())


def _register_rms_norm(trt, trtp) -> None:
    @trtp.register("moe::RMSNorm")
    def rms_norm_desc(X: trtp.TensorDesc, scale: trtp.TensorDesc, epsilon: float) -> Tuple[trtp.TensorDesc]:
        return (X.like(),)

    @trtp.autotune("moe::RMSNorm")
    def rms_norm_autotune(
        X: trtp.TensorDesc, scale: trtp.TensorDesc, epsilon: float, outputs: Tuple[trtp.TensorDesc]
    ) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination("FP32|FP16|BF16, FP32|FP16|BF16, FP32|FP16|BF16", "LINEAR")]

    @trtp.impl("moe::RMSNorm")
    def rms_norm_impl(
        X: trtp.Tensor, scale: trtp.Tensor, epsilon: float, outputs: Tuple[trtp.Tensor], stream: int
    ) -> None:
        import torch

        from moedeploy.plugins.kernels import rms_norm

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            rms_norm(_torch(X), _torch(scale), epsilon, out=_torch(outputs[0]))

    @trtp.aot_impl("moe::RMSNorm")
    def rms_norm_aot_impl(
        X: trtp.TensorDesc, scale: trtp.TensorDesc, epsilon: float, outputs: Tuple[trtp.TensorDesc], tactic: int
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        from moedeploy.plugins.kernels.aot import compile_rms_norm

        kernel = compile_rms_norm(_DTYPES[X.dtype], epsilon)
        hidden = X.shape_expr[X.ndim - 1]
        params = trtp.KernelLaunchParams()
        params.grid_x = X.shape_expr.numel() // hidden  # one program per row
        params.block_x = kernel.num_warps * 32
        params.shared_mem = kernel.shared
        # rms_norm_kernel(X, W, stride_x, stride_y, H, Y): rows are contiguous
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(hidden)] * 3)
        return kernel.name.encode(), kernel.ptx.encode(), params, extra


def _routing(top_k, normalize_topk, scoring, n_group, topk_group, routed_scaling_factor, jitter_eps, group_scoring):
    """The node's routing attributes (as TensorRT passes them) as a Routing."""
    from moedeploy.plugins.moe import Routing

    return Routing(
        int(top_k), bool(normalize_topk), _attr_str(scoring), int(n_group), int(topk_group),
        float(routed_scaling_factor), float(jitter_eps), _attr_str(group_scoring),
    )


def _activation(activation, activation_alpha, activation_beta, swiglu_limit):
    """The node's activation attributes (as TensorRT passes them) as an ExpertActivation."""
    from moedeploy.plugins.moe import ExpertActivation

    return ExpertActivation(
        _attr_str(activation), float(activation_alpha), float(activation_beta), float(swiglu_limit)
    )


FLOATS = ("FP32", "FP16", "BF16")


def _fixed(dtype: str) -> str:
    """A type that stays `dtype` in each of the float combinations ("|" pairs them by index)."""
    return "|".join([dtype] * len(FLOATS))


def _moe_io_types() -> str:
    """moe::MoE's type combinations: X, router_logits, the weights and biases and the output
    share one float type; score_bias (input 9) is always FP32."""
    same = "|".join(FLOATS)
    return ", ".join([same] * 8 + [_fixed("FP32"), same])  # 9 inputs + 1 output


def _moe_nbits_io_types() -> str:
    """moe::MoENBits' type combinations: as moe::MoE's, each stack's codes and zero points INT8
    bytes and its scales in the float type (plugins/moe_nbits.py)."""
    same = "|".join(FLOATS)
    stack = [_fixed("INT8"), same, _fixed("INT8")]
    return ", ".join([same] * 2 + stack * 3 + [same] * 3 + [_fixed("FP32"), same])  # 15 inputs + 1 output


def _scheme(bits, block_size, symmetric) -> "QuantScheme":
    """The node's bits, block_size and symmetric attributes as a QuantScheme (checked there)."""
    from moedeploy.models.blockquant import QuantScheme

    return QuantScheme(int(bits), int(block_size), bool(symmetric))


def _register_moe(trt, trtp) -> None:
    # Inputs and attributes in the moe::MoE node's order (opset "moe" version 3): TensorRT's
    # ONNX parser passes the node's attributes in that order (plugin_namespace is its own).
    @trtp.register("moe::MoE")
    def moe_desc(
        X: trtp.TensorDesc, router_logits: trtp.TensorDesc, w_gate: trtp.TensorDesc, w_up: trtp.TensorDesc,
        w_down: trtp.TensorDesc, b_gate: trtp.TensorDesc, b_up: trtp.TensorDesc, b_down: trtp.TensorDesc,
        score_bias: trtp.TensorDesc,
        top_k: int, normalize_topk: int, scoring: str, n_group: int, topk_group: int,
        routed_scaling_factor: float, jitter_eps: float, group_scoring: str,
        activation: str, activation_alpha: float, activation_beta: float, swiglu_limit: float,
    ) -> Tuple[trtp.TensorDesc]:
        return (X.like(),)

    @trtp.autotune("moe::MoE")
    def moe_autotune(
        X: trtp.TensorDesc, router_logits: trtp.TensorDesc, w_gate: trtp.TensorDesc, w_up: trtp.TensorDesc,
        w_down: trtp.TensorDesc, b_gate: trtp.TensorDesc, b_up: trtp.TensorDesc, b_down: trtp.TensorDesc,
        score_bias: trtp.TensorDesc,
        top_k: int, normalize_topk: int, scoring: str, n_group: int, topk_group: int,
        routed_scaling_factor: float, jitter_eps: float, group_scoring: str,
        activation: str, activation_alpha: float, activation_beta: float, swiglu_limit: float, outputs: Tuple[trtp.TensorDesc],
    ) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(_moe_io_types(), "LINEAR")]

    @trtp.impl("moe::MoE")
    def moe_impl(
        X: trtp.Tensor, router_logits: trtp.Tensor, w_gate: trtp.Tensor, w_up: trtp.Tensor,
        w_down: trtp.Tensor, b_gate: trtp.Tensor, b_up: trtp.Tensor, b_down: trtp.Tensor,
        score_bias: trtp.Tensor,
        top_k: int, normalize_topk: int, scoring: str, n_group: int, topk_group: int,
        routed_scaling_factor: float, jitter_eps: float, group_scoring: str,
        activation: str, activation_alpha: float, activation_beta: float, swiglu_limit: float,
        outputs: Tuple[trtp.Tensor], stream: int,
    ) -> None:
        import torch

        from moedeploy.plugins.kernels import moe

        act = _activation(activation, activation_alpha, activation_beta, swiglu_limit)
        gated = act.activation == "swiglu"
        routing = _routing(
            top_k, normalize_topk, scoring, n_group, topk_group, routed_scaling_factor, jitter_eps, group_scoring
        )
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            tensors = [_torch(t) for t in (X, router_logits, w_gate, w_up, w_down, b_gate, b_up, b_down, score_bias)]
            x, logits, wg, wu, wd, bg, bu, bd, sb = tensors
            moe(x, logits, wg if gated else None, wu, wd, routing, activation=act,
                b_gate=bg if gated else None, b_up=bu, b_down=bd, score_bias=sb, out=_torch(outputs[0]))

    @trtp.aot_impl("moe::MoE")
    def moe_aot_impl(
        X: trtp.TensorDesc, router_logits: trtp.TensorDesc, w_gate: trtp.TensorDesc, w_up: trtp.TensorDesc,
        w_down: trtp.TensorDesc, b_gate: trtp.TensorDesc, b_up: trtp.TensorDesc, b_down: trtp.TensorDesc,
        score_bias: trtp.TensorDesc,
        top_k: int, normalize_topk: int, scoring: str, n_group: int, topk_group: int,
        routed_scaling_factor: float, jitter_eps: float, group_scoring: str,
        activation: str, activation_alpha: float, activation_beta: float, swiglu_limit: float,
        outputs: Tuple[trtp.TensorDesc], tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        from moedeploy.plugins.kernels.aot import compile_moe_fused

        n_experts = _static(w_up.shape_expr[0], "number of experts")
        routing = _routing(
            top_k, normalize_topk, scoring, n_group, topk_group, routed_scaling_factor, jitter_eps, group_scoring
        )
        act = _activation(activation, activation_alpha, activation_beta, swiglu_limit)
        kernel = compile_moe_fused(_DTYPES[X.dtype], routing, activation=act, n_experts=n_experts)
        # moe_fused_kernel(X, LOGITS, WG, WU, WD, BG, BU, BD, SCORE_BIAS, H, I, E, Y): TensorRT
        # passes the 9 input pointers, then these int32 scalars, then the output pointer.
        return _fused_launch(kernel, X, _static(w_down.shape_expr[2], "intermediate size"), n_experts)


def _register_moe_nbits(trt, trtp) -> None:
    # Inputs and attributes in the node's order (plugins/moe_nbits.py): moe::MoE's attributes,
    # then bits, block_size, symmetric, interleaved.
    @trtp.register("moe::MoENBits")
    def moe_nbits_desc(
        X: trtp.TensorDesc, router_logits: trtp.TensorDesc,
        w_gate: trtp.TensorDesc, s_gate: trtp.TensorDesc, z_gate: trtp.TensorDesc,
        w_up: trtp.TensorDesc, s_up: trtp.TensorDesc, z_up: trtp.TensorDesc,
        w_down: trtp.TensorDesc, s_down: trtp.TensorDesc, z_down: trtp.TensorDesc,
        b_gate: trtp.TensorDesc, b_up: trtp.TensorDesc, b_down: trtp.TensorDesc, score_bias: trtp.TensorDesc,
        top_k: int, normalize_topk: int, scoring: str, n_group: int, topk_group: int,
        routed_scaling_factor: float, jitter_eps: float, group_scoring: str,
        activation: str, activation_alpha: float, activation_beta: float, swiglu_limit: float,
        bits: int, block_size: int, symmetric: int, interleaved: int,
    ) -> Tuple[trtp.TensorDesc]:
        return (X.like(),)

    @trtp.autotune("moe::MoENBits")
    def moe_nbits_autotune(
        X: trtp.TensorDesc, router_logits: trtp.TensorDesc,
        w_gate: trtp.TensorDesc, s_gate: trtp.TensorDesc, z_gate: trtp.TensorDesc,
        w_up: trtp.TensorDesc, s_up: trtp.TensorDesc, z_up: trtp.TensorDesc,
        w_down: trtp.TensorDesc, s_down: trtp.TensorDesc, z_down: trtp.TensorDesc,
        b_gate: trtp.TensorDesc, b_up: trtp.TensorDesc, b_down: trtp.TensorDesc, score_bias: trtp.TensorDesc,
        top_k: int, normalize_topk: int, scoring: str, n_group: int, topk_group: int,
        routed_scaling_factor: float, jitter_eps: float, group_scoring: str,
        activation: str, activation_alpha: float, activation_beta: float, swiglu_limit: float,
        bits: int, block_size: int, symmetric: int, interleaved: int, outputs: Tuple[trtp.TensorDesc],
    ) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(_moe_nbits_io_types(), "LINEAR")]

    @trtp.impl("moe::MoENBits")
    def moe_nbits_impl(
        X: trtp.Tensor, router_logits: trtp.Tensor,
        w_gate: trtp.Tensor, s_gate: trtp.Tensor, z_gate: trtp.Tensor,
        w_up: trtp.Tensor, s_up: trtp.Tensor, z_up: trtp.Tensor,
        w_down: trtp.Tensor, s_down: trtp.Tensor, z_down: trtp.Tensor,
        b_gate: trtp.Tensor, b_up: trtp.Tensor, b_down: trtp.Tensor, score_bias: trtp.Tensor,
        top_k: int, normalize_topk: int, scoring: str, n_group: int, topk_group: int,
        routed_scaling_factor: float, jitter_eps: float, group_scoring: str,
        activation: str, activation_alpha: float, activation_beta: float, swiglu_limit: float,
        bits: int, block_size: int, symmetric: int, interleaved: int, outputs: Tuple[trtp.Tensor], stream: int,
    ) -> None:
        import torch

        from moedeploy.plugins import moe_nbits

        routing = _routing(
            top_k, normalize_topk, scoring, n_group, topk_group, routed_scaling_factor, jitter_eps, group_scoring
        )
        act = _activation(activation, activation_alpha, activation_beta, swiglu_limit)
        inputs = (X, router_logits, w_gate, s_gate, z_gate, w_up, s_up, z_up, w_down, s_down, z_down,
                  b_gate, b_up, b_down, score_bias)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            moe_nbits.run([_torch(t) for t in inputs], routing, act, _scheme(bits, block_size, symmetric),
                          interleaved=bool(interleaved), out=_torch(outputs[0]))

    @trtp.aot_impl("moe::MoENBits")
    def moe_nbits_aot_impl(
        X: trtp.TensorDesc, router_logits: trtp.TensorDesc,
        w_gate: trtp.TensorDesc, s_gate: trtp.TensorDesc, z_gate: trtp.TensorDesc,
        w_up: trtp.TensorDesc, s_up: trtp.TensorDesc, z_up: trtp.TensorDesc,
        w_down: trtp.TensorDesc, s_down: trtp.TensorDesc, z_down: trtp.TensorDesc,
        b_gate: trtp.TensorDesc, b_up: trtp.TensorDesc, b_down: trtp.TensorDesc, score_bias: trtp.TensorDesc,
        top_k: int, normalize_topk: int, scoring: str, n_group: int, topk_group: int,
        routed_scaling_factor: float, jitter_eps: float, group_scoring: str,
        activation: str, activation_alpha: float, activation_beta: float, swiglu_limit: float,
        bits: int, block_size: int, symmetric: int, interleaved: int, outputs: Tuple[trtp.TensorDesc], tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        from moedeploy.plugins.kernels.aot import compile_moe_fused

        n_experts = _static(w_up.shape_expr[0], "number of experts")
        routing = _routing(
            top_k, normalize_topk, scoring, n_group, topk_group, routed_scaling_factor, jitter_eps, group_scoring
        )
        act = _activation(activation, activation_alpha, activation_beta, swiglu_limit)
        kernel = compile_moe_fused(_DTYPES[X.dtype], routing, activation=act, n_experts=n_experts,
                                   quantized=_scheme(bits, block_size, symmetric), interleaved=bool(interleaved))
        # moe_fused_nbits_kernel(X, LOGITS, WG, SG, ZG, WU, SU, ZU, WD, SD, ZD, BG, BU, BD,
        # SCORE_BIAS, H, I, E, Y): the 15 input pointers in the node's order, then the scalars
        # (I from the down stack's scales: one per block of I), then the output
        inter = _static(s_down.shape_expr[2], "intermediate size") * int(block_size)
        return _fused_launch(kernel, X, inter, n_experts)


def _fused_launch(kernel, X, inter: int, n_experts: int) -> tuple:
    """Launch parameters of moe_fused_kernel / moe_fused_nbits_kernel: one program per token and
    output tile; after the input pointers the int32 scalars H, I, E (I and E static: the
    expert weights are the graph's constants)."""
    import tensorrt.plugin as trtp

    from moedeploy.plugins.kernels.moe_fused import FUSED_BLOCKS

    hidden = X.shape_expr[1]
    params = trtp.KernelLaunchParams()
    params.grid_x = X.shape_expr[0]  # one program per token ...
    params.grid_y = trtp.cdiv(hidden, FUSED_BLOCKS["BLOCK_H"])  # ... and output tile
    params.block_x = kernel.num_warps * 32
    params.shared_mem = kernel.shared
    extra = trtp.SymIntExprs.from_tuple(
        [trtp.SymInt32(hidden), trtp.SymInt32(inter), trtp.SymInt32(n_experts)]
    )
    return kernel.name.encode(), kernel.ptx.encode(), params, extra


__all__ = ["register_plugins"]
