"""Layer-wise localisation: where along the network does a backend start to diverge?

The torch exporter records each ONNX node's PyTorch module path (metadata
`pkg.torch.onnx.name_scopes`). A module's output in the graph is the last value produced
inside its scope that is used outside it, with the shape PyTorch's forward hook saw. We
expose those values as extra graph outputs, run the backend once, and compare each with
the hooked eager output, in execution order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import onnx
import torch

from moedeploy.compare.metrics import error_stats
from moedeploy.export.artifact import Artifact, to_numpy
from moedeploy.export.decoder import WRAPPER_PREFIX
from moedeploy.export.onnx_export import name_scopes
from moedeploy.export.reference import load_reference
from moedeploy.models.moe import SparseMoE
from moedeploy.plugins.moe import Routing, route


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
    artifact: Artifact, feed: dict[str, np.ndarray], atol: float, rtol: float, moe_lowering: str = "auto",
    reference: torch.nn.Module | None = None,
) -> dict:
    """Compare every tracked module's output on ONNX Runtime with eager PyTorch for one feed.

    `reference`: the eager module (default: rebuilt from the artifact), so a caller that has
    built it once, or from a moved checkpoint, compares with the same one.
    """

    from moedeploy.runtime.lowering import lower_for_ort
    from moedeploy.runtime.ort import (
        decoder_config,
        load_lowered,
        reads_weights_from,
        session_moe,
        session_options,
    )
    from moedeploy.runtime.runners import TorchRunner

    reference = reference if reference is not None else load_reference(artifact)
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

    # A reference streamed from a checkpoint (layered_decoder) holds a layer's weights only
    # while that layer runs, so each MoE's selection bias is read during the run, not after.
    score_biases: dict[str, np.ndarray] = {}

    def keep_score_bias(module: SparseMoE, _args, _out, name: str) -> None:
        if module.score_bias is not None:
            score_biases[name] = module.score_bias.detach().float().cpu().numpy().copy()

    def run_torch() -> None:
        handles = [m.register_forward_hook(partial(keep_score_bias, name=n)) for n, m in moes.items()]
        try:
            with runner:
                runner.infer(feed, check_inputs=False)
        finally:
            for handle in handles:
                handle.remove()

    eager = _hook_outputs(reference, modules + routers, run_torch)
    original = onnx.load(str(artifact.model_path), load_external_data=False)  # weights stay on disk
    candidates = escaping_values(original, list(eager))
    # the lowering the backend's session runs, experts cut into pieces where its session cuts them
    session_lowering, pieces = session_moe("CPUExecutionProvider", None, moe_lowering, artifact)
    lowered, _ = lower_for_ort(original, moe_lowering=session_lowering, config=decoder_config(artifact),
                               expert_pieces=pieces)
    lowered = _with_outputs(lowered, sorted({v for vs in candidates.values() for v in vs}))
    session = load_lowered(lowered, reads_weights_from(session_options(), artifact), artifact.path)
    names = [o.name for o in session.get_outputs()]
    graph_values = dict(zip(names, session.run(names, feed), strict=True))

    def graph_value(module: str, expected: np.ndarray) -> np.ndarray | None:
        match = [v for v in candidates.get(module, []) if v in graph_values and graph_values[v].shape == expected.shape]
        return graph_values[match[-1]] if match else None  # None: folded away or fused beyond recognition

    results: list[ModuleResult] = []
    out_of_tolerance: list[tuple[int, set[int]] | None] = []  # (tokens, those out of tolerance)
    for module, expected in eager.items():
        actual = graph_value(module, expected)
        if module in routers or actual is None:
            continue
        shown = display_name(module) if artifact.kind == "decoder" else module
        stats = error_stats(expected, actual, atol, rtol)
        router = f"{module}.router"
        if module in moes and router in eager and (logits := graph_value(router, eager[router])) is not None:
            flipped = flipped_tokens(eager[router], logits, moes[module].routing, score_biases.get(module))
            stats["routing_flips"] = len(flipped)
            stats["routed_tokens"] = int(eager[router].shape[0])
            stats["router_logits_passed"] = bool(error_stats(eager[router], logits, atol, rtol)["passed"])
            stats["flipped_tokens"] = flipped
        results.append(ModuleResult(shown, layer_of(shown), stats))
        tokens = int(np.prod(expected.shape[:-1])) if expected.ndim else 1
        out_of_tolerance.append(None if stats["passed"] else (tokens, tokens_out_of_tolerance(expected, actual, atol, rtol)))
    index = next((i for i, r in enumerate(results) if not r.stats["passed"]), None)
    first = results[index] if index is not None else None
    explained = routing_explanation(results[: index + 1], *out_of_tolerance[index]) if index is not None else None
    return {
        "modules": [{"module": r.module, "layer": r.layer, **r.stats} for r in results],
        "first_divergent_layer": first.layer if first else None,
        "first_divergent_module": first.module if first else None,
        "first_divergent_routing_flips": explained[0] if explained else None,
        "first_divergent_routing_modules": explained[1] if explained else None,
    }


def flipped_tokens(
    reference_logits: np.ndarray, actual_logits: np.ndarray, top_k: int | Routing, score_bias: np.ndarray | None = None,
) -> list[int]:
    """Tokens (rows) whose set of chosen experts differs between the two backends' router logits.

    The choice is the MoE's own (`top_k` a Routing: sigmoid scores, a selection bias, groups,
    sparsemixer), or plain top-k of the logits for an int.
    """
    def chosen(logits: np.ndarray) -> np.ndarray:
        if isinstance(top_k, int):
            return np.argsort(-logits.astype(np.float64), axis=-1, kind="stable")[:, :top_k]
        bias = None if score_bias is None else torch.as_tensor(score_bias, dtype=torch.float32)
        return route(torch.as_tensor(logits, dtype=torch.float32), top_k, score_bias=bias)[1].numpy()

    ref, act = np.sort(chosen(reference_logits), axis=-1), np.sort(chosen(actual_logits), axis=-1)
    return [int(t) for t in np.flatnonzero((ref != act).any(axis=-1))]


def routing_flips(reference_logits: np.ndarray, actual_logits: np.ndarray, top_k: int) -> int:
    """How many tokens take a different set of top-k experts on the two backends."""
    return len(flipped_tokens(reference_logits, actual_logits, top_k))


def tokens_out_of_tolerance(expected: np.ndarray, actual: np.ndarray, atol: float, rtol: float) -> set[int]:
    """Tokens (rows over the last axis, the order an MoE routes them in) with any element out of tolerance."""
    ref = np.asarray(expected, dtype=np.float64)
    act = np.asarray(actual, dtype=np.float64)
    bad = ~(np.abs(act - ref) <= atol + rtol * np.abs(ref))  # NaN counts as out of tolerance
    return {int(t) for t in np.flatnonzero(bad.reshape(-1, ref.shape[-1]).any(axis=-1))} if ref.ndim else set()


def routing_explanation(
    upto_first: list[ModuleResult], tokens: int, bad_tokens: set[int]
) -> tuple[int, list[str]] | None:
    """(tokens, MoE modules) when routing near-ties account for the first divergence, else None.

    `upto_first` runs in execution order and ends with the first module out of tolerance,
    whose output has `tokens` rows of which `bad_tokens` are out of tolerance. Its divergence
    is a rounding near-tie, not an error, only when every one of those tokens took another
    top-k expert set, there or upstream, in an MoE that routes the same tokens and whose
    router logits agree within tolerance (disagreeing logits mean the router itself computes
    something else). A token that drifted for any other reason leaves it unexplained.
    """
    if not bad_tokens:
        return None
    near_ties = {
        r.module: set(r.stats["flipped_tokens"]) & bad_tokens
        for r in upto_first
        if r.stats.get("router_logits_passed") and r.stats.get("flipped_tokens") and r.stats["routed_tokens"] == tokens
    }
    covered = set().union(*near_ties.values()) if near_ties else set()
    if not bad_tokens <= covered:
        return None
    return len(bad_tokens), [module for module, hit in near_ties.items() if hit]
