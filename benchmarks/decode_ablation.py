"""What a decode step costs beyond reading its weights, and which part of the graph it goes to.

A fp32 decode step of the `small` preset reads about 188 MB of weights; on a 2-core Xeon llama.cpp's
f32 step on the same weights reaches 95% of that bound, moedeploy's about three quarters. ONNX Runtime's profiler cannot say where the rest goes: it adds
microseconds to each of the step's several hundred small nodes. So this measures without it:

  floor         the step's weight GEMVs alone: one graph of Gemm nodes at M = 1 over random
                matrices of the same bytes (attention projections, router, the top-k experts'
                matrices of every layer, any dense FFN or shared expert, LM head), the least
                time ONNX Runtime's kernels need to read those bytes here (fp32 artifacts, step
                mode).
  step          the lowered decode step (`ort-gqa`: GroupQueryAttention appending in place,
                the greedy token; fp32 experts on the path a session takes: the native
                kernel where it is built (plugins/native), else com.microsoft::MoE with each
                expert cut into one piece per thread (plugins/moe_split.py) where they
                qualify, else one If per expert (MOEDEPLOY_MOE_PATH chooses, as in a session);
                quantized ones on com.microsoft::QMoE at the level bench runs them).
  -attention    the step with each GroupQueryAttention replaced by Identity nodes.
  -experts      the step without its experts: each expert's If replaced by its untaken branch
                (and the Ifs' conditions not computed), or each com.microsoft::MoE / QMoE or
                native MoEExperts node by zeros (its router still runs: the NaN guard reads the
                logits).
  -nan-guard    the step without the NaN guard after each MoE (`moe.nan_where_not_finite`).
  -row-selection
                each taken expert's branch on every token, its routing weight 0 off its own,
                instead of gathering its tokens and scattering them back: the same answer
                wherever the expert's outputs are finite (bit for bit at one token), and what
                selecting rows costs a step.
  fixed-experts each layer's first k experts (k its top-k) inlined into the main graph on
                every token, each times its routing weight, the other experts dropped: a wrong
                answer on purpose, but the bytes of the step's routed experts read by the
                same prepacked Gemms with no If and no row selection, so about the step that a
                kernel taking a layer's experts by index in one node (llama.cpp's MUL_MAT_ID,
                which ONNX Runtime does not ship for fp32) would leave. The routing still runs.

The last four drop the nodes their edit leaves unread (ONNX Runtime would still run them).
A variant whose edit does not apply to the lowering (-attention where GroupQueryAttention takes
packed q/k/v, as in quantized artifacts; -row-selection and fixed-experts where the experts are
not on Ifs) is left out with a line saying why, and named in the --json report's `skipped`.

An ablated graph computes the wrong answer on purpose (-row-selection excepted); only its time
means something, and the difference to `step` is what that part costs. Two ways to time, all
variants in one process, interleaved over the rounds, the differences paired by round:

  step mode     (default) re-run one bound decode step at the same position, so the same
                experts every run: the least noisy. A quantized step's few tens of MB can stay
                partly in the CPU's last-level cache between runs (on a 2-core Xeon with 48 MB
                of L3, in one run, `small`'s int4 step re-ran 7% faster than a generation's
                steps, fp32 2%, Python's part of a generation's step included), and it has no
                floor (the floor's GEMVs are fp32 Gemms).
  --generate N  time whole greedy generations of N tokens after the prompt, the experts
                changing from step to step as in real decoding and in `moedeploy bench`
                (Python's part of each step included; an ablated variant decodes other tokens).

    python benchmarks/decode_ablation.py [ARTIFACT_OR_PRESET] [--threads 2] [--context 128] [--rounds 8]
    python benchmarks/decode_ablation.py ARTIFACT --generate 64 [--rounds 10]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from decode_profile import artifact_for
from onnx import helper, numpy_helper

from moedeploy.bench.report_file import script_report_check, write_script_report

Edit = Callable[[onnx.ModelProto], int]
#: positions a step-mode cache holds beyond the prompt (the timed step re-runs at the first of them)
STEP_HEADROOM = 8


class VariantSkipped(ValueError):
    """An edit that does not apply to this lowering (packed q/k/v for -attention; experts on
    com.microsoft::MoE or QMoE rather than on Ifs for -row-selection): the variant is left out of
    the run, with a line saying why, and the others are measured."""


def _rewire(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new


def _names_read(node: onnx.NodeProto) -> set[str]:
    """What a node reads: its inputs, and every name its subgraphs (If branches) read."""
    names = set(node.input)
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            for inner in attribute.g.node:
                names |= _names_read(inner)
    return names


def prune(model: onnx.ModelProto) -> None:
    """Drop the nodes nothing reads any more: ONNX Runtime keeps running dead nodes, so an
    ablation that only rewires would still pay for what fed the removed part."""
    _prune_graph(model.graph)


def _prune_graph(graph: onnx.GraphProto) -> None:
    """`prune` on one graph: the main graph, or an If branch (whose outputs are what it must keep)."""
    live = {value.name for value in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(name in live for name in node.output):
            kept.append(node)
            live |= _names_read(node)
    del graph.node[:]
    graph.node.extend(reversed(kept))


def without_attention(model: onnx.ModelProto) -> int:
    """Each GroupQueryAttention -> Identity of q, past key and past value (the cache buffers). Not
    pruned: the k and v projections, which nothing reads now, still run, so only the attention
    core's time is removed."""
    graph, count = model.graph, 0
    for node in list(graph.node):
        if node.op_type == "GroupQueryAttention":
            if not node.input[1]:
                raise VariantSkipped("it takes separate q, k and v inputs, and this graph hands "
                                     "GroupQueryAttention packed q/k/v (fused quantized projections)")
            index = list(graph.node).index(node)
            graph.node.remove(node)
            for offset, (src, dst) in enumerate(zip([node.input[0], node.input[3], node.input[4]], node.output[:3], strict=True)):
                graph.node.insert(index + offset, helper.make_node("Identity", [src], [dst]))
            count += 1
    return count


