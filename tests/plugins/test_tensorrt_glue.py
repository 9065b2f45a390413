"""The TensorRT glue, held to the contract of what our exporter emits.

TensorRT cannot be installed here, so nothing in tensorrt_plugins.py can run. Instead this
reads its decorated functions (ast, no import) and checks them against the custom nodes of
a real exported graph and against the documented `tensorrt.plugin` signatures: inputs, then
every node attribute in node order, then `outputs, stream` (impl) or `outputs, tactic`
(aot_impl) or `outputs` (autotune). With TensorRT installed, the real registration runs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch

import moedeploy.plugins.tensorrt_plugins as glue
from moedeploy.export.onnx_export import to_onnx
from moedeploy.models import RMSNorm, SparseMoE
from moedeploy.plugins.moe import ExpertActivation, Routing
from moedeploy.runtime.tensorrt import tensorrt_available

TAILS = {"register": [], "autotune": ["outputs"], "impl": ["outputs", "stream"], "aot_impl": ["outputs", "tactic"]}


def _decorated() -> dict[tuple[str, str], list[str]]:
    tree = ast.parse(Path(glue.__file__).read_text())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr in TAILS:
                    found[(dec.args[0].value, dec.func.attr)] = [a.arg for a in node.args.args]
    return found


def _custom_node(module: torch.nn.Module, x: torch.Tensor) -> onnx.NodeProto:
    model = to_onnx(module.eval(), (x,), ["x"], ["y"], ({0: "batch"},))
    return next(n for n in model.graph.node if n.domain == "moe")


@pytest.fixture(scope="module")
def nodes() -> dict[str, onnx.NodeProto]:
    return {
        "moe::RMSNorm": _custom_node(RMSNorm(16), torch.randn(3, 16)),
        "moe::MoE": _custom_node(SparseMoE(16, 24, 4, 2), torch.randn(3, 16)),
    }


def test_moe_node_order_does_not_depend_on_routing(nodes) -> None:
    """The plugin's fixed signature must fit every exported node: a node with non-default
    routing (sigmoid, group-limited, scaled, score_bias) has the same inputs and attribute order."""
    routing = Routing(2, True, "sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5)
    other = _custom_node(SparseMoE(16, 24, 4, routing, score_bias=True), torch.randn(3, 16))
    default = nodes["moe::MoE"]
    assert len(other.input) == len(default.input) == 9
    assert [a.name for a in other.attribute] == [a.name for a in default.attribute]


def test_moe_autotune_types_cover_every_io(nodes) -> None:
    """One type per I/O (9 inputs + Y); score_bias, the node's fp32 input 9, is FP32 only."""
    types = [t.strip() for t in glue._moe_io_types().split(",")]
    assert len(types) == len(nodes["moe::MoE"].input) + 1
    assert types[8] == "FP32|FP32|FP32"  # "|" pairs types by index: fp32 in each combination
    assert set(types) - {types[8]} == {"FP32|FP16|BF16"}


@pytest.mark.parametrize("plugin", ["moe::RMSNorm", "moe::MoE"])
@pytest.mark.parametrize("kind", list(TAILS))
def test_plugin_signature_matches_exported_node(plugin: str, kind: str, nodes) -> None:
    node = nodes[plugin]
    assert f"{node.domain}::{node.op_type}" == plugin  # the parser's plugin name and namespace
    attributes = [a.name for a in node.attribute if a.name != "plugin_namespace"]
    args = _decorated()[(plugin, kind)]
    n_inputs = len(node.input)
    assert len(args) == n_inputs + len(attributes) + len(TAILS[kind])
    assert args[n_inputs : n_inputs + len(attributes)] == attributes
    assert args[len(args) - len(TAILS[kind]) :] == TAILS[kind]


def test_attributes_as_tensorrt_passes_them() -> None:
    """STRING attributes arrive as NUL-terminated char arrays, floats as floats: the glue turns
    them into the op's Routing and ExpertActivation (opset "moe" 3's attributes included)."""
    routing = glue._routing(3, 0, b"softmax\x00", 4, 2, 16.0, 0.01, b"max\x00")
    assert routing == Routing(3, False, "softmax", n_group=4, topk_group=2, routed_scaling_factor=16.0,
                              group_scoring="max")
    activation = glue._activation(b"swiglu\x00", 1.702, 1.0, 7.0)
    assert activation == ExpertActivation("swiglu", activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
    assert glue._activation(b"swiglu\x00", 1.0, 0.0, float("inf")) == ExpertActivation()


def test_nodes_carry_plugin_namespace(nodes) -> None:
    for node in nodes.values():
        attrs = {a.name: a for a in node.attribute}
        assert attrs["plugin_namespace"].s == b"moe"


def test_glue_has_no_postponed_annotations() -> None:
    # tensorrt.plugin inspects real annotation objects; `from __future__ import annotations`
    # would turn them into strings.
    tree = ast.parse(Path(glue.__file__).read_text())
    futures = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    assert not futures


@pytest.mark.skipif(tensorrt_available(), reason="TensorRT is installed: the message applies only without it")
def test_build_without_tensorrt_says_so_in_one_line(tmp_path: Path, tmp_path_factory) -> None:
    import shutil

    from moedeploy.export.artifact import Artifact
    from tests.export.artifacts import ArtifactStore

    shared = ArtifactStore.for_session(tmp_path_factory).block("rmsnorm")  # the session's export, privately copied
    artifact = Artifact.load(shutil.copytree(shared.path, tmp_path / "rmsnorm", ignore=shutil.ignore_patterns("cache", "report", "engines")))
    done = subprocess.run(
        [sys.executable, "-m", "moedeploy.cli", "build", str(artifact.path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "TensorRT" in lines[0]
    assert "Traceback" not in done.stderr + done.stdout
    assert not (artifact.path / "engines").exists()


@pytest.mark.skipif(not tensorrt_available(), reason="TensorRT is not installed (it needs NVIDIA's index and a GPU)")
def test_plugins_register_with_tensorrt() -> None:
    glue.register_plugins()
    import tensorrt as trt

    names = {(c.name, c.plugin_namespace) for c in trt.get_plugin_registry().all_creators}
    assert ("RMSNorm", "moe") in names and ("MoE", "moe") in names
