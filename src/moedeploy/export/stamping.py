"""Build an N-layer decoder graph from a trace of its first few layers.

Why: torch.onnx.export costs about 3 s a decoder layer on a 2-core CPU (tracing, decomposing
and translating the same layer again and again), so a 32-layer checkpoint spent minutes in
the tracer for layers it had already traced. Layers of one kind give the same ONNX nodes
apart from their names: the ones that differ are told apart by what the layer modules are
(their types, attributes and weight shapes) and by the attention window the decoder hands
each layer. So the decoder is traced with the shortest prefix of layers that holds every kind
at least once, and every later layer is a copy of the last traced layer of its
kind: its nodes renamed, its cache inputs/outputs and weights those of its own index.

Nothing is assumed that is not checked: a layer's nodes are those torch scoped to it, and a
copy is made only when each traced layer reads nothing of another layer but the hidden state
of the one before it, and only the last layer's hidden state leaves the layers. Anything else
raises CannotStamp and the caller traces every layer.
"""

from __future__ import annotations

import dataclasses
import re

import onnx_ir as ir
import torch
from torch import nn

from moedeploy.export.onnx_export import SCOPE_KEY, parse_scopes
from moedeploy.models.config import DecoderConfig

_LAYER_SCOPE = re.compile(r"decoder\.layers\.(\d+)$")
_LAYER_WEIGHT = re.compile(r"^layers\.(\d+)\.")
#: a KV-cache input or output: past_key_values.<layer>.key, present.<layer>.value
_CACHE = re.compile(r"^(past_key_values|present)\.(\d+)\.(key|value)$")


class CannotStamp(Exception):
    """The traced prefix does not have the shape copying needs; trace every layer instead."""


def layer_signatures(config: DecoderConfig) -> list[str]:
    """What each layer's graph is a function of: every module's type, plain attributes and
    parameter shapes, and the layer's attention window. Built on the meta device (no memory),
    where a tensor has no values: a layer holding a tensor that is not a weight (a buffer left
    out of the state dict, a tensor attribute), or an object known only by its address, is a
    kind of its own, never copied."""
    from moedeploy.models.decoder import MoEDecoder

    with torch.device("meta"):
        decoder = MoEDecoder(config)
    signatures = []
    for i, layer in enumerate(decoder.layers):
        fingerprint = _module_fingerprint(layer)
        signatures.append(f"{config.window(i)}|{fingerprint}" if fingerprint is not None else f"layer {i} alone")
    return signatures


def _module_fingerprint(module: nn.Module) -> str | None:
    """The module tree's types, attributes and weight shapes; None where a value the graph may
    hold cannot be read here."""
    parts = []
    for name, m in module.named_modules():
        attrs = []
        for key, value in sorted(vars(m).items()):
            if key.startswith("_") or key == "training" or isinstance(value, nn.Module):
                continue
            if isinstance(value, torch.Tensor):
                return None
            text = repr(value)
            if " at 0x" in text:
                qualname = getattr(value, "__qualname__", None)
                if qualname is None:
                    return None
                text = f"{getattr(value, '__module__', '')}.{qualname}"  # a function, by its name
            attrs.append((key, text))
        if m._non_persistent_buffers_set:
            return None  # constants of the graph, not weights: their values are not compared
        params = [(n, tuple(p.shape), str(p.dtype)) for n, p in m.named_parameters(recurse=False)]
        buffers = [(n, tuple(b.shape), str(b.dtype)) for n, b in m.named_buffers(recurse=False)]
        parts.append((name, type(m).__qualname__, attrs, params, buffers))
    return repr(parts)


def traced_prefix(signatures: list[str]) -> int | None:
    """How many leading layers to trace so that every later layer has a traced layer of its
    kind; None when that is every layer (nothing to gain)."""
    n = len(signatures)
    for k in range(1, n):
        if set(signatures[k:]) <= set(signatures[:k]):
            return k
    return None