def _is_expert_if(node: onnx.NodeProto) -> bool:
    """One expert's If of the per-expert MoE lowering (plugins/moe_experts.py names them so)."""
    return node.op_type == "If" and "/experts" in node.name


def _branch(node: onnx.NodeProto, name: str) -> onnx.GraphProto:
    """An If's then_branch or else_branch."""
    return next(a.g for a in node.attribute if a.name == name)


def without_experts(model: onnx.ModelProto) -> int:
    """Each expert's If -> what its untaken branch returns (the zeros it adds); each
    com.microsoft::MoE, QMoE or native MoEExperts node -> zeros of its input's shape. `prune` then drops what only
    those read (the Ifs' conditions, the nodes' weights), not the routing the NaN guard reads."""
    graph, count = model.graph, 0
    for node in list(graph.node):
        if _is_expert_if(node):
            _rewire(graph, node.output[0], _branch(node, "else_branch").node[0].input[0])
        elif (node.domain, node.op_type) in (("com.microsoft", "MoE"), ("com.microsoft", "QMoE"),
                                             ("moedeploy.cpu", "MoEExperts")):
            index = list(graph.node).index(node)
            graph.node.insert(index, helper.make_node("Sub", [node.input[0], node.input[0]], [node.output[0]]))
        else:
            continue
        graph.node.remove(node)
        count += 1
    prune(model)
    return count


def without_nan_guard(model: onnx.ModelProto) -> int:
    """Each MoE's NaN guard, Where(IsNaN(flags), flags, y), -> the y it guards; `prune` then drops
    the rest of the guard (its Softmax, Subs, ReduceSums, Add and IsNaN)."""
    graph, count = model.graph, 0
    isnan = {node.output[0]: node.input[0] for node in graph.node if node.op_type == "IsNaN"}
    for node in list(graph.node):
        if node.op_type == "Where" and isnan.get(node.input[0]) == node.input[1]:  # not a routing's Where
            _rewire(graph, node.output[0], node.input[2])
            graph.node.remove(node)
            count += 1
    prune(model)
    return count


