"""Lower a decoder layer's attention to ONNX Runtime's fused `com.microsoft::GroupQueryAttention`.

The artifact traces attention as some twenty standard ops per layer: reshapes and
transposes of q/k/v, the rotary rotation, the KV concatenation, ONNX `Attention` with a
mask, and the reshape back. ONNX Runtime GenAI's models run one GroupQueryAttention node
instead, which rotates q and k itself (from cos/sin tables), appends k/v to the cache and
attends in one kernel. This pass finds each layer's q/k/v and output projections by the
module scopes the exporter records on every node (`decoder.layers.{i}.attn.wq`, ...), takes
as the core every node between them and the layer's past and present, checks that it is
exactly what GroupQueryAttention computes (see `_core_boundary`), and swaps it for one
GroupQueryAttention node. The projections
(with their biases) and everything else stay as they are.

Opt-in (attention_lowering="gqa"; `moedeploy bench --backend ort-gqa`): on the 2-core CPU
it was measured on it halved the nodes per step but decoded no faster. Which layers qualify
is decided from the artifact's config, conservatively: plain rotary
attention (full or partial rotary, default or YaRN frequencies) with no sinks, no latent
attention, no q/k norm or clamp and no sliding window. Anything else keeps its traced
graph. The graph's interface is unchanged (past in, present out), so the same KV-cache
handling runs either graph; `compare` checks the lowered graph against eager PyTorch.

With shared_cache (OrtDecoder(kv_cache="inplace")), each layer's past and present are one
preallocated buffer bound to both, which GroupQueryAttention appends to in place, so no step
copies the cache; the cached length of each row then comes from a `past_sequence_lengths`
input of shape (batch,), and the lowering refuses a graph in which anything else reads the
buffers' sequence length. Rows may hold different lengths: GroupQueryAttention rotates, writes
and attends each row at its own positions, which is what in-flight batching needs (rows of
requests that joined at different times decoded in one step, runtime/inflight.py). A ragged
step (kv_cache="ragged") goes further: each row brings its own number of tokens, all packed in
one input for the per-token nodes, and attention runs on the rows' right-padded chunks, so a
prompt is prefilled in the same step that decodes the other rows (`lower_attention`).
"""

from __future__ import annotations

import ast

import numpy as np
import onnx_ir as ir
import torch

from moedeploy.models.config import DecoderConfig

CONTRIB_DOMAIN = "com.microsoft"
SCOPES = "pkg.torch.onnx.name_scopes"
#: dtypes GroupQueryAttention's CPU kernel takes
GQA_DTYPES = {ir.DataType.FLOAT: np.float32, ir.DataType.FLOAT16: np.float16}


def eligible(config: DecoderConfig) -> str | None:
    """Why GroupQueryAttention cannot take this config's attention, or None when it can."""
    c = config
    reasons = [
        (c.kv_lora_rank, "latent attention"),
        (c.attention_sinks, "attention sinks"),
        (c.qk_norm != "none", "q/k norm"),
        (c.clip_qkv, "q/k/v clamp"),
        (c.sliding_window, "sliding window"),
        (c.rope_interleaved, "interleaved rotary"),
        (c.rotary_dim != c.head_dim, "partial rotary"),
        (c.head_dim % 16, f"head_dim {c.head_dim} is not a multiple of 16"),  # the CPU kernel's rule with rotary
    ]
    return next((why for flag, why in reasons if flag), None)


def module_of(node: ir.Node) -> str:
    """The module path the exporter recorded for a node ('' when none)."""
    scopes = node.metadata_props.get(SCOPES)
    if not scopes:
        return ""
    path = ast.literal_eval(scopes)
    return path[-2] if len(path) >= 2 else ""