def prefix_config(config: DecoderConfig, k: int) -> DecoderConfig:
    """The decoder cut to its first k layers (the per-layer lists cut with it)."""
    sliding = None if config.sliding_layers is None else [i for i in config.sliding_layers if i < k]
    return dataclasses.replace(config, n_layers=k, dense_layers=[i for i in config.dense_layers if i < k],
                               sliding_layers=sliding)


def weight_layer(name: str) -> int | None:
    """The layer a weight of ours belongs to ("layers.3.attn.wq.weight" -> 3), None for others."""
    m = _LAYER_WEIGHT.match(name)
    return int(m[1]) if m else None


def _node_layer(node: ir.Node) -> tuple[bool, int | None]:
    """(whether torch scoped the node, the decoder layer it scoped it to if any)."""
    scopes = parse_scopes(node.metadata_props.get(SCOPE_KEY))
    if not scopes:
        return False, None
    for scope in scopes:
        m = _LAYER_SCOPE.match(scope)
        if m:
            return True, int(m[1])
    return True, None


def _renumber(text: str, old: int, new: int) -> str:
    """`layers.<old>` -> `layers.<new>` wherever it is a whole index (layers.1 is not layers.10)."""
    return re.sub(rf"(?<=layers\.){old}(?!\d)", str(new), text)


def stamp_layers(graph: ir.Graph, lifted: dict[str, tuple[ir.Value, str]], signatures: list[str]) -> None:
    """Grow the traced prefix in `graph` to len(signatures) layers, in place.

    The graph is the optimised trace with its weights still graph inputs (`lifted`: value name
    -> (value, our weight name)); each copied layer gets weight inputs of its own, added to
    `lifted`, so the weights are folded and written for every layer alike afterwards."""
    n = len(signatures)
    weight_layers = {name: weight_layer(ours) for name, (_, ours) in lifted.items()}
    regions = _layer_regions(graph, weight_layers)
    k = len(regions)
    if sorted(regions) != list(range(k)) or k != traced_prefix(signatures):
        raise CannotStamp(f"the trace's layers are {sorted(regions)}, of {n}")
    hidden = {q: _hidden_output(graph, regions[q], q) for q in range(k)}
    hidden[-1] = _embedding_output(regions[0])
    for q in range(k):
        _check_reads(regions[q], q, hidden[q - 1], weight_layers)
    last_readers = [(u.node, u.idx) for u in hidden[k - 1].uses() if u.node.meta.get(_LAYER) is None]
    if not last_readers:
        raise CannotStamp("nothing reads the last layer's output")
    # torch's own nodes on both sides of each hand-over: an optimiser's node there (a Cast, an
    # Identity) could belong to either side, and would be copied with the layer or left out
    if any(_node_layer(hidden[q].producer()) != (True, q) for q in range(k)) or any(
            not _node_layer(node)[0] for node, _ in last_readers):
        raise CannotStamp("a layer's output is made or read by a node torch did not scope")

    inputs = {v.name: v for v in graph.inputs}
    outputs = {v.name for v in graph.outputs}
    taken = Names(set(inputs) | set(graph.initializers) | {o.name for node in graph for o in node.outputs},
                  {node.name for node in graph if node.name})
    previous = hidden[k - 1]
    for j in range(k, n):
        q = max(i for i in range(k) if signatures[i] == signatures[j])
        copy = _LayerCopy(graph, q, j, inputs, outputs, lifted, taken)
        previous = copy.run(regions[q], hidden[q - 1], previous, hidden[q])
    for node, index in last_readers:
        node.replace_input_with(index, previous)
    _order_graph(graph)


_LAYER = "moedeploy.layer"
_VARYING = "moedeploy.varying"


@dataclasses.dataclass
class Names:
    """The value and node names a graph already uses (ONNX wants each unique)."""

    values: set[str]
    nodes: set[str]


#: ops whose output is a size, the same for every layer whatever the data it reads
_SIZE_OPS = frozenset({"Shape", "Size"})