def without_row_selection(model: onnx.ModelProto) -> int:
    """Each taken expert branch run on every token instead of gathering its own: each Gather by
    the branch's rows (of the tokens, and of their routing weights) -> the tensor it gathers
    from, and the ScatterND into zeros -> the rows it scatters, now one per token; the branch
    is then pruned of the NonZero and what only it fed. Tokens the expert does not take get its
    output times their routing weight 0, so the result is unchanged wherever the expert's
    outputs are finite (bit for bit at one token, where the branch's rows are all the rows; a
    token whose output overflowed would now add Inf * 0), and a prefill does every taken
    expert's work for every token: time decode steps with it, not prompts. What a decode step
    pays for selecting rows in its taken branches."""
    count = 0
    for node in model.graph.node:
        if not _is_expert_if(node):
            continue
        branch = _branch(node, "then_branch")
        nonzero = [n for n in branch.node if n.op_type == "NonZero"]
        scatter = [n for n in branch.node if n.op_type == "ScatterND"]
        if len(nonzero) != 1 or len(scatter) != 1:
            raise ValueError(f"-row-selection: {node.name}'s taken branch is not one NonZero's rows gathered and "
                             "scattered back (a per-expert lowering this script does not know)")
        rows = {n.output[0] for n in branch.node if n.op_type == "Reshape" and n.input[0] == nonzero[0].output[0]}
        for gather in [n for n in branch.node if n.op_type == "Gather" and n.input[1] in rows]:
            _rewire(branch, gather.output[0], gather.input[0])
        branch.output[0].name = scatter[0].input[2]
        _prune_graph(branch)
        count += 1
    return count


def _top_k(graph: onnx.GraphProto) -> int:
    """The k of the lowering's TopK routing (a Constant it reads): how many experts a token takes."""
    constants = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}
    for node in graph.node:
        if node.op_type == "TopK" and node.input[1] in constants:
            return int(numpy_helper.to_array(constants[node.input[1]].attribute[0].t).reshape(-1)[0])
    raise VariantSkipped("its routing is not one TopK on a constant k (a routing on the op's own function body)")


def fixed_experts(model: onnx.ModelProto) -> int:
    """Each layer's experts -> its first k experts' taken branches (k the routing's top-k),
    row selection removed as in `without_row_selection` and inlined into the main graph, the
    other experts' Ifs -> their zeros: a wrong answer on purpose (the same experts every token),
    but the bytes a step's routed experts read, by the same prepacked Gemms, with no If and no
    row selection. Its time is about what a kernel taking a layer's experts by index in one
    node (llama.cpp's MUL_MAT_ID; ONNX Runtime ships none for fp32) would leave of the step."""
    graph, count = model.graph, 0
    if not any(_is_expert_if(node) for node in graph.node):
        return 0
    top_k = _top_k(graph)
    for node in list(graph.node):
        if not _is_expert_if(node):
            continue
        expert = int(re.search(r"/expert(\d+)$", _branch(node, "then_branch").name).group(1))
        index = list(graph.node).index(node)
        graph.node.remove(node)
        if expert >= top_k:
            _rewire(graph, node.output[0], _branch(node, "else_branch").node[0].input[0])
            continue
        inline = onnx.ModelProto(graph=onnx.GraphProto(node=[node]))
        without_row_selection(inline)
        branch = _branch(inline.graph.node[0], "then_branch")
        for offset, inner in enumerate(branch.node):
            graph.node.insert(index + offset, inner)
        _rewire(graph, node.output[0], branch.output[0].name)
        count += 1
    prune(model)
    return count


VARIANTS: dict[str, Edit | None] = {
    "step": None, "-attention": without_attention, "-experts": without_experts, "-nan-guard": without_nan_guard,
    "-row-selection": without_row_selection, "fixed-experts": fixed_experts,
}


