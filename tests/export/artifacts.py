"""Shared by tests/export and tests/runtime: artifacts exported once per session, eager
references rebuilt independently of the exporter, and small ONNX helpers.

Each artifact is exported at most once per pytest session, whichever test directory asks
first: the store is keyed by the session's base temp folder.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from moedeploy.export import BLOCKS, export_block, export_decoder
from moedeploy.export.artifact import Artifact
from moedeploy.export.blocks import DIM, build_block
from moedeploy.export.decoder import DecoderWithPast
from moedeploy.models import MoEDecoder, preset

SEED = 0
CALIBRATION_BATCHES = 8  # the exporter's default
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Sizes unlike the export trace (blocks: batch 3 / seq 7) and the golden I/O (batch 2 / seq 16).
BLOCK_SIZES = [(1, 1), (5, 33)]


class ArtifactStore:
    """Exports on first request and hands back the same Artifact afterwards."""

    _stores: dict[str, ArtifactStore] = {}  # noqa: RUF012 (one per pytest session)

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[tuple, Artifact] = {}

    @classmethod
    def for_session(cls, tmp_path_factory: Any) -> ArtifactStore:
        base = str(tmp_path_factory.getbasetemp())
        if base not in cls._stores:
            cls._stores[base] = cls(tmp_path_factory.mktemp("artifacts"))
        return cls._stores[base]

    def block(self, name: str, dtype: str = "fp32", fold_bn: bool = True, seed: int = SEED) -> Artifact:
        key = ("block", name, dtype, fold_bn, seed)
        if key not in self._done:
            out = self.root / f"{name}-{dtype}-{'fold' if fold_bn else 'nofold'}-s{seed}"
            self._done[key] = export_block(name, out, dtype=dtype, fold_bn=fold_bn, seed=seed)
        return self._done[key]

    def decoder(self, dtype: str = "fp32") -> Artifact:
        key = ("decoder", dtype)
        if key not in self._done:
            self._done[key] = export_decoder(self.root / f"decoder-{dtype}", dtype=dtype, seed=SEED)
        return self._done[key]


# --- eager references -------------------------------------------------------------------


@torch.no_grad()
def eager_block(name: str, dtype: str = "fp32", seed: int = SEED) -> nn.Module:
    """The block as eager PyTorch computes it: seeded weights, BatchNorm EMA statistics from
    the same calibration batches the exporter draws, eval mode, and *never folded*."""
    spec = BLOCKS[name]
    module = build_block(spec, seed)
    if spec.uses_batchnorm:
        generator = torch.Generator().manual_seed(seed + 1)  # the exporter's input generator
        module.train()
        for _ in range(CALIBRATION_BATCHES):
            module(torch.randn(4, 16, DIM, generator=generator))
    return module.eval().to(TORCH_DTYPES[dtype])


def eager_decoder(dtype: str = "fp32", seed: int = SEED) -> MoEDecoder:
    """The preset decoder exactly as `export_decoder` builds it."""
    torch.manual_seed(seed)
    return MoEDecoder(preset("tiny")).eval().to(TORCH_DTYPES[dtype])


@torch.no_grad()
def decoder_inputs(
    decoder: MoEDecoder, batch: int, past_len: int, seq: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(all ids, new ids, past KV) where the past KV is eager PyTorch's cache of the first
    `past_len` ids (an empty cache for past_len 0)."""
    c = decoder.config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab_size, (batch, past_len + seq), generator=g)
    dtype = decoder.lm_head.weight.dtype
    empty = torch.zeros(batch, c.n_kv_heads, 0, c.head_dim, dtype=dtype)
    past = [(empty, empty) for _ in range(c.n_layers)]
    if past_len:
        _, past = DecoderWithPast(decoder)(ids[:, :past_len], past)
    return ids, ids[:, past_len:], past


def decoder_feed(new_ids: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, np.ndarray]:
    feed = {"input_ids": new_ids.numpy().astype(np.int64)}
    for i, (k, v) in enumerate(past):
        feed[f"past_key_values.{i}.key"] = k.numpy()
        feed[f"past_key_values.{i}.value"] = v.numpy()
    return feed


def naive_moe(
    x: torch.Tensor, logits: torch.Tensor, w_gate, w_up, w_down, b_gate, b_up, b_down,
    top_k: int, normalize_topk: bool, activation: str,
) -> torch.Tensor:
    """Token by token, in float64: softmax over all experts, top-k, optional renormalisation,
    weighted sum of the chosen experts' FFNs. Written from the op's definition, nothing shared."""
    x, logits = x.double(), logits.double()
    w_gate, w_up, w_down, b_gate, b_up, b_down = (
        None if t is None else t.double() for t in (w_gate, w_up, w_down, b_gate, b_up, b_down)
    )
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        probs = torch.exp(logits[n] - logits[n].max())
        probs = probs / probs.sum()
        chosen = sorted(range(len(probs)), key=lambda e: -float(probs[e]))[:top_k]
        weights = [float(probs[e]) for e in chosen]
        if normalize_topk:
            total = sum(weights)
            weights = [w / total for w in weights]
        for w, e in zip(weights, chosen, strict=True):
            up = w_up[e] @ x[n] + (0 if b_up is None else b_up[e])
            if activation == "swiglu":
                gate = w_gate[e] @ x[n] + (0 if b_gate is None else b_gate[e])
                hidden = gate / (1 + torch.exp(-gate)) * up
            elif activation == "relu":
                hidden = up.clamp(min=0)
            else:  # exact (erf) GELU, ONNX Gelu's and torch's default
                hidden = 0.5 * up * (1 + torch.erf(up / math.sqrt(2)))
            out[n] += w * (w_down[e] @ hidden + (0 if b_down is None else b_down[e]))
    return out


