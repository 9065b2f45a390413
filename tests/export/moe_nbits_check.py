"""One check shared by the quantized-export tests: a lowered moe::MoENBits node, run the way the
TensorRT plugin runs it, against ONNX Runtime on the artifact's own moe::MoE node."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import external_data_helper, helper, numpy_helper

from moedeploy.export.artifact import Artifact
from moedeploy.models.blockquant import QuantScheme
from moedeploy.plugins import moe_nbits
from moedeploy.plugins.moe import ExpertActivation, Routing


def assert_plugin_matches_artifact(artifact: Artifact, lowered: onnx.ModelProto, feed: dict[str, np.ndarray],
                                   atol: float = 2e-5) -> dict:
    """Every moe::MoENBits node of `lowered` (the artifact's TensorRT lowering): its inputs, the
    codes and scales read back from the re-typed initializers and the activations, biases and
    selection bias ONNX Runtime computes for the artifact's moe::MoE node of the same name on
    `feed` (its DequantizeLinear, Slice and function body), run through `moe_nbits.run`: the JIT
    plugin's grouped kernels and the fused kernel the AOT plugin compiles (compiled on a GPU,
    under Triton's interpreter elsewhere), equal that node's output. Returns the first node's
    attributes."""
    model = onnx.load(str(artifact.model_path), load_external_data=False)
    nodes = [n for n in lowered.graph.node if n.op_type == moe_nbits.OP_TYPE]
    assert nodes
    checked = [_assert_node_matches(artifact, model, lowered, node, feed, atol) for node in nodes]
    return checked[0]


def _assert_node_matches(artifact: Artifact, model: onnx.ModelProto, lowered: onnx.ModelProto, node: onnx.NodeProto,
                         feed: dict[str, np.ndarray], atol: float) -> dict:
    source = next(n for n in model.graph.node if n.op_type == "MoE" and n.name == node.name)
    initializers = {i.name: i for i in lowered.graph.initializer}
    computed = [name for name in [*source.input, source.output[0]] if name and name not in initializers]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_empty_tensor_value_info(v) for v in computed)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(artifact.path))
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    values = dict(zip(computed, session.run(computed, feed), strict=True))

    def value(name: str) -> torch.Tensor:
        if name in values:
            return torch.from_numpy(values[name].copy())
        tensor = onnx.TensorProto()
        tensor.CopyFrom(initializers[name])
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            external_data_helper.load_external_data_for_tensor(tensor, str(artifact.path))
        return torch.from_numpy(numpy_helper.to_array(tensor).copy())

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    scheme = QuantScheme(attrs["bits"], attrs["block_size"], bool(attrs["symmetric"]))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = [value(name).to(device) for name in node.input]
    expected = torch.from_numpy(values[source.output[0]])
    assert expected.abs().max() > 0.1  # a real output, not zeros
    routing, activation = Routing.from_attributes(attrs), ExpertActivation.from_attributes(attrs)
    for fused in (False, True):
        actual = moe_nbits.run(inputs, routing, activation, scheme, interleaved=bool(attrs["interleaved"]), fused=fused)
        torch.testing.assert_close(actual.cpu(), expected, atol=atol, rtol=atol)
    return attrs