def decoder_variant(artifact, edit: Edit | None, threads: int, relayout: bool = True):
    """An in-place-cache greedy OrtDecoder whose session runs the lowered graph after `edit`; a
    quantized artifact's at the accuracy level bench runs it at. relayout=False: the native
    kernel's experts as stored rows, not panels (benchmarks/native_layouts.py)."""
    from moedeploy.runtime.generation import OrtDecoder
    from moedeploy.runtime.ort import (
        LoweredSession,
        load_lowered,
        lowered_model,
        reads_weights_from,
        session_moe,
        session_options,
    )
    from moedeploy.runtime.quantized import RUN_ACCURACY

    decoder = OrtDecoder(artifact, threads=threads, attention_lowering="gqa", logits="greedy", kv_cache="inplace",
                         nbits_accuracy=RUN_ACCURACY)
    if edit is None and relayout:
        return decoder
    moe_lowering, pieces = session_moe("CPUExecutionProvider", threads, "auto", artifact)
    model_bytes, counts = lowered_model(artifact, "CPUExecutionProvider", moe_lowering, "gqa", "greedy", "native",
                                        "inplace", RUN_ACCURACY, expert_pieces=pieces, relayout=relayout)
    model = onnx.load_from_string(model_bytes)
    if edit is not None and not edit(model):
        raise VariantSkipped("nothing of what it removes is in this lowering")
    # the decoder's own session is replaced by the edited one (its buffers and binding are what is reused)
    options = reads_weights_from(session_options(threads), artifact)
    options.log_severity_level = 3  # initializers the edit left unused are reported otherwise
    session = load_lowered(model, options, artifact.path)  # the experts cut into pieces supplied, if any
    decoder.lowered = LoweredSession(session, "CPUExecutionProvider", counts)
    return decoder