# --- ONNX / ONNX Runtime helpers ----------------------------------------------------------


def _walk(nodes) -> Iterator[onnx.NodeProto]:
    for node in nodes:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _walk(attr.g.node)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _walk(g.node)


def graph_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Nodes of the main graph and its subgraphs (not function bodies)."""
    yield from _walk(model.graph.node)


def all_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node of the main graph, its subgraphs and every model-local function."""
    yield from _walk(model.graph.node)
    for f in model.functions:
        yield from _walk(f.node)


def plain_session(model: onnx.ModelProto | str | Path) -> ort.InferenceSession:
    """A bare ONNX Runtime session: custom nodes run as their inlined function bodies."""
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


# --- one-node models calling the custom ops ------------------------------------------------

_NP_TO_ONNX = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.float16): onnx.TensorProto.FLOAT16}


def moe_weights(
    n_experts: int, dim: int, hidden: int, activation: str, bias: bool, seed: int
) -> dict[str, torch.Tensor]:
    """Stacked expert weights [E, out, in] with O(1) activations; relu/gelu experts have no
    gate: the node's (ignored) w_gate input then has w_up's shape, as the exporter emits it."""
    g = torch.Generator().manual_seed(seed)
    gate_rows = hidden
    w = {
        "w_gate": torch.randn(n_experts, gate_rows, dim, generator=g) / math.sqrt(dim),
        "w_up": torch.randn(n_experts, hidden, dim, generator=g) / math.sqrt(dim),
        "w_down": torch.randn(n_experts, dim, hidden, generator=g) / math.sqrt(hidden),
    }
    shapes = {"b_gate": (n_experts, gate_rows), "b_up": (n_experts, hidden), "b_down": (n_experts, dim)}
    for name, shape in shapes.items():
        w[name] = 0.5 * torch.randn(*shape, generator=g) if bias else torch.zeros(*shape)
    return w


def moe_node_model(
    weights: dict[str, torch.Tensor], top_k: int, normalize_topk: int, activation: str,
    dtype: np.dtype = np.float32, routing=None, score_bias: np.ndarray | None = None,
) -> onnx.ModelProto:
    """Y = moe::MoE(X[n, H], router_logits[n, E], weights as initializers), with the op's
    function body attached exactly as an exported artifact carries it. `routing` (a Routing)
    replaces top_k/normalize_topk with every routing attribute; `score_bias` the zero one."""
    from moedeploy.plugins import moe as moe_op

    elem = _NP_TO_ONNX[np.dtype(dtype)]
    n_experts, _, dim = weights["w_up"].shape
    order = ["w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"]
    inits = [onnx.numpy_helper.from_array(weights[k].numpy().astype(dtype), k) for k in order]
    # the selection-only score bias: zeros unless given (plain softmax routing), always fp32
    bias = np.zeros(n_experts, np.float32) if score_bias is None else score_bias.astype(np.float32)
    inits.append(onnx.numpy_helper.from_array(bias, "score_bias"))
    attributes = routing.attributes() if routing is not None else {"top_k": top_k, "normalize_topk": normalize_topk}
    node = onnx.helper.make_node(
        "MoE", ["X", "router_logits", *order, "score_bias"], ["Y"], domain="moe", name="moe_0",
        **attributes, activation=activation, plugin_namespace="moe",
    )
    graph = onnx.helper.make_graph(
        [node], "moe_node",
        [onnx.helper.make_tensor_value_info("X", elem, ["n", dim]),
         onnx.helper.make_tensor_value_info("router_logits", elem, ["n", n_experts])],
        [onnx.helper.make_tensor_value_info("Y", elem, ["n", dim])],
        initializer=inits,
    )
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 23), onnx.helper.make_opsetid("moe", moe_op.VERSION)],
        functions=[moe_op.function_proto()], ir_version=10,
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def rmsnorm_node_model(scale: np.ndarray, epsilon: float, dtype: np.dtype = np.float32) -> onnx.ModelProto:
    from moedeploy.plugins import rmsnorm as rmsnorm_op

    elem = _NP_TO_ONNX[np.dtype(dtype)]
    dim = scale.shape[0]
    node = onnx.helper.make_node(
        "RMSNorm", ["X", "scale"], ["Y"], domain="moe", name="norm_0",
        epsilon=epsilon, plugin_namespace="moe",
    )
    graph = onnx.helper.make_graph(
        [node], "rmsnorm_node",
        [onnx.helper.make_tensor_value_info("X", elem, ["b", "s", dim])],
        [onnx.helper.make_tensor_value_info("Y", elem, ["b", "s", dim])],
        initializer=[onnx.numpy_helper.from_array(scale.astype(dtype), "scale")],
    )
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 23), onnx.helper.make_opsetid("moe", rmsnorm_op.VERSION)],
        functions=[rmsnorm_op.function_proto()], ir_version=10,
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def rewrite_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Writes `manifest` into the artifact at `folder` sealed again, as an exporter that wrote it
    would (a buggy one, in the tests that use this): its manifest_sha256 matches the new contents."""
    import json

    from moedeploy.export.artifact import MANIFEST, sealed

    (Path(folder) / MANIFEST).write_text(json.dumps(sealed(manifest), indent=2))
