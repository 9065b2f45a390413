"""moe::MoE on com.microsoft::MoE with every expert cut into pieces (plugins/moe_split.py),
against the eager op: piece counts that divide the expert hidden size, token counts from one
(a decode step) to many, an exact tie at the k-th place, non-finite tokens; that ONNX Runtime
reads the re-laid weights in place (no second copy); and what it leaves to other lowerings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from moedeploy.plugins import moe as moe_op
from moedeploy.plugins import moe_split
from moedeploy.plugins.moe import Routing
from moedeploy.runtime.lowering import lower_for_ort
from moedeploy.runtime.ort import EXTERNAL_DATA_FOLDER, load_lowered
from tests.export.artifacts import moe_node_model, moe_weights

E, H, I = 8, 16, 24  # noqa: E741
CPU = "CPUExecutionProvider"


def streamed_model(folder: Path, w: dict, routing: Routing) -> onnx.ModelProto:
    """The one-node model as a streamed export writes its experts: gate and up interleaved in
    one (E, 2I, H) stack that two strided Slices read, every weight in model.onnx.data."""
    model = moe_node_model(w, 0, 0, "swiglu", routing=routing)
    graph = model.graph
    fused = torch.stack([w["w_gate"], w["w_up"]], dim=2).reshape(E, 2 * I, H)
    keep = [t for t in graph.initializer if t.name not in ("w_gate", "w_up")]
    del graph.initializer[:]
    graph.initializer.extend([*keep, onnx.numpy_helper.from_array(fused.numpy(), "w_gate_up")])
    for name, start in (("w_gate", 0), ("w_up", 1)):
        consts = [onnx.numpy_helper.from_array(np.array([v], np.int64), f"{name}_{what}")
                  for what, v in (("start", start), ("end", 2 * I), ("axis", 1), ("step", 2))]
        graph.initializer.extend(consts)
        graph.node.insert(0, onnx.helper.make_node("Slice", ["w_gate_up", *(c.name for c in consts)], [name]))
    model = onnx.shape_inference.infer_shapes(model)  # the Slices' (E, I, H), as the exporter records them
    onnx.save(model, folder / "model.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=1024)  # the stacks; biases stay inline, as exported
    return onnx.load(folder / "model.onnx", load_external_data=False)


def split_session(folder: Path, model: onnx.ModelProto, pieces: int) -> tuple[ort.InferenceSession, dict, list]:
    """What runtime.ort.create_session does for a decoder: lower, then load with the placeholders
    supplied; also the arrays and OrtValues the session holds."""
    lowered, counts = lower_for_ort(model, CPU, "auto", weights_dir=str(folder), expert_pieces=pieces)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry(EXTERNAL_DATA_FOLDER, str(folder))
    session = load_lowered(lowered, options, folder)
    return session, counts, session.moedeploy_owned_weights


def eager(x: torch.Tensor, logits: torch.Tensor, w: dict, routing: Routing) -> np.ndarray:
    return moe_op.moe_reference(x, logits, w["w_gate"], w["w_up"], w["w_down"], routing).numpy()


def inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, H, generator=g), torch.randn(tokens, E, generator=g)


@pytest.mark.parametrize("pieces", [2, 3, 4])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_split_experts_match_eager(tmp_path: Path, pieces: int, tokens: int) -> None:
    w = moe_weights(E, H, I, "swiglu", False, seed=31)
    routing = Routing(2, True)
    session, counts, _ = split_session(tmp_path, streamed_model(tmp_path, w, routing), pieces)
    assert counts["moe_split"] == 1 and counts["moe_experts"] == counts["moe_contrib"] == 0
    x, logits = inputs(tokens, seed=tokens)
    (y,) = session.run(None, {"X": x.numpy(), "router_logits": logits.numpy()})
    np.testing.assert_allclose(y, eager(x, logits, w, routing), rtol=1e-5, atol=1e-5)


def test_the_graph_cuts_each_expert_into_pieces_piece_major(tmp_path: Path) -> None:
    w = moe_weights(E, H, I, "swiglu", False, seed=32)
    lowered, _ = lower_for_ort(streamed_model(tmp_path, w, Routing(2, True)), CPU, "auto", weights_dir=str(tmp_path),
                               expert_pieces=3)
    moe = next(n for n in lowered.graph.node if n.op_type == "MoE")
    assert moe.domain == "com.microsoft"
    assert {a.name: onnx.helper.get_attribute_value(a) for a in moe.attribute}["k"] == 2 * 3
    shapes = {t.name: list(t.dims) for t in moe_split.placeholders(lowered)}
    assert shapes == {moe.input[2]: [3 * E, 2 * I // 3, H], moe.input[4]: [3 * E, H, I // 3]}
    owned = moe_split.supply(lowered, tmp_path, ort.SessionOptions())
    supplied = {t.name: array for t, array in zip(moe_split.placeholders(lowered), owned[::2], strict=True)}
    fc1, fc2 = supplied[moe.input[2]], supplied[moe.input[4]]
    gate_up = torch.stack([w["w_gate"], w["w_up"]], dim=2).reshape(E, 2 * I, H).numpy()
    for piece in range(3):  # virtual expert piece * E + e: rows / columns piece * I/3.. of expert e
        for e in range(E):
            rows = slice(piece * 2 * I // 3, (piece + 1) * 2 * I // 3)
            np.testing.assert_array_equal(fc1[piece * E + e], gate_up[e, rows])
            cols = slice(piece * I // 3, (piece + 1) * I // 3)
            np.testing.assert_array_equal(fc2[piece * E + e], w["w_down"][e][:, cols].numpy())
    assert fc1.ctypes.data % 4096 == 0 and fc2.ctypes.data % 4096 == 0


def test_an_exact_tie_at_the_kth_place_takes_one_experts_pieces(tmp_path: Path) -> None:
    """Logits duplicated as they are would let the op's sort pick pieces of both tied experts;
    the masked logits leave exactly the k experts TopK chose (the lower index, as the op)."""
    w = moe_weights(E, H, I, "swiglu", False, seed=33)
    routing = Routing(2, True)
    session, _, _ = split_session(tmp_path, streamed_model(tmp_path, w, routing), 2)
    x, logits = inputs(3, seed=34)
    logits[:, 3] = 4.0  # the first choice everywhere
    logits[:, 1] = logits[:, 6] = 2.0  # tied for the second place
    (y,) = session.run(None, {"X": x.numpy(), "router_logits": logits.numpy()})
    expected = eager(x, logits, w, routing)
    only_lower = moe_op.moe_reference(x, logits.index_fill(1, torch.tensor([6]), -1e9), w["w_gate"], w["w_up"],
                                      w["w_down"], routing).numpy()
    np.testing.assert_allclose(expected, only_lower, rtol=1e-6, atol=1e-6)  # eager took expert 1, not 6
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_logits_one_ulp_apart_take_the_expert_the_eager_op_takes(tmp_path: Path) -> None:
    """Two logits 1 ulp apart whose softmax rounds to one value: the eager op takes the lower
    index (top-k over the softmax), and so must the split, though the other logit is larger."""
    w = moe_weights(E, H, I, "swiglu", False, seed=41)
    routing = Routing(1, True)
    session, _, _ = split_session(tmp_path, streamed_model(tmp_path, w, routing), 2)
    x, logits = inputs(2, seed=42)
    logits[:] = -2.0
    logits[:, 2] = 0.1
    logits[:, 5] = float(np.nextafter(np.float32(0.1), np.float32(1.0)))
    probs = torch.softmax(logits, dim=-1)
    assert logits[0, 5] > logits[0, 2] and probs[0, 5] == probs[0, 2]  # the near-tie this is about
    (y,) = session.run(None, {"X": x.numpy(), "router_logits": logits.numpy()})
    expected = eager(x, logits, w, routing)
    expert_2 = moe_op.moe_reference(x, logits.index_fill(1, torch.tensor([5]), -9.0), w["w_gate"], w["w_up"],
                                    w["w_down"], routing).numpy()
    np.testing.assert_allclose(expected, expert_2, rtol=1e-6, atol=1e-6)  # eager took expert 2
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_non_finite_tokens_come_out_nan_as_in_eager(tmp_path: Path) -> None:
    w = moe_weights(E, H, I, "swiglu", False, seed=35)
    routing = Routing(2, True)
    session, _, _ = split_session(tmp_path, streamed_model(tmp_path, w, routing), 2)
    x, logits = inputs(4, seed=36)
    x[1, 0] = float("nan")
    logits[2, 5] = float("inf")
    (y,) = session.run(None, {"X": x.numpy(), "router_logits": logits.numpy()})
    expected = eager(x, logits, w, routing)
    assert np.isnan(expected[1]).all() and np.isnan(expected[2]).all()
    np.testing.assert_array_equal(np.isnan(y), np.isnan(expected))
    np.testing.assert_allclose(y[[0, 3]], expected[[0, 3]], rtol=1e-5, atol=1e-5)


def test_onnx_runtime_reads_the_supplied_arrays_in_place(tmp_path: Path) -> None:
    """The session holds no copy of the re-laid experts: zeroing the arrays `supply` returned
    zeroes the op's output (only the NaN guard's graph is left)."""
    w = moe_weights(E, H, I, "swiglu", False, seed=37)
    session, _, owned = split_session(tmp_path, streamed_model(tmp_path, w, Routing(2, True)), 2)
    x, logits = inputs(2, seed=38)
    feed = {"X": x.numpy(), "router_logits": logits.numpy()}
    assert np.abs(session.run(None, feed)[0]).max() > 0.1
    for array in owned[::2]:
        array[...] = 0
    np.testing.assert_array_equal(session.run(None, feed)[0], 0)


@pytest.mark.parametrize("case", ["one-thread", "not-renormalised", "biases", "sigmoid", "inline-weights", "fp16",
                                  "relu"])
def test_what_it_leaves_to_the_other_lowerings(tmp_path: Path, case: str) -> None:
    routing = {"not-renormalised": Routing(2, False), "sigmoid": Routing(2, True, "sigmoid")}.get(case, Routing(2, True))
    activation = "relu" if case == "relu" else "swiglu"
    w = moe_weights(E, H, I, activation, case == "biases", seed=39)
    if case in ("inline-weights", "fp16", "relu"):  # not a streamed export's stacks in the data file
        model = moe_node_model(w, 0, 0, activation, np.float16 if case == "fp16" else np.float32, routing=routing)
    else:
        model = streamed_model(tmp_path, w, routing)
    node = ir.from_proto(model).graph.node(-1)
    assert node.op_type == "MoE"
    assert moe_split.pieces_for(node, CPU, 1 if case == "one-thread" else 2) == 1
    if case == "one-thread":
        assert moe_split.pieces_for(node, CPU, 2) == 2  # the same node with two threads
        assert moe_split.pieces_for(node, "CUDAExecutionProvider", 2) == 1
    _, counts = lower_for_ort(model, CPU, "auto", weights_dir=str(tmp_path), expert_pieces=2 if case != "one-thread" else 1)
    assert counts["moe_split"] == 0


def test_pieces_divide_the_expert_hidden_size(tmp_path: Path) -> None:
    node = ir.from_proto(streamed_model(tmp_path, moe_weights(E, H, I, "swiglu", False, seed=40),
                                        Routing(2, True))).graph.node(-1)
    assert [moe_split.pieces_for(node, CPU, t) for t in (2, 3, 4, 5, 7, 16)] == [2, 3, 4, 4, 6, 12]  # I = 24


def test_a_lowered_graph_saved_as_a_file_gets_its_placeholders_filled(tmp_path: Path) -> None:
    """load_lowered given a path (a graph someone saved after lowering) supplies the re-laid
    experts as it does for bytes; before, ONNX Runtime read the placeholders' stored bytes, in
    the stacks' own layout, as pieces: the right size and the wrong numbers."""
    w = moe_weights(E, H, I, "swiglu", False, seed=41)
    routing = Routing(2, True)
    lowered, counts = lower_for_ort(streamed_model(tmp_path, w, routing), CPU, "auto", weights_dir=str(tmp_path),
                                    expert_pieces=2)
    assert counts["moe_split"] == 1 and moe_split.placeholders(lowered)
    onnx.save(lowered, tmp_path / "lowered.onnx")  # beside model.onnx.data, which its weights name
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = load_lowered(str(tmp_path / "lowered.onnx"), options, tmp_path)
    assert session.moedeploy_owned_weights
    x, logits = inputs(5, seed=42)
    (y,) = session.run(None, {"X": x.numpy(), "router_logits": logits.numpy()})
    np.testing.assert_allclose(y, eager(x, logits, w, routing), rtol=1e-5, atol=1e-5)