def gemv_floor(config, threads: int) -> tuple[ort.InferenceSession, ort.IOBinding, object]:
    """One graph of the decode step's weight GEMVs at M = 1, random weights of the same shapes."""
    from moedeploy.bench.roofline import _attention_params, _ffn_params

    rng = np.random.default_rng(0)
    h, inter = config.hidden_size, config.expert_hidden
    nodes, initializers, outputs = [], [], []

    def gemv(name: str, source: str, rows: int, cols: int) -> None:
        initializers.append(numpy_helper.from_array((rng.standard_normal((rows, cols)) * 0.02).astype(np.float32), name))
        nodes.append(helper.make_node("Gemm", [source, name], [f"{name}.out"], transB=1))
        outputs.append(f"{name}.out")

    for layer in range(config.n_layers):
        gemv(f"l{layer}.attention", "x", _attention_params(config) // h, h)  # q, k, v and o: their bytes
        if not config.is_moe_layer(layer):  # a dense SwiGLU's bytes as one matrix
            gemv(f"l{layer}.dense", "x", _ffn_params(config, layer, 0) // h, h)
            continue
        gemv(f"l{layer}.router", "x", config.n_experts, h)
        for slot in range(config.top_k):
            gemv(f"l{layer}.e{slot}.gate_up", "x", 2 * inter, h)
            gemv(f"l{layer}.e{slot}.down", "hidden", h, inter)
        if shared := _ffn_params(config, layer, config.top_k) - h * (config.n_experts + 3 * config.top_k * inter):
            gemv(f"l{layer}.shared", "x", shared // h, h)  # shared experts (and their gate) as one matrix
    gemv("lm_head", "x", config.vocab_size, h)
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, h]),
              helper.make_tensor_value_info("hidden", onnx.TensorProto.FLOAT, [1, inter])]
    graph = helper.make_graph(nodes, "gemv_floor", inputs,
                              [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in outputs], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    binding.bind_cpu_input("x", rng.standard_normal((1, h)).astype(np.float32))
    binding.bind_cpu_input("hidden", rng.standard_normal((1, inter)).astype(np.float32))
    for name in outputs:
        binding.bind_output(name)
    return session, binding, None


def bound_step(decoder, context: int) -> tuple[ort.InferenceSession, ort.IOBinding, object]:
    """The decoder's session and binding after a `context`-token prompt and one decode step, and
    the decoder itself: the binding writes into its buffers, which must outlive every run."""
    import torch

    prompt = torch.from_numpy(np.random.default_rng(0).integers(0, decoder.vocab_size, (1, context)))
    decoder.reset(1, context + STEP_HEADROOM)
    token = decoder.greedy_step(prompt, 0)
    decoder.greedy_step(token.view(1, 1), context)  # binds the one-token inputs; re-run at this position
    return decoder.lowered.session, decoder._binding, decoder


def generation_ms(decoder, prompt, tokens: int) -> float:
    """Milliseconds a decode step, over a greedy generation of `tokens` after `prompt` (the prefill
    not timed): as `moedeploy tune` times its two paths."""
    from moedeploy.runtime.moe_tuning import decode_step_ms

    return decode_step_ms(decoder, prompt, tokens)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", nargs="?", default="small",
                        help="a decoder artifact folder (fp32 or quantized), or a preset (small) exported once "
                             "into bench's cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128, help="cached positions before the timed step (the prompt)")
    parser.add_argument("--steps", type=int, default=40, help="step mode: runs of the step per variant and round")
    parser.add_argument("--generate", type=int, metavar="N",
                        help="time greedy generations of N tokens instead of re-running one bound step")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    for option, value in (("--threads", args.threads), ("--context", args.context), ("--steps", args.steps),
                          ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{option} must be at least 1, got {value}")
    if args.generate is not None and args.generate < 2:
        parser.error(f"--generate must be at least 2 (a prefill and one timed step), got {args.generate}")
    script_report_check(parser, args.json, "decode_ablation")
    try:
        measure(args)
    except ValueError as e:  # the target, or a graph this script cannot take apart
        raise SystemExit(f"error: {e}") from None


def measure(args: argparse.Namespace) -> None:
    import torch

    from moedeploy.bench.machine import cpu_model, measure_bandwidth_gbs
    from moedeploy.models.config import DecoderConfig

    artifact = artifact_for(args.target)
    config = DecoderConfig.from_manifest(artifact.manifest["config"])
    quantized = "quantization" in artifact.manifest
    if artifact.dtype != "fp32":
        raise ValueError(f"{artifact.path} is a {artifact.dtype} export; the ablations take fp32 and quantized "
                         "lowerings apart")
    beyond = args.generate or STEP_HEADROOM
    if args.context + beyond > config.max_positions:
        raise ValueError(f"--context {args.context} and {beyond} more tokens exceed the model's "
                         f"{config.max_positions} positions")
    variants, skipped = {}, {}
    for name, edit in VARIANTS.items():
        try:
            variants[name] = decoder_variant(artifact, edit, args.threads)
        except VariantSkipped as e:
            skipped[name] = str(e)
            print(f"{name}: skipped: {e}")
    if args.generate is None:
        runs = {} if quantized else {"floor": gemv_floor(config, args.threads)}
        runs |= {name: bound_step(decoder, args.context) for name, decoder in variants.items()}
    prompt = torch.from_numpy(np.random.default_rng(0).integers(0, config.vocab_size, (1, args.context)))
    times: dict[str, list[float]] = {name: [] for name in (variants if args.generate else runs)}
    for round_ in range(args.rounds):
        if args.generate:  # order reversed every other round: neither side always runs on a warmer machine
            for name in (list(variants) if round_ % 2 == 0 else list(reversed(variants))):
                times[name].append(generation_ms(variants[name], prompt, args.generate))
            continue
        for name, (session, binding, _) in runs.items():
            for _ in range(3):
                session.run_with_iobinding(binding)
            start = time.perf_counter()
            for _ in range(args.steps):
                session.run_with_iobinding(binding)
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    bandwidth = measure_bandwidth_gbs(args.threads)
    step = times["step"]
    how = (f"greedy generations of {args.generate} tokens after a {args.context}-token prompt, {args.rounds} rounds"
           if args.generate else f"one decode step after {args.context} tokens, {args.rounds} rounds x {args.steps} runs")
    print(f"{cpu_model()}, {args.threads} threads, {bandwidth:.1f} GB/s read; {how}")
    width = max(len(name) for name in times)
    print(f"{'variant':{width}s} {'ms (median)':>11s} {'min-max':>13s} {'- step, paired':>15s}")
    report = {"bandwidth_gbs": bandwidth, "context": args.context, "threads": args.threads,
              "generate": args.generate, "quantized": quantized, "ms": times, "skipped": skipped}
    for name, values in times.items():
        paired = statistics.median(v - s for v, s in zip(values, step, strict=True))
        print(f"{name:{width}s} {statistics.median(values):11.2f} {min(values):6.2f}-{max(values):<6.2f} {paired:+15.2f}")
    write_script_report(args.json, "decode_ablation", report)


if __name__ == "__main__":
    main()