def _layer_regions(graph: ir.Graph, weight_layers: dict[str, int | None]) -> dict[int, list[ir.Node]]:
    """Each layer's nodes: the nodes that read values following the data (the tokens, a cache,
    a weight; not only their shapes) or a layer's values, each in the layer torch scoped it to
    or, unscoped (the optimiser's), in the layer of what it reads. A node computed from sizes
    of graph inputs and constants alone (positions, rotary tables, masks, reshape targets)
    gives every layer the same value: it is shared wherever torch scoped it, and the copies
    read it as the traced layers do."""
    regions: dict[int, list[ir.Node]] = {}
    varying: set[int] = {id(v) for v in graph.inputs}
    for node in graph:
        reads_data = any(v is not None and id(v) in varying for v in node.inputs)
        reads_layer = any(v is not None and v.producer() is not None and v.producer().meta.get(_LAYER) is not None
                          for v in node.inputs)
        if not (reads_data or reads_layer):
            continue
        if reads_data and not (node.op_type in _SIZE_OPS and node.domain == ""):
            varying.update(id(o) for o in node.outputs)
        has_scope, layer = _node_layer(node)
        if not has_scope:
            read = set()
            for v in node.inputs:
                if v is None:
                    continue
                producer = v.producer()
                if producer is not None:
                    read.add(producer.meta.get(_LAYER))
                elif id(v) in varying:
                    read.add(weight_layers.get(v.name, _cache_layer(v.name)))
            read.discard(None)
            if len(read) > 1:
                raise CannotStamp(f"node {node.name} reads values of layers {sorted(read)}")
            layer = read.pop() if read else None
        if layer is None:
            continue  # the decoder's own: the embedding, the final norm, the LM head
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            raise CannotStamp(f"node {node.name} of layer {layer} holds a subgraph")
        node.meta[_LAYER] = layer
        regions.setdefault(layer, []).append(node)
    for node in graph:
        if any(id(o) in varying for o in node.outputs):
            node.meta[_VARYING] = True
    return regions


def _hidden_output(graph: ir.Graph, nodes: list[ir.Node], q: int) -> ir.Value:
    """The one value of layer q that something outside layer q reads; its other values may
    only leave as its present.<q>.* outputs."""
    graph_outputs = {id(v): v.name for v in graph.outputs}
    leaving = []
    for node in nodes:
        for out in node.outputs:
            if any(u.node.meta.get(_LAYER) != q for u in out.uses()):
                leaving.append(out)
            name = graph_outputs.get(id(out))
            if name is not None and not name.startswith(f"present.{q}."):
                raise CannotStamp(f"layer {q} computes the graph output {name}")
    if len(leaving) != 1:
        raise CannotStamp(f"layer {q} hands {len(leaving)} values to the rest of the graph")
    return leaving[0]


def _embedding_output(nodes: list[ir.Node]) -> ir.Value:
    """What layer 0 reads as its hidden state: the one value following the data (not a weight,
    not a cache) that it reads from the rest of the graph."""
    inside = {id(o) for node in nodes for o in node.outputs}
    candidates = {id(v): v for node in nodes for v in node.inputs
                  if v is not None and id(v) not in inside and v.producer() is not None
                  and v.producer().meta.get(_VARYING)}
    if len(candidates) != 1:
        raise CannotStamp(f"layer 0 reads {len(candidates)} values of the data from the rest of the graph")
    return next(iter(candidates.values()))


def _check_reads(nodes: list[ir.Node], q: int, hidden_in: ir.Value, weight_layers: dict[str, int | None]) -> None:
    """Layer q reads nothing of another layer (values, weights, caches) but `hidden_in`."""
    for node in nodes:
        for value in node.inputs:
            if value is None or value is hidden_in:
                continue
            producer = value.producer()
            other = producer.meta.get(_LAYER) if producer is not None else weight_layers.get(value.name)
            if other is None and value.is_graph_input():
                other = _cache_layer(value.name)
            if other is not None and other != q:
                raise CannotStamp(f"layer {q} reads {value.name} of layer {other}")


def _cache_layer(name: str) -> int | None:
    m = _CACHE.match(name)
    return int(m[2]) if m else None


