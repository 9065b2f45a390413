"""Layer-wise localisation: where along the network does a backend start to diverge?

The torch exporter records each ONNX node's PyTorch module path (metadata
`pkg.torch.onnx.name_scopes`). A module's output in the graph is the last value produced
inside its scope that is used outside it, with the shape PyTorch's forward hook saw. We
expose those values as extra graph outputs, run the backend once, and compare each with
the hooked eager output, in execution order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import torch

from moedeploy.compare.metrics import error_stats
from moedeploy.export.artifact import Artifact, to_numpy
from moedeploy.export.decoder import WRAPPER_PREFIX
from moedeploy.export.onnx_export import name_scopes
from moedeploy.export.reference import load_reference
from moedeploy.models.moe import SparseMoE


@dataclass
class ModuleResult:
    module: str  # PyTorch module name, e.g. "layers.3.ffn"
    layer: str  # the top-level unit it belongs to, e.g. "layers.3"
    stats: dict


def display_name(module: str) -> str:
    return module[len(WRAPPER_PREFIX):] if module.startswith(WRAPPER_PREFIX) else module


def layer_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]


def tracked_modules(module: torch.nn.Module, kind: str) -> list[str]:
    """Module names worth localising to: decoder layers and their parts, or a block's children."""
    names = []
    for name, _ in module.named_modules():
        if not name:
            continue
        shown = display_name(name) if kind == "decoder" else name
        depth = len(shown.split("."))
        if kind == "decoder":
            if name == "decoder" or name.startswith("decoder.rope"):
                continue
            if shown.startswith("layers.") and depth > 3:
                continue
            if not shown.startswith("layers.") and depth > 1:
                continue
        elif depth > 2:
            continue
        names.append(name)
    return names


def escaping_values(model: onnx.ModelProto, modules: list[str]) -> dict[str, list[str]]:
    """For each module, the values its nodes produce that are used outside it, in graph order."""
    nodes = list(model.graph.node)
    scopes = [set(name_scopes(n)) for n in nodes]
    graph_outputs = {o.name for o in model.graph.output}
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node.input:
            consumers.setdefault(name, []).append(i)
    wanted = set(modules)
    found: dict[str, list[str]] = {m: [] for m in modules}
    for i, node in enumerate(nodes):
        for module in scopes[i] & wanted:
            for value in node.output:
                users = consumers.get(value, [])
                if value in graph_outputs or any(module not in scopes[j] for j in users):
                    found[module].append(value)
    return found


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    types = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.value_info}
    existing = {o.name for o in model.graph.output}
    for name in names:
        if name not in existing and name in types:
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, types[name], None))
            existing.add(name)
    return model


def _hook_outputs(module: torch.nn.Module, names: list[str], run) -> dict[str, np.ndarray]:
    captured: dict[str, np.ndarray] = {}
    handles = []
    for name in names:
        def hook(_m, _args, out, name=name):
            # Only single-tensor outputs: a tuple (RoPE's cos, sin) has no one graph value to match.
            if isinstance(out, torch.Tensor):
                captured[name] = to_numpy(out)
        handles.append(module.get_submodule(name).register_forward_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return captured  # insertion order = execution order


def localize(
    artifact: Artifact, feed: dict[str, np.ndarray], atol: float, rtol: float, moe_lowering: str = "auto"
) -> dict:
    """Compare every tracked module's output on ONNX Runtime with eager PyTorch for one feed."""
    import onnxruntime as ort

    from moedeploy.runtime.lowering import lower_for_ort
    from moedeploy.runtime.ort import session_options
    from moedeploy.runtime.runners import TorchRunner

    reference = load_reference(artifact)
    # A Linear that absorbed a folded BatchNorm computes Linear+BN in the graph: its eager
    # output (before BN) has no counterpart, and neither has the BatchNorm itself.
    folding = (artifact.manifest["config"].get("batchnorm_folding") or {}) if artifact.kind == "block" else {}
    folded = set(folding.get("into_linear", {})) | set(folding.get("into_linear", {}).values())
    modules = [m for m in tracked_modules(reference, artifact.kind) if m not in folded]
    # Each MoE's router logits too: top-k routing is discontinuous, so a near-tie that rounds
    # differently sends a token to other experts. Counting those tokens tells a routing flip
    # (inherent to reduced precision) from an error in the experts' arithmetic.
    moes = {name: m for name, m in reference.named_modules() if isinstance(m, SparseMoE) and name in modules}
    routers = [f"{name}.router" for name in moes]
    runner = TorchRunner(artifact, module_loader=lambda: reference)

    def run_torch() -> None:
        with runner:
            runner.infer(feed, check_inputs=False)

    eager = _hook_outputs(reference, modules + routers, run_torch)
    original = onnx.load(str(artifact.model_path))
    candidates = escaping_values(original, list(eager))
    lowered, _ = lower_for_ort(original, moe_lowering=moe_lowering)
    lowered = _with_outputs(lowered, sorted({v for vs in candidates.values() for v in vs}))
    session = ort.InferenceSession(lowered.SerializeToString(), session_options())
    names = [o.name for o in session.get_outputs()]
    graph_values = dict(zip(names, session.run(names, feed), strict=True))

    def graph_value(module: str, expected: np.ndarray) -> np.ndarray | None:
        match = [v for v in candidates.get(module, []) if v in graph_values and graph_values[v].shape == expected.shape]
        return graph_values[match[-1]] if match else None  # None: folded away or fused beyond recognition

    results: list[ModuleResult] = []
    for module, expected in eager.items():
        actual = graph_value(module, expected)
        if module in routers or actual is None:
            continue
        shown = display_name(module) if artifact.kind == "decoder" else module
        stats = error_stats(expected, actual, atol, rtol)
        router = f"{module}.router"
        if module in moes and router in eager and (logits := graph_value(router, eager[router])) is not None:
            stats["routing_flips"] = routing_flips(eager[router], logits, moes[module].top_k)
            stats["routed_tokens"] = int(eager[router].shape[0])
            stats["router_logits_passed"] = bool(error_stats(eager[router], logits, atol, rtol)["passed"])
        results.append(ModuleResult(shown, layer_of(shown), stats))
    first = next((r for r in results if not r.stats["passed"]), None)
    return {
        "modules": [{"module": r.module, "layer": r.layer, **r.stats} for r in results],
        "first_divergent_layer": first.layer if first else None,
        "first_divergent_module": first.module if first else None,
        # flips with agreeing router logits are rounding near-ties; with disagreeing ones, the router is wrong
        "first_divergent_routing_flips": first.stats.get("routing_flips")
        if first and first.stats.get("router_logits_passed") else None,
    }


def routing_flips(reference_logits: np.ndarray, actual_logits: np.ndarray, top_k: int) -> int:
    """Tokens whose set of top-k experts differs between the two backends' router logits."""
    ref = np.sort(np.argsort(-reference_logits.astype(np.float64), axis=-1, kind="stable")[:, :top_k], axis=-1)
    act = np.sort(np.argsort(-actual_logits.astype(np.float64), axis=-1, kind="stable")[:, :top_k], axis=-1)
    return int((ref != act).any(axis=-1).sum())
