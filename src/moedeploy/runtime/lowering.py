"""Lower the custom ops of an artifact's graph to what an ONNX Runtime provider runs fastest.

  moe::MoE      -> on request (moe_lowering="native"; a CPU session's default wherever the
                   project's native kernel is built, runtime/ort.moe_path) the routing on graph
                   ops and moedeploy.cpu::MoEExperts, the routed experts in one node
                   (plugins/moe_native.py, plugins/native/), for fp32 SwiGLU experts on CPU
                   without biases: on the CPU it was measured on, decode faster than the two
                   paths below, in less memory (benchmarks/README.md); else
                -> com.microsoft::MoE with every expert cut into one piece per thread
                   (plugins/moe_split.py) where the session has 2 or more threads
                   (expert_pieces) and the experts qualify (fp32 SwiGLU on CPU, softmax top-k
                   renormalised, no biases, a streamed export's stacks): in generations on the
                   CPU it was measured on, 2-22% faster a decode step than the If per expert
                   below, at 0.92-1.26x its prefill time (benchmarks/README.md); else
                -> one If per expert over prepacked Gemms (plugins/moe_experts.py) for fp32
                   SwiGLU experts on CPU, every routing: on the CPU it was measured on, faster
                   than com.microsoft::MoE in decode and prefill (benchmarks/README.md); else
                -> com.microsoft::MoE where its kernel takes the dtype and the activation on
                   that provider (fp32 on CPU): with its own router when that expresses the
                   node's (softmax top-k, with or without renormalisation), else with the
                   node's routing computed on graph ops before it ("routed": sigmoid scores,
                   selection biases, groups, scaling, sparsemixer). Otherwise the node stays
                   and ONNX Runtime inlines its dense standard-op function body
                   Quantized experts (DequantizeLinear over blocked codes) the same way, each
                   expert's matmuls on com.microsoft::MatMulNBits over the artifact's bytes;
                   where com.microsoft::QMoE computes them (int4 at every accuracy level, int8
                   at level 4: its CPU int8 kernel has no float path), QMoE over those bytes
                   instead, in "auto" and "contrib": faster in decode on the CPU it was
                   measured on (benchmarks/README.md)
  quantized     a MatMul by a quantized Linear weight (Transpose of DequantizeLinear over
  Linears       blocked codes) -> com.microsoft::MatMulNBits on the same bytes (runtime/quantized.py)
  moe::RMSNorm  -> ONNX RMSNormalization-23 where ONNX Runtime has a kernel for the dtype; on
                   request (norm_lowering="skip"), fp32 on CPU, the residual Add before it and the
                   norm -> com.microsoft::SkipSimplifiedLayerNormalization, whose 4th output is
                   the sum the next residual reads. Not the default: two A/B runs on the small
                   preset's decode gave +3.1% and -0.5% (benchmarks/README.md)
  logits        on request (logits="last", what generation needs), the LM head runs on the last
                position only: its input is sliced to (B, 1, H), so a prefill of S tokens does not
                multiply S x H by the H x V head (at S = 128 on the small preset, about 40% of
                the prefill's flops) and the logits output is (B, 1, V); logits="greedy" adds
                the output next_token, (B, 1) int64: the argmax of those logits, NaN ranked
                first as torch.argmax ranks it (TopK with k=1), so a greedy decode reads one id
                a row instead of copying the V-wide logits out and taking their argmax in Python
  attention     on request (attention_lowering="gqa"), a decoder layer's traced attention
                (rotary, KV concat, ONNX Attention) -> com.microsoft::GroupQueryAttention,
                where the decoder's config and the traced subgraph qualify (runtime/gqa.py).
                Not the default: on the 2-core CPU it was measured on, decode and prefill
                were no faster (benchmarks/README.md), so the traced graph stays. With it,
                kv_cache="inplace": one IO-bound buffer per layer's past and present, appended
                to in place (OrtDecoder(kv_cache="inplace"), bench backend ort-gqa); or
                kv_cache="ragged": the same cache, and each row of a step brings its own
                number of tokens, packed in input_ids (1, T), attention on the rows' padded
                chunks (runtime/inflight.RowCacheDecoder: a prompt joins decoding rows)

The artifact on disk is never changed: lowering works on an in-memory copy.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common

from moedeploy.models.config import DecoderConfig
from moedeploy.plugins import moe, moe_experts, moe_native, moe_split, rmsnorm
from moedeploy.runtime import gqa, quantized

MoELowering = Literal["auto", "contrib", "experts", "native", "function"]
#: graph: attention as traced; gqa: every layer on GroupQueryAttention, or an error saying why not
AttentionLowering = Literal["graph", "gqa"]
#: all: logits for every position (the artifact's output); last: the last position's only;
#: greedy: last, and the output NEXT_TOKEN, their argmax (what greedy decoding reads)
LogitsLowering = Literal["all", "last", "greedy"]
#: native: RMSNorm on ONNX RMSNormalization; skip: a residual Add and the RMSNorm after it on
#: com.microsoft::SkipSimplifiedLayerNormalization (fp32, CPU)
NormLowering = Literal["native", "skip"]
#: copy: past in, a new present out (the artifact's interface); inplace: with attention on
#: GroupQueryAttention, each layer's past and present are one preallocated buffer it appends to;
#: ragged: inplace, and each row of a step brings its own number of tokens, all packed in
#: input_ids (1, T), with logits for each row's last token (runtime/gqa.py; in-flight batching
#: runs a joining prompt in the same step as the rows that decode)
KVCache = Literal["copy", "inplace", "ragged"]
#: Bump when lower_for_ort emits a different graph for the same input, so cached lowered graphs
#: of older lowerings are rebuilt (2: the contrib MoE propagates NaN/Inf rows; 3: moe opset 2's
#: routing variants stay on the function body, zero biases made by ConstantOfShape are dropped;
#: 4: moe opset 3, whose clamped SwiGLU is passed on to com.microsoft::MoE; 5: routings the
#: contrib op cannot compute run on graph ops before it instead of on the dense function body;
#: 6: attention lowering counts, and fp32 SwiGLU MoE on one If per expert; 7: the logits count;
#: 8: quantized weights on MatMulNBits; 9: quantized experts on com.microsoft::QMoE in the contrib lowering;
#: 10: a shared-buffer cache takes a past length per row; 11: the ragged cache; 12: q/k/v MatMulNBits
#: that share an input fused and handed to GroupQueryAttention packed; 13: signed codes reach the
#: quantized kernels through BitwiseXor; 14: the greedy_token count; 15: the NaN guard after a MoE
#: whose router is x @ W checks the routing alone; 16: the native kernel's panels attribute).
LOWERING_VERSION = 16
MOE_LOWERINGS = ("auto", "contrib", "experts", "native", "function")
ATTENTION_LOWERINGS = ("graph", "gqa")
LOGITS_LOWERINGS = ("all", "last", "greedy")
#: logits="greedy"'s output: each row's next token under greedy decoding, (B, 1) int64
NEXT_TOKEN = "next_token"
NORM_LOWERINGS = ("native", "skip")
KV_CACHES = ("copy", "inplace", "ragged")


class LoweringError(ValueError):
    """The requested lowering cannot apply to this graph on this provider."""


def lower_for_ort(
    model: onnx.ModelProto, provider: str = "CPUExecutionProvider", moe_lowering: MoELowering = "auto",
    config: DecoderConfig | None = None, attention_lowering: AttentionLowering = "graph",
    logits: LogitsLowering = "all", norm_lowering: NormLowering = "native", kv_cache: KVCache = "copy",
    weights_dir: str | None = None, nbits_accuracy: int = 0, expert_pieces: int = 1, relayout: bool = True,
) -> tuple[onnx.ModelProto, dict[str, int]]:
    """Returns the lowered model and counts of what was lowered to what. `config`: a decoder
    artifact's config, without which attention is left as traced. `weights_dir`: where the
    model's external data lives (read only for the few bytes a lowering must repack).
    nbits_accuracy: MatMulNBits' accuracy_level for quantized weights, 0 (float compute: what
    the artifact's DequantizeLinear graph computes, to rounding) or 4 (int8 activations: faster).
    expert_pieces: the session's threads, for moe_split in "auto" and "contrib"; above 1 the
    model may read placeholders that moe_split.supply must fill (count "moe_split"). relayout:
    the native kernel's experts in panels where their weights are external data (placeholders
    too, count "moe_native"); False keeps views of the file (a session that shares the mapped
    weights). A model with placeholders is for runtime.ort.load_lowered only, never to be saved."""
    for what, value, choices in (("MoE lowering", moe_lowering, MOE_LOWERINGS),
                                 ("attention lowering", attention_lowering, ATTENTION_LOWERINGS),
                                 ("logits lowering", logits, LOGITS_LOWERINGS),
                                 ("norm lowering", norm_lowering, NORM_LOWERINGS),
                                 ("kv_cache", kv_cache, KV_CACHES)):
        if value not in choices:
            raise LoweringError(f"invalid {what} {value!r}; choose one of {choices}")
    if nbits_accuracy not in quantized.ACCURACY_LEVELS:
        raise LoweringError(f"invalid MatMulNBits accuracy level {nbits_accuracy!r}; choose one of {quantized.ACCURACY_LEVELS}")
    if kv_cache in ("inplace", "ragged") and (attention_lowering != "gqa" or config is None):
        raise LoweringError(f"kv_cache={kv_cache!r} needs a decoder's attention on GroupQueryAttention "
                            "(attention_lowering='gqa'), which appends to the cache in place")
    if kv_cache == "ragged" and logits != "last":
        raise LoweringError("kv_cache='ragged' gives each row's last logits: use logits='last'")
    ir_model = ir.from_proto(model)
    graph = ir_model.graph
    if weights_dir is not None:
        ir.external_data.set_base_dir(graph, weights_dir)
    counts = {"moe_contrib": 0, "moe_routed": 0, "moe_experts": 0, "moe_native": 0, "moe_split": 0, "moe_function": 0, "rmsnorm_native": 0,
              "rmsnorm_function": 0,
              "attention_gqa": 0, "attention_graph": 0, "logits_last": 0, "rmsnorm_skip": 0, "matmul_nbits": 0,
              "moe_qmoe": 0, "matmul_nbits_fused": 0, "packed_qkv": 0, "sign_flips": 0, "greedy_token": 0}
    query_lengths = _ragged_input(graph) if kv_cache == "ragged" else None
    if logits != "all":
        counts["logits_last"] = _last_position_logits(graph, query_lengths)
    if logits == "greedy":
        counts["greedy_token"] = _greedy_token(graph)
    if config is not None:
        counts["attention_gqa"] = lowered = _lower_attention(graph, config, provider, attention_lowering,
                                                             kv_cache != "copy", query_lengths)
        counts["attention_graph"] = config.n_layers - lowered
    for node in list(graph):
        is_moe = node.domain == moe.DOMAIN and node.op_type == moe.OP_TYPE
        quantized_on_qmoe = is_moe and moe_lowering in ("auto", "native") and moe.qmoe_eligible(node, provider, nbits_accuracy)
        pieces = moe_split.pieces_for(node, provider, expert_pieces) if is_moe and moe_lowering in ("auto", "contrib") else 1
        if is_moe and moe_lowering == "native" and moe_native.native_eligible(node, provider):
            moe_native.lower_to_native(graph, node, relayout)
            counts["moe_native"] += 1
        elif pieces > 1:
            moe_split.lower_to_split(graph, node, pieces, provider)
            counts["moe_split"] += 1
        elif is_moe and moe_lowering in ("auto", "experts", "native") and moe_experts.experts_eligible(node, provider) \
                and not quantized_on_qmoe:
            moe_experts.lower_to_experts(graph, node, nbits_accuracy)
            counts["moe_experts"] += 1
        elif is_moe and moe_lowering == "experts":
            raise LoweringError(f"the per-expert lowering does not take node {node.name!r} (fp32 SwiGLU "
                                f"experts with constant weights on the CPU provider only); use moe_lowering='auto' "
                                f"(on the command line: --backend ort instead of ort-experts or ort-gqa-experts)")
        elif is_moe:
            eligible = moe.contrib_experts_eligible(node, provider)
            if moe_lowering == "contrib" and not eligible:
                raise LoweringError(
                    f"com.microsoft::MoE on {provider} does not take node {node.name!r} "
                    f"({node.inputs[0].dtype}); use --moe-lowering auto or function"
                )
            if eligible and moe_lowering != "function":
                routed = not moe.contrib_eligible(node, provider)
                op_type, routed = moe.lower_to_contrib(graph, node, routed=routed, nbits_accuracy=nbits_accuracy,
                                                        provider=provider)
                counts["moe_qmoe"] += op_type == "QMoE"
                counts["moe_routed" if routed else "moe_contrib"] += 1
            else:
                counts["moe_function"] += 1
        elif node.domain == rmsnorm.DOMAIN and node.op_type == rmsnorm.OP_TYPE:
            add = rmsnorm.residual_add(node) if norm_lowering == "skip" and provider == "CPUExecutionProvider" else None
            if add is not None and _elem_type(node.inputs[0]) == onnx.TensorProto.FLOAT:
                rmsnorm.lower_to_skip(graph, node, add)
                counts["rmsnorm_skip"] += 1
            elif _elem_type(node.inputs[0]) in rmsnorm.ORT_NATIVE_DTYPES:
                rmsnorm.lower_to_native(graph, node)
                counts["rmsnorm_native"] += 1
            else:
                counts["rmsnorm_function"] += 1
    counts["matmul_nbits"] = quantized.lower_linears(graph, provider, nbits_accuracy)
    # Nodes left without a consumer (the strided Slices of an interleaved expert weight that
    # com.microsoft::MoE now reads whole, the traced attention GroupQueryAttention replaced) go,
    # so ONNX Runtime never folds them into copies and the passes below see only live readers.
    ir.passes.common.RemoveUnusedNodesPass()(ir_model)
    if counts["matmul_nbits"] and counts["attention_gqa"]:
        counts["matmul_nbits_fused"] = quantized.fuse_shared_input(graph)
        counts["packed_qkv"] = gqa.use_packed_qkv(graph)
        ir.passes.common.RemoveUnusedNodesPass()(ir_model)  # the fused projections' own weights
    if query_lengths is not None:
        try:
            gqa.batch_from_packed_tokens(graph)
        except ValueError as e:
            raise LoweringError(f"kv_cache='ragged' cannot take this graph: {e}; use kv_cache='inplace'") from e
    if kv_cache != "copy" and (why := gqa.cache_read_only_by_gqa(graph)):
        raise LoweringError(f"kv_cache={kv_cache!r} would be read wrongly: {why}; use kv_cache='copy'")
    counts["sign_flips"] = quantized.sign_flips(graph)
    return ir.to_proto(ir_model), counts


def _ragged_input(graph: ir.Graph) -> ir.Value:
    """input_ids becomes (1, T), a ragged step's packed tokens; returns the new input saying how
    many of them each row brings (gqa.QUERY_LENGTHS)."""
    input_ids = next((v for v in graph.inputs if v.name == "input_ids"), None)
    if input_ids is None:
        raise LoweringError("kv_cache='ragged' needs a decoder graph with an input_ids input")
    input_ids.shape = ir.Shape([1, "tokens"])
    query_lengths = ir.Value(name=gqa.QUERY_LENGTHS, shape=ir.Shape(["rows"]), type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(query_lengths)
    return query_lengths


def _last_position_logits(graph: ir.Graph, query_lengths: ir.Value | None = None) -> int:
    """Slice the LM head's input to the last position; 1 when done, a LoweringError when the
    graph has no `logits` output computed by a MatMul on a constant (V-wide) weight. With
    query_lengths (a ragged step's packed tokens), gather each row's last token instead: the
    logits are (1, rows, V).

    Only per-position ops may sit between that MatMul and the output (a bias Add, the
    logit scaling's Div or Mul by a constant), so every remaining logit is the one the full
    graph computes for the last position.
    """
    output = next((v for v in graph.outputs if v.name == "logits"), None)
    node = output.producer() if output is not None else None
    while node is not None and node.op_type in ("Add", "Div", "Mul") and len(node.inputs) == 2 \
            and node.inputs[1] is not None and node.inputs[1].const_value is not None:
        node = node.inputs[0].producer()
    constant = node is not None and (node.inputs[1].const_value is not None
                                     or quantized.transposed_blocked_source(node.inputs[1]) is not None)
    if node is None or node.op_type != "MatMul" or not constant:
        raise LoweringError("logits='last' needs a decoder graph whose logits output is an LM-head MatMul; "
                            "use logits='all'")
    hidden = node.inputs[0]
    if query_lengths is None:
        nodes = [ir.node("Slice", [hidden, _int64s(graph, "logits_last_starts", [-1]),
                                   _int64s(graph, "logits_last_ends", [2**63 - 1]),
                                   _int64s(graph, "logits_last_axes", [1])], name="logits_last/Slice")]
    else:  # row b's last token is packed at cumsum(query_lengths)[b] - 1
        ends = ir.node("CumSum", [query_lengths, _int64s(graph, "logits_last_axis", [0])], name="logits_last/CumSum")
        last = ir.node("Sub", [ends.outputs[0], _int64s(graph, "logits_last_one", [1])], name="logits_last/Sub")
        nodes = [ends, last, ir.node("Gather", [hidden, last.outputs[0]], {"axis": 1}, name="logits_last/Gather")]
    nodes[-1].outputs[0].name = "logits_last/hidden"
    graph.insert_before(node, nodes)
    node.replace_input_with(0, nodes[-1].outputs[0])
    if output.shape is not None and len(output.shape) == 3:
        rows = 1 if query_lengths is None else "rows"
        output.shape = ir.Shape([output.shape[0] if query_lengths is None else 1, rows, output.shape[2]])
    return 1


def _greedy_token(graph: ir.Graph) -> int:
    """Add the output NEXT_TOKEN: the argmax of `logits` over the vocabulary; 1 when added."""
    logits = next(v for v in graph.outputs if v.name == "logits")
    nodes = argmax_nodes(logits, graph)
    graph.extend(nodes)
    token = nodes[-1].outputs[0]
    token.name = NEXT_TOKEN
    token.type = ir.TensorType(ir.DataType.INT64)
    token.shape = ir.Shape(list(logits.shape)[:-1]) if logits.shape is not None else None
    graph.outputs.append(token)
    return 1


def argmax_nodes(scores: ir.Value, graph: ir.Graph) -> list[ir.Node]:
    """Nodes computing torch.argmax(scores, -1): the first maximum, or the first NaN where a row
    has one, as torch ranks NaN above everything. ONNX Runtime's TopK with k=1 ranks exactly so
    (ties to the lower index, as ONNX specifies), where its ArgMax skips NaN, which would make a
    broken model's greedy token differ from eager PyTorch's; a test pins the rule against
    torch.argmax. TopK is also the faster of the two on a 32000-wide row (about 28 against 41 µs).
    """
    nodes: list[ir.Node] = []
    if scores.dtype == ir.DataType.BFLOAT16:  # no CPU TopK for it; exact: its values, order and NaNs survive
        nodes.append(ir.node("Cast", [scores], {"to": ir.DataType.FLOAT}, name="greedy_token/Cast"))
        scores = nodes[-1].outputs[0]
    top = ir.node("TopK", [scores, _int64s(graph, "greedy_token_k", [1])], {"axis": -1, "largest": 1, "sorted": 1},
                  num_outputs=2, name="greedy_token/TopK")
    index = ir.node("Squeeze", [top.outputs[1], _int64s(graph, "greedy_token_axis", [-1])], name="greedy_token/Squeeze")
    return [*nodes, top, index]


def _int64s(graph: ir.Graph, name: str, values: list[int]) -> ir.Value:
    return gqa.constant_initializer(graph, name, np.array(values, dtype=np.int64))


def _lower_attention(graph: ir.Graph, config: DecoderConfig, provider: str, how: AttentionLowering,
                     shared_cache: bool = False, query_lengths: ir.Value | None = None) -> int:
    """How many layers now run GroupQueryAttention: none, or with `gqa` all of them."""
    if how == "graph":
        return 0
    why = "it is wired for ONNX Runtime's CPU provider only" if provider != "CPUExecutionProvider" else None
    why = why or gqa.eligible(config)
    lowered = 0 if why else gqa.lower_attention(graph, config, shared_cache, query_lengths)
    if lowered != config.n_layers:
        why = why or "the traced attention of some layers is not the subgraph it computes"
        raise LoweringError(f"com.microsoft::GroupQueryAttention cannot take this decoder's attention ({why}); "
                            "keep the traced attention (attention_lowering='graph', bench backend 'ort')")
    return lowered


def _elem_type(value: ir.Value) -> int:
    return int(value.dtype) if value.dtype is not None else onnx.TensorProto.UNDEFINED