def rotary_tables(config: DecoderConfig, np_dtype: type, positions: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(positions, rotary_dim / 2) cos and sin, by default max_positions of them: the decoder's
    own rotary module evaluated at every position (YaRN's scaling included), half of each row
    since the halves repeat."""
    from moedeploy.models.decoder import rotary_embedding

    with torch.no_grad():
        cos, sin = rotary_embedding(config)(torch.arange(positions or config.max_positions))
    half = config.rotary_dim // 2
    return cos[:, :half].numpy().astype(np_dtype), sin[:, :half].numpy().astype(np_dtype)


class _Lengths:
    """seqlens_k and total_sequence_length for every layer's node, built once from the graph's
    inputs: row b's cache holds P_b positions, S tokens arrive, the row has P_b + S after the step."""

    def __init__(self, graph: ir.Graph, input_ids: ir.Value, past_key: ir.Value,
                 past_lengths: ir.Value | None = None, query_lengths: ir.Value | None = None) -> None:
        """past_lengths: a graph input holding each row's P_b, (batch,) (a shared cache buffer's
        length is its capacity); without it every row holds the past's length. query_lengths:
        a graph input holding each row's count of new tokens, (batch,) (a ragged step); without
        it every row brings input_ids' S."""
        self.nodes: list[ir.Node] = []

        def add(op: str, inputs: list, **attrs) -> ir.Value:
            node = ir.node(op, inputs, attrs)
            self.nodes.append(node)
            return node.outputs[0]

        def const(value: int) -> ir.Value:
            return add("Constant", [], value=ir.tensor(value, dtype=ir.DataType.INT64))

        ids_shape = add("Shape", [input_ids])
        seq = add("Gather", [ids_shape, const(1)], axis=0)
        batch = add("Slice", [ids_shape, add("Constant", [], value=ir.tensor([0], dtype=ir.DataType.INT64)),
                              add("Constant", [], value=ir.tensor([1], dtype=ir.DataType.INT64))])
        if past_lengths is None:
            past = add("Expand", [add("Gather", [add("Shape", [past_key]), const(2)], axis=0), batch])
        else:
            past = past_lengths
        new = seq if query_lengths is None else query_lengths
        totals = add("Add", [past, new])  # (B,) int64: each row's length after the step
        self.total = add("Cast", [add("ReduceMax", [totals], keepdims=0)], to=ir.DataType.INT32)  # scalar
        self.seqlens_k = add("Cast", [add("Sub", [totals, const(1)])], to=ir.DataType.INT32)  # (B,): total - 1
        # how many of each row's S tokens are real: without this input the kernel refuses a
        # batch of multi-token steps over a cache
        if query_lengths is None:
            self.query_seqlens = add("Expand", [add("Cast", [seq], to=ir.DataType.INT32), batch])
        else:
            self.query_seqlens = add("Cast", [query_lengths], to=ir.DataType.INT32)
        graph.insert_before(graph.node(0), self.nodes)


#: the graph input a shared-buffer cache adds: how many positions each row of the buffers holds
#: so far, (batch,) int64
PAST_LENGTHS = "past_sequence_lengths"
#: the graph inputs a ragged step adds (kv_cache="ragged"), where input_ids is (1, T): the T
#: tokens of every row of the step, packed row after row. How many tokens each row brings,
#: (batch,) int64, each >= 1:
QUERY_LENGTHS = "query_lengths"
#: which packed token sits at each position of each row's right-padded chunk, (batch, S) int64,
#: S the longest row's count (a padding position may name any token: its rows are ignored)
PADDED_TOKENS = "padded_token_index"
#: each packed token's (row, position in the row's chunk), (1, T, 2) int64
TOKEN_SLOTS = "token_slots"


def ragged_indices(query_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PADDED_TOKENS and TOKEN_SLOTS for rows that bring query_lengths (B,) tokens each."""
    query_lengths = np.asarray(query_lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(query_lengths)[:-1]])
    chunk = np.arange(int(query_lengths.max()))
    padded = np.where(chunk < query_lengths[:, None], starts[:, None] + chunk, 0)
    rows = np.repeat(np.arange(len(query_lengths)), query_lengths)
    slots = np.stack([rows, np.arange(rows.size) - starts[rows]], axis=-1)[None]
    return padded, slots


def lower_attention(graph: ir.Graph, config: DecoderConfig, shared_cache: bool = False,
                    query_lengths: ir.Value | None = None) -> int:
    """Replace every qualifying layer's attention core by GroupQueryAttention; returns how many.

    shared_cache: the past and present of each layer are to be one preallocated buffer of
    capacity positions (bound to both with ONNX Runtime's IO binding), which GroupQueryAttention
    appends to in place; the graph then takes each row's cached length as the input
    `past_sequence_lengths` ((batch,) int64), since the buffer's shape no longer says it.

    query_lengths (a graph input, with shared_cache): a ragged step, in which each row brings
    its own number of tokens, so a prompt can join rows that decode one token each. Every node
    outside attention works per token, so it runs on input_ids (1, T), all the step's tokens
    packed; each layer's q, k and v go to GroupQueryAttention as one packed QKV tensor
    gathered into the rows' right-padded chunks (B, S) (its `query_seqlens` says how many
    are real), and the output is gathered back into packed order (the inputs PADDED_TOKENS
    and TOKEN_SLOTS, made by `ragged_indices`). Padding is never attended to; the kernel may
    write it into a row's cache past the row's length, where nothing reads it and the row's
    next tokens overwrite it."""
    if query_lengths is not None and not shared_cache:
        raise ValueError("a ragged step needs the shared-buffer cache")
    if eligible(config) is not None:
        return 0
    inputs = {v.name: v for v in graph.inputs}
    outputs = {v.name: i for i, v in enumerate(graph.outputs)}
    if "input_ids" not in inputs or "past_key_values.0.key" not in inputs:
        return 0
    dtype = inputs["past_key_values.0.key"].dtype
    if dtype not in GQA_DTYPES:
        return 0
    by_module: dict[str, list[ir.Node]] = {}
    for node in graph:
        by_module.setdefault(module_of(node), []).append(node)
    # a ragged step's padding rows sit past a row's length, up to twice max_positions (the
    # buffers' room, runtime/inflight.py): the tables cover them, so no padding row reads past
    # their end (their results are discarded, but the kernel may rotate them)
    positions = 2 * config.max_positions if query_lengths is not None else None
    cos, sin = rotary_tables(config, GQA_DTYPES[dtype], positions)
    cos_cache = constant_initializer(graph, "gqa.cos_cache", cos)
    sin_cache = constant_initializer(graph, "gqa.sin_cache", sin)
    lengths: _Lengths | None = None
    ragged: _RaggedMaps | None = None
    lowered = 0
    for layer in range(config.n_layers):
        scope = f"decoder.layers.{layer}.attn"
        found = _core_boundary(graph, by_module, scope, layer, inputs, outputs)
        if found is None:
            continue
        (q, k, v, past_k, past_v), (attn_out, present_k, present_v) = found
        if lengths is None:
            past_lengths = None
            if shared_cache:
                rows = inputs["input_ids"].shape[0] if query_lengths is None else "rows"
                past_lengths = ir.Value(name=PAST_LENGTHS, shape=ir.Shape([rows]), type=ir.TensorType(ir.DataType.INT64))
                graph.inputs.append(past_lengths)
            lengths = _Lengths(graph, inputs["input_ids"], inputs["past_key_values.0.key"], past_lengths,
                               query_lengths)
            ragged = _RaggedMaps(graph) if query_lengths is not None else None
        consumer = next(use.node for use in attn_out.uses())
        if ragged is not None:
            q, k, v = ragged.pad(graph, consumer, q, k, v), None, None
        gqa = ir.node(
            "GroupQueryAttention",
            [q, k, v, past_k, past_v, lengths.seqlens_k, lengths.total, cos_cache, sin_cache,
             *[None] * 7, lengths.query_seqlens],
            {"num_heads": config.n_heads, "kv_num_heads": config.n_kv_heads, "do_rotary": 1,
             "scale": config.attention_scale or config.head_dim**-0.5},
            domain=CONTRIB_DOMAIN, num_outputs=3, name=f"{scope}.GroupQueryAttention",
        )
        gqa.metadata_props[SCOPES] = str(["", "decoder", f"decoder.layers.{layer}", scope, "gqa"])
        graph.insert_before(consumer, gqa)
        out, new_k, new_v = gqa.outputs
        if ragged is not None:
            out = ragged.pack(graph, consumer, out)
        ir.convenience.replace_all_uses_with(attn_out, out)
        for old, new in ((present_k, new_k), (present_v, new_v)):
            name = old.name
            old.name = f"{name}.traced"
            graph.outputs[outputs[name]] = new
            new.name = name
        lowered += 1
    if lowered:
        graph.opset_imports.setdefault(CONTRIB_DOMAIN, 1)
    return lowered


class _RaggedMaps:
    """The two graph inputs that map a ragged step's packed tokens to the rows' padded chunks
    and back, and the nodes that apply them around each layer's GroupQueryAttention."""

    def __init__(self, graph: ir.Graph) -> None:
        int64 = ir.TensorType(ir.DataType.INT64)
        self.padded = ir.Value(name=PADDED_TOKENS, shape=ir.Shape(["rows", "chunk"]), type=int64)
        self.slots = ir.Value(name=TOKEN_SLOTS, shape=ir.Shape([1, "tokens", 2]), type=int64)
        graph.inputs.extend([self.padded, self.slots])
        self.axis0 = constant_initializer(graph, "ragged.axis0", np.array([0], dtype=np.int64))

    def pad(self, graph: ir.Graph, before: ir.Node, q: ir.Value, k: ir.Value, v: ir.Value) -> ir.Value:
        """(1, T, *) q, k, v -> (B, S, q + k + v widths): GroupQueryAttention's packed QKV input."""
        qkv = ir.node("Concat", [q, k, v], {"axis": -1})
        gathered = ir.node("Gather", [qkv.outputs[0], self.padded], {"axis": 1})  # (1, B, S, d)
        padded = ir.node("Squeeze", [gathered.outputs[0], self.axis0])
        graph.insert_before(before, [qkv, gathered, padded])
        return padded.outputs[0]

    def pack(self, graph: ir.Graph, before: ir.Node, out: ir.Value) -> ir.Value:
        """(B, S, D) attention output -> (1, T, D), the packed tokens' rows."""
        packed = ir.node("GatherND", [out, self.slots])
        graph.insert_before(before, packed)
        return packed.outputs[0]


def use_packed_qkv(graph: ir.Graph) -> int:
    """Where one Split makes a layer's q, k and v (one projection of the three, as
    quantized.fuse_shared_input leaves them) and they go only to GroupQueryAttention's query,
    key and value (or, in a ragged step, to the Concat that packs them for it), hand it the
    Split's input, the packed QKV it takes, and drop the Split (and the Concat); returns how
    many layers."""
    packed = 0
    for node in list(graph):
        if node.op_type != "Split" or node.domain not in ("", "ai.onnx") or len(node.outputs) != 3:
            continue
        axis = node.attributes["axis"].as_int() if "axis" in node.attributes else 0
        uses = [list(out.uses()) for out in node.outputs]
        if any(len(u) != 1 or out.is_graph_output() for u, out in zip(uses, node.outputs, strict=True)):
            continue
        consumer = uses[0][0].node
        if any(u[0].node is not consumer or u[0].idx != i for i, u in enumerate(uses)):
            continue
        qkv = node.inputs[0]
        if consumer.op_type == "GroupQueryAttention" and consumer.domain == CONTRIB_DOMAIN and axis in (-1, 2):
            consumer.replace_input_with(0, qkv)
            consumer.replace_input_with(1, None)
            consumer.replace_input_with(2, None)
        elif consumer.op_type == "Concat" and len(consumer.inputs) == 3 and \
                consumer.attributes["axis"].as_int() == axis and axis == -1 and packs_qkv_for_gqa(consumer):
            ir.convenience.replace_all_uses_with(consumer.outputs[0], qkv)
            graph.remove(consumer, safe=True)
        else:
            continue
        graph.remove(node, safe=True)
        packed += 1
    return packed


def packs_qkv_for_gqa(concat: ir.Node) -> bool:
    """Whether a Concat's output is _RaggedMaps.pad's gather of packed QKV for GroupQueryAttention."""
    return all(use.node.op_type == "Gather" and use.node.inputs[1] is not None and use.node.inputs[1].name == PADDED_TOKENS
               for use in concat.outputs[0].uses())


def cache_read_only_by_gqa(graph: ir.Graph) -> str | None:
    """Why a shared-buffer cache would be read wrongly (a node other than GroupQueryAttention
    reads a past input, say its shape, which is now the capacity), or None when it is safe."""
    for value in graph.inputs:
        if value.name.startswith("past_key_values."):
            for use in value.uses():
                if use.node.op_type == "GroupQueryAttention" and use.idx in (3, 4):
                    continue
                if use.node.op_type == "Shape" and not _shape_reads_axis(use.node, 2, rank=4):
                    continue  # the batch size, say: the same in a shared buffer
                return f"{use.node.op_type} node {use.node.name!r} reads {value.name}"
    return None


def batch_from_packed_tokens(graph: ir.Graph) -> None:
    """In a ragged step the cache buffers have a row per sequence while every other tensor has
    the one batch row of the packed tokens: a traced Shape of a past input that reads its batch
    size (to reshape the hidden states, say) reads input_ids' instead. Raises ValueError for a
    Shape of a past that reads any other axis (left to GroupQueryAttention's inputs only)."""
    input_ids = next(v for v in graph.inputs if v.name == "input_ids")
    for value in graph.inputs:
        if not value.name.startswith("past_key_values."):
            continue
        for use in list(value.uses()):
            node = use.node
            if node.op_type != "Shape":
                continue
            if any(_shape_reads_axis(node, axis, rank=4) for axis in (1, 2, 3)):
                raise ValueError(f"Shape node {node.name!r} reads more than the batch size of {value.name}")
            node.replace_input_with(0, input_ids)


def _shape_reads_axis(node: ir.Node, axis: int, rank: int) -> bool:
    """Whether a Shape node's [start, end) slice of the dims includes `axis`."""
    start = node.attributes["start"].as_int() if "start" in node.attributes else 0
    end = node.attributes["end"].as_int() if "end" in node.attributes else rank
    start, end = (max(0, min(rank, d + rank if d < 0 else d)) for d in (start, end))
    return start <= axis < end


def constant_initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """`array` registered as an initializer of `graph` under `name` (the lowerings' new constants)."""
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                     const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


#: ops a traced attention core may consist of (reshapes, the rotary rotation, the KV concat)
CORE_OPS = {"Reshape", "Transpose", "Split", "Slice", "Neg", "Concat", "Mul", "Add", "Sub", "Unsqueeze", "Squeeze",
            "Cast", "Attention"}


def _core_boundary(
    graph: ir.Graph, by_module: dict[str, list[ir.Node]], scope: str, layer: int,
    inputs: dict[str, ir.Value], outputs: dict[str, int],
) -> tuple[tuple[ir.Value, ...], tuple[ir.Value, ...]] | None:
    """((q, k, v, past_key, past_value), (output, present_key, present_value)) of one layer's
    attention core, or None unless the core is exactly what GroupQueryAttention computes.

    The core is every node on a path from the q/k/v projections and the past to the output
    projection's input and the present. It must consist of CORE_OPS with one ONNX Attention
    node, nothing it computes may be read outside it, and whatever else it reads (rotary
    tables, the mask, target shapes) must depend on tensor shapes and constants only, which
    GroupQueryAttention derives itself.
    """
    q, k, v = (_scope_output(by_module.get(f"{scope}.{w}", [])) for w in ("wq", "wk", "wv"))
    out = _scope_input(by_module.get(f"{scope}.wo", []))
    past = inputs.get(f"past_key_values.{layer}.key"), inputs.get(f"past_key_values.{layer}.value")
    present = tuple(graph.outputs[outputs[n]] if n in outputs else None
                    for n in (f"present.{layer}.key", f"present.{layer}.value"))
    starts, ends = (q, k, v, *past), (out, *present)
    if None in starts or None in ends:
        return None
    core = _forward(starts) & _backward(ends, set(starts))
    if not core or any(n.op_type not in CORE_OPS or n.domain not in ("", "ai.onnx") for n in core):
        return None
    if sum(n.op_type == "Attention" for n in core) != 1:
        return None
    produced = {val for n in core for val in n.outputs}
    for val in produced:
        if val not in ends and (val.is_graph_output() or any(use.node not in core for use in val.uses())):
            return None  # an intermediate value someone else reads
    if any(val not in produced for val in ends):
        return None
    shape_only: dict[ir.Value, bool] = {}
    for n in core:
        for val in n.inputs:
            if val is not None and val not in produced and val not in starts and not _shape_only(val, shape_only):
                return None
    return starts, ends  # type: ignore[return-value]


def _scope_output(nodes: list[ir.Node]) -> ir.Value | None:
    """The one value a module's nodes hand to the rest of the graph (a projection's output)."""
    members = set(nodes)
    found = {val for n in nodes for val in n.outputs if any(use.node not in members for use in val.uses())}
    return found.pop() if len(found) == 1 else None


def _scope_input(nodes: list[ir.Node]) -> ir.Value | None:
    """The one activation a module's nodes read from outside (a projection's input)."""
    members = set(nodes)
    found = {val for n in nodes for val in n.inputs
             if val is not None and not val.is_initializer() and val.producer() not in members
             and not (val.producer() is not None and val.producer().op_type == "Constant")}
    return found.pop() if len(found) == 1 else None


def _forward(starts: tuple[ir.Value, ...]) -> set[ir.Node]:
    """Nodes that read the contents of `starts`, directly or not (a Shape reads no contents)."""
    seen: set[ir.Node] = set()
    todo = [use.node for val in starts for use in val.uses()]
    while todo:
        node = todo.pop()
        if node not in seen and node.op_type != "Shape":
            seen.add(node)
            todo.extend(use.node for val in node.outputs for use in val.uses())
    return seen


def _backward(ends: tuple[ir.Value, ...], stop: set[ir.Value]) -> set[ir.Node]:
    seen: set[ir.Node] = set()
    todo = [val.producer() for val in ends]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(val.producer() for val in node.inputs if val is not None and val not in stop)
    return seen


def _shape_only(value: ir.Value, memo: dict[ir.Value, bool]) -> bool:
    """Whether a value depends on tensor shapes and constants only, never on tensor contents."""
    if value in memo:
        return memo[value]
    producer = value.producer()
    if value.is_initializer() or value.const_value is not None:
        result = True
    elif producer is None:
        result = False  # a graph input's contents
    elif producer.op_type == "Shape":
        result = True
    else:
        memo[value] = False  # cycles cannot occur in a DAG; this only guards deep recursion
        result = all(_shape_only(val, memo) for val in producer.inputs if val is not None)
    memo[value] = result
    return result