def test_a_stack_shorter_in_the_file_than_its_shape_is_refused_not_read_past(tmp_path: Path) -> None:
    """A graph whose record of a stack's bytes is shorter than its shape needs (an inconsistent
    model.onnx): the split refuses it when it reads the stack, and an expert's view into it (the
    native kernel's, the If per expert's) when it is made: a later expert's would read the next
    tensor's bytes."""
    from moedeploy.runtime.quantized import constant_view

    w = moe_weights(E, H, I, "swiglu", False, seed=43)
    model = streamed_model(tmp_path, w, Routing(2, True))
    stack = next(t for t in model.graph.initializer if t.name == "w_down")
    entries = {e.key: e for e in stack.external_data}
    entries["length"].value = str(4 * E * H * I - 4)
    with pytest.raises(ValueError, match=rf"its source is {4 * E * H * I - 4} bytes, not the {4 * E * H * I}"):
        split_session(tmp_path, model, 2)
    value = ir.Value(name="w_down", shape=ir.Shape([E, H, I]), type=ir.TensorType(ir.DataType.FLOAT),
                     const_value=ir.ExternalTensor("model.onnx.data", 0, 4 * E * H * I - 4, ir.DataType.FLOAT,
                                                   shape=ir.Shape([E, H, I]), name="w_down", base_dir=tmp_path))
    first = constant_view(value, 0, ir.DataType.FLOAT, [H, I], "w_down.expert0").const_value
    assert (first.offset, first.length) == (0, 4 * H * I)
    with pytest.raises(ValueError, match=rf"w_down: the data file holds {4 * E * H * I - 4} bytes of it, but part "
                                         rf"{E - 1} ends at byte {4 * E * H * I}"):
        constant_view(value, E - 1, ir.DataType.FLOAT, [H, I], "w_down.expert7")
