"""Three ways ONNX Runtime can run a MoE layer at decode time, on the same weights.

  contrib          com.microsoft::MoE. Its CPU kernel runs each expert's GEMMs with MLAS on a
                   transposed, unpacked weight, one expert per thread, the experts split
                   between threads by index (so both of a token's experts may land on one
                   thread).
  split            com.microsoft::MoE over every expert cut into one piece per thread,
                   piece-major, so that thread j runs piece j of whichever experts a token
                   takes (plugins/moe_split.py, the default lowering with 2+ threads). Here
                   with the logits repeated as they are: this script has no exact ties.
  if-per-expert    one ONNX If per expert, taken when any token routes to it, whose branch
                   holds that expert's SwiGLU as plain MatMuls on its own initializers
                   (which ONNX Runtime prepacks at session creation, as for any MatMul). An
                   untaken branch costs only the If. Every selected expert runs on all the
                   step's tokens, its output masked by the routing weight, so this pays only
                   for a few tokens: it is a decode path, not a prefill one.

Eight distinct layers at the `small` preset's sizes (hidden 512, expert hidden 1024, 8
experts, top-2) run back to back, so the 100 MB of expert weights a token touches stream from
DRAM. Both graphs get the same routing; their outputs are checked equal before timing.
This is a measurement for the decode-speed work, not a lowering moedeploy emits.

    python benchmarks/moe_decode_paths.py [--threads 2] [--repeat 30] [--tokens 1 4 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

H, I, E, K, LAYERS = 512, 1024, 8, 2, 8  # noqa: E741


def session(model, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = threads, 1, 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def contrib_model(weights):
    nodes, initializers, x = [], [], "x"
    for layer, (w1, w3, w2) in enumerate(weights):
        fc1 = np.stack([w1, w3], axis=2).reshape(E, 2 * I, H)  # gate and up rows interleaved
        initializers += [numpy_helper.from_array(fc1, f"fc1_{layer}"), numpy_helper.from_array(w2, f"fc2_{layer}")]
        nodes.append(helper.make_node("MoE", [x, f"logits_{layer}", f"fc1_{layer}", "", f"fc2_{layer}"], [f"m{layer}"],
                                      domain="com.microsoft", k=K, activation_type="swiglu", swiglu_fusion=1,
                                      normalize_routing_weights=1))
        nodes.append(helper.make_node("Add", [x, f"m{layer}"], [f"y{layer}"]))  # the residual, as in a decoder
        x = f"y{layer}"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", H])]
    inputs += [helper.make_tensor_value_info(f"logits_{i}", TensorProto.FLOAT, ["n", E]) for i in range(LAYERS)]
    graph = helper.make_graph(nodes, "contrib", inputs, [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["n", H])],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def split_model(weights, pieces: int):
    """contrib_model with each expert cut into `pieces` along its hidden dimension, piece-major
    (virtual expert j*E + e is piece j of expert e); the logits repeated `pieces` times, k
    times `pieces`, and the output times `pieces` (each piece gets its expert's weight / pieces)."""
    nodes, initializers, x = [], [], "x"
    scale = numpy_helper.from_array(np.array(pieces, np.float32), "pieces")
    for layer, (w1, w3, w2) in enumerate(weights):
        cut = [slice(j * I // pieces, (j + 1) * I // pieces) for j in range(pieces)]
        fc1 = np.concatenate([np.stack([w1[:, c], w3[:, c]], axis=2).reshape(E, 2 * I // pieces, H) for c in cut])
        fc2 = np.ascontiguousarray(np.concatenate([w2[:, :, c] for c in cut]))
        initializers += [numpy_helper.from_array(fc1, f"fc1_{layer}"), numpy_helper.from_array(fc2, f"fc2_{layer}")]
        nodes += [helper.make_node("Concat", [f"logits_{layer}"] * pieces, [f"repeated_{layer}"], axis=1),
                  helper.make_node("MoE", [x, f"repeated_{layer}", f"fc1_{layer}", "", f"fc2_{layer}"], [f"m{layer}"],
                                   domain="com.microsoft", k=K * pieces, activation_type="swiglu", swiglu_fusion=1,
                                   normalize_routing_weights=1),
                  helper.make_node("Mul", [f"m{layer}", "pieces"], [f"s{layer}"]),
                  helper.make_node("Add", [x, f"s{layer}"], [f"y{layer}"])]
        x = f"y{layer}"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", H])]
    inputs += [helper.make_tensor_value_info(f"logits_{i}", TensorProto.FLOAT, ["n", E]) for i in range(LAYERS)]
    graph = helper.make_graph(nodes, "split", inputs, [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["n", H])],
                              [scale, *initializers])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def if_per_expert_model(weights):
    """Inputs: x and each layer's dense routing weights (n, E), zero off each token's top-k."""
    nodes, x = [], "x"
    shared = [numpy_helper.from_array(np.array(0, np.float32), "zero")]
    shared += [numpy_helper.from_array(np.array([e], np.int64), f"expert{e}") for e in range(E)]
    for layer, (w1, w3, w2) in enumerate(weights):
        outs = []
        for e in range(E):
            p = f"l{layer}e{e}_"
            branch = [
                helper.make_node("MatMul", [x, p + "w1"], [p + "g"]),
                helper.make_node("MatMul", [x, p + "w3"], [p + "u"]),
                helper.make_node("Sigmoid", [p + "g"], [p + "sg"]),
                helper.make_node("Mul", [p + "g", p + "sg"], [p + "silu"]),
                helper.make_node("Mul", [p + "silu", p + "u"], [p + "h"]),
                helper.make_node("MatMul", [p + "h", p + "w2"], [p + "o"]),
                helper.make_node("Mul", [p + "o", p + "w"], [p + "scaled"]),
                helper.make_node("Greater", [p + "w", "zero"], [p + "routed"]),
                helper.make_node("Where", [p + "routed", p + "scaled", "zero"], [p + "out"]),  # exact 0 off-route
            ]
            taken = helper.make_graph(branch, p + "then", [], [helper.make_tensor_value_info(p + "out", TensorProto.FLOAT,
                                                                                               ["n", H])],
                                      [numpy_helper.from_array(w1[e].T.copy(), p + "w1"),
                                       numpy_helper.from_array(w3[e].T.copy(), p + "w3"),
                                       numpy_helper.from_array(w2[e].T.copy(), p + "w2")])
            skipped = helper.make_graph([helper.make_node("Mul", [x, "zero"], [p + "none"])], p + "else", [],
                                        [helper.make_tensor_value_info(p + "none", TensorProto.FLOAT, ["n", H])])
            nodes += [helper.make_node("Gather", [f"w_{layer}", f"expert{e}"], [p + "w"], axis=1),  # (n, 1)
                      helper.make_node("ReduceMax", [p + "w"], [p + "max"], keepdims=0),
                      helper.make_node("Greater", [p + "max", "zero"], [p + "any"]),
                      helper.make_node("If", [p + "any"], [p + "y"], then_branch=taken, else_branch=skipped)]
            outs.append(p + "y")
        nodes.append(helper.make_node("Sum", [x, *outs], [f"y{layer}"]))  # the residual and the experts
        x = f"y{layer}"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", H])]
    inputs += [helper.make_tensor_value_info(f"w_{i}", TensorProto.FLOAT, ["n", E]) for i in range(LAYERS)]
    graph = helper.make_graph(nodes, "if_per_expert", inputs,
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["n", H])], shared)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def dense_routing(logits: np.ndarray) -> np.ndarray:
    """Softmax over the experts, top-k kept and renormalised: what com.microsoft::MoE computes."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1)[:, :K]
    w = np.zeros_like(p)
    np.put_along_axis(w, top, np.take_along_axis(p, top, -1), -1)
    return w / w.sum(-1, keepdims=True)


def median_ms(s: ort.InferenceSession, feed: dict, repeat: int) -> float:
    s.run(None, feed)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        s.run(None, feed)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5, help="the paths timed in turn, the order reversed every round")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()

    from moedeploy.bench.machine import cpu_model, measure_bandwidth_gbs

    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal((E, I, H), np.float32) / np.sqrt(H),
                rng.standard_normal((E, I, H), np.float32) / np.sqrt(H),
                rng.standard_normal((E, H, I), np.float32) / np.sqrt(I)) for _ in range(LAYERS)]
    pieces = max(p for p in range(1, args.threads + 1) if I % p == 0)
    paths = {"contrib": session(contrib_model(weights), args.threads),
             f"split x{pieces}": session(split_model(weights, pieces), args.threads),
             "if-per-expert": session(if_per_expert_model(weights), args.threads)}
    bandwidth = measure_bandwidth_gbs(args.threads)
    print(f"{cpu_model()}, {args.threads} threads, {bandwidth:.2f} GB/s; {LAYERS} MoE layers of hidden {H}, "
          f"expert hidden {I}, {E} experts, top-{K}; medians over {args.rounds} rounds, ms")
    print(f"{'tokens':>6} {'experts/layer':>13} " + " ".join(f"{name:>13}" for name in paths) + f" {'floor':>8}")
    for n in args.tokens:
        x = rng.standard_normal((n, H), np.float32)
        logits = [rng.standard_normal((n, E), np.float32) for _ in range(LAYERS)]
        routing = [dense_routing(lg) for lg in logits]
        feed_contrib = {"x": x, **{f"logits_{i}": lg for i, lg in enumerate(logits)}}
        feeds = {name: ({"x": x, **{f"w_{i}": w for i, w in enumerate(routing)}} if name == "if-per-expert"
                        else feed_contrib) for name in paths}
        reference = paths["if-per-expert"].run(None, feeds["if-per-expert"])[0] - x  # the MoE part
        for name, s in paths.items():
            np.testing.assert_allclose(s.run(None, feeds[name])[0] - x, reference, rtol=1e-4,
                                       atol=1e-4 * np.abs(reference).max(), err_msg=name)
        times: dict[str, list[float]] = {name: [] for name in paths}
        for round_ in range(args.rounds):
            for name in (list(paths) if round_ % 2 == 0 else list(reversed(paths))):
                times[name].append(median_ms(paths[name], feeds[name], args.repeat))
        experts = statistics.mean(int((w > 0).any(0).sum()) for w in routing)
        floor = LAYERS * experts * 3 * H * I * 4 / bandwidth / 1e6
        print(f"{n:>6} {experts:>13.1f} " + " ".join(f"{statistics.median(t):>13.2f}" for t in times.values())
              + f" {floor:>8.2f}")


if __name__ == "__main__":
    main()