class _LayerCopy:
    """Layer q's nodes once more, as layer j."""

    def __init__(self, graph: ir.Graph, q: int, j: int, inputs: dict[str, ir.Value], outputs: set[str],
                 lifted: dict[str, tuple[ir.Value, str]], taken: Names) -> None:
        self.graph, self.q, self.j = graph, q, j
        self.inputs, self.outputs, self.lifted, self.taken = inputs, outputs, lifted, taken
        self.mapping: dict[int, ir.Value] = {}

    def run(self, nodes: list[ir.Node], hidden_in: ir.Value, previous: ir.Value, hidden_out: ir.Value) -> ir.Value:
        """Copy `nodes` reading `previous` where layer q read `hidden_in`; returns the copy of
        `hidden_out`."""
        self.mapping[id(hidden_in)] = previous
        copies = [self._node(node) for node in nodes]
        self.graph.extend(copies)
        return self.mapping[id(hidden_out)]

    def _node(self, node: ir.Node) -> ir.Node:
        q, j = self.q, self.j
        inputs = [None if v is None else self._read(v) for v in node.inputs]
        attributes = [ir.Attr(a.name, a.type, a.value, doc_string=a.doc_string) for a in node.attributes.values()]
        copy = ir.Node(node.domain, node.op_type, inputs, attributes, overload=node.overload,
                       num_outputs=len(node.outputs), version=node.version,
                       name=self._fresh(node.name, self.taken.nodes) if node.name else None,
                       doc_string=node.doc_string,
                       metadata_props={key: _renumber(text, q, j) for key, text in node.metadata_props.items()})
        for old, new in zip(node.outputs, copy.outputs, strict=True):
            new.shape = None if old.shape is None else ir.Shape(list(old.shape))
            new.type = old.type
            if old.name in self.outputs:
                new.name = _renumber_cache(old.name, q, j)
                self.graph.outputs.append(new)
            else:
                new.name = self._fresh(old.name, self.taken.values)
            self.mapping[id(old)] = new
        copy.meta[_LAYER] = j
        return copy

    def _read(self, value: ir.Value) -> ir.Value:
        """What layer j reads where layer q read `value`: its own copy of a layer value, cache
        input or weight; anything shared (positions, rotary tables, masks, sizes, constants,
        tied embeddings) as it is."""
        key = id(value)
        if key in self.mapping:
            return self.mapping[key]
        if not value.is_graph_input():
            return value
        if _cache_layer(value.name) == self.q:
            new = ir.Value(name=_renumber_cache(value.name, self.q, self.j), shape=ir.Shape(list(value.shape)),
                           type=value.type)
        elif value.name in self.lifted and weight_layer(self.lifted[value.name][1]) == self.q:
            ours = _renumber(self.lifted[value.name][1], self.q, self.j)
            new = ir.Value(name=self._fresh(value.name, self.taken.values), shape=ir.Shape(list(value.shape)),
                           type=value.type)
            self.lifted[new.name] = (new, ours)
        else:
            return value
        self.graph.inputs.append(new)
        self.inputs[new.name] = new
        self.mapping[key] = new
        return new

    def _fresh(self, name: str, taken: set[str]) -> str:
        renamed = _renumber(name, self.q, self.j)
        if renamed == name:
            renamed = f"{name}__layer{self.j}"
        if renamed in taken:
            raise CannotStamp(f"the copy of layer {self.q} as layer {self.j} would reuse the name {renamed}")
        taken.add(renamed)
        return renamed


def _renumber_cache(name: str, q: int, j: int) -> str:
    """past_key_values.<q>.key -> past_key_values.<j>.key; present.<q>.value likewise."""
    m = _CACHE.match(name)
    return f"{m[1]}.{j}.{m[3]}" if m and int(m[2]) == q else name


def _order_graph(graph: ir.Graph) -> None:
    """Inputs and outputs in layer order, as a full trace lists them, and every node after
    what it reads."""
    def cache_order(value: ir.Value) -> tuple[int, int, bool]:
        m = _CACHE.match(value.name or "")
        return (1, int(m[2]), m[3] == "value") if m else (0, 0, False)

    for values in (graph.inputs, graph.outputs):
        ordered = sorted(values, key=cache_order)  # stable: input_ids, logits and weights keep their places
        values.clear()
        values.extend(ordered)
    graph.sort()
