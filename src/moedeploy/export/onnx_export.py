"""nn.Module -> checked ONNX ModelProto with the custom ops' function bodies attached."""

from __future__ import annotations

import ast
import contextlib
import copy
import gc
import io
import logging
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import onnx
import torch

from moedeploy.plugins import CUSTOM_OPS, moe

OPSET = 23
#: Node metadata where torch's exporter records the PyTorch module path of every node:
#: ["", "decoder", "decoder.layers.0", "decoder.layers.0.ffn", <fx node name>].
SCOPE_KEY = "pkg.torch.onnx.name_scopes"


class ExportError(RuntimeError):
    """Tracing or checking the ONNX graph failed."""


def export_failure(e: Exception) -> BaseException:
    """What to raise for the exception torch.onnx.export raised: a Ctrl-C (or SIGTERM's exit) it
    caught and wrapped, found in the chain, as itself, so the command says `interrupted` rather
    than blaming the model; anything else as one ExportError line, without the terminal colour
    codes torch puts in its messages."""
    seen: set[int] = set()
    link: BaseException | None = e
    while link is not None and id(link) not in seen:
        if isinstance(link, (KeyboardInterrupt, SystemExit)):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).splitlines()
    return ExportError(f"torch.onnx.export failed: {type(e).__name__}: {lines[0] if lines else ''}")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.onnx prints progress lines and warnings of its own; our CLI shows its own progress."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


class _HeldWhileInside:
    """A process-wide change held while any thread is inside, undone when the last one leaves.

    Traces in several threads overlap: each shares the one change, and none undoes what another
    still relies on. `apply` runs as the first comes in, `undo` as the last goes out, also when
    the code inside fails."""

    def __init__(self, apply: Callable[[], None], undo: Callable[[], None]) -> None:
        self._apply, self._undo = apply, undo
        self._lock = threading.Lock()
        self._inside = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        entered = False
        try:
            with self._lock:
                self._inside += 1
                entered = True
                if self._inside == 1:
                    self._apply()
            yield
        finally:
            if entered:
                with self._lock:
                    self._inside -= 1
                    if self._inside == 0:
                        self._undo()


#: objects allocated between the collector's youngest-generation passes while tracing (Python's own: 700)
TRACE_GC_THRESHOLD = 10_000
_threshold_before: tuple[int, ...] = gc.get_threshold()  # the collector's, when the first trace came in


def _raise_threshold() -> None:
    global _threshold_before
    _threshold_before = gc.get_threshold()
    if _threshold_before[0]:  # 0: the caller turned automatic collection off; leave it so
        gc.set_threshold(max(_threshold_before[0], TRACE_GC_THRESHOLD), *_threshold_before[1:])


def _restore_threshold() -> None:
    gc.set_threshold(*_threshold_before)


_raised_threshold = _HeldWhileInside(_raise_threshold, _restore_threshold)


def fewer_collections() -> contextlib.AbstractContextManager[None]:
    """Let the garbage collector run about 14 times less often while torch traces.

    torch.export and the ONNX translation allocate millions of short-lived objects (FX nodes,
    sympy expressions, fake tensors), so at Python's default threshold the collector runs over
    a thousand times an export, eight of them full passes over every object the process holds.
    `moedeploy export decoder --preset small`, three runs alternating with and without this
    (2-core EPYC): time in the collector 2.25 -> 1.36 s, the export 18.9 -> 17.5 s (means),
    peak memory 1.15-1.16 GB either way: garbage is freed a little later, not kept. In a long-
    lived process (a test worker holding many models) each full pass costs more, and so this
    saves more. The threshold is the process's: traces in several threads share one raise, and
    the last to leave puts back what was there before the first came in, whatever happens inside."""
    return _raised_threshold.held()


_REGISTRIES: dict[Any, tuple[Any, Any]] = {}  # (builder, class, its arguments) -> (what it read, the registry)
_REGISTRIES_LOCK = threading.Lock()
_from_torchlib: Any = None  # torch's own ONNXRegistry.from_torchlib, while ours replaces it
_installed: Any = None  # ours, as set on the class: put torch's back only where ours still is


def _registry_class() -> Any:
    """torch's exporter's registry class, or None where this torch keeps it elsewhere (then every
    export builds its own, as torch does)."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        return None
    registries = getattr(_registration, "ONNXRegistry", None)
    if registries is None or not isinstance(registries.__dict__.get("from_torchlib"), classmethod):
        return None
    return registries


def _registry_inputs() -> tuple[int, ...] | None:
    """What a registry is built from, counted: the operators torch's dispatcher knows (a library
    imported later, torchvision or torch.ao's quantized_decomposed, adds some that the registry
    then maps), torch's own torchlib functions and onnxscript's. A remembered registry is used
    only while these are unchanged (about 5 ms to count); None where they cannot be counted,
    and then nothing is remembered."""
    try:
        from onnxscript.function_libs.torch_lib import registration
        from torch.onnx._internal.exporter._torchlib import _torchlib_registry

        onnxscript_functions = sum(len(f.overloads) + len(f.complex) for f in registration.default_registry.values())
        return (len(torch._C._dispatch_get_all_op_names()), len(list(_torchlib_registry.get_torchlib_ops())),
                onnxscript_functions)
    except Exception:  # another torch or onnxscript: build every time, as torch does
        return None


def _registry_copy(registry: Any) -> Any:
    """A registry of its own for one export: the same entries in new lists, so that an export
    registering a function of its own (torch.onnx.export's custom_translation_table) changes
    only its copy, never the registry the next export starts from."""
    fresh = copy.copy(registry)
    fresh.functions = {target: list(metas) for target, metas in registry.functions.items()}
    return fresh


def _reuse_registries() -> None:
    global _from_torchlib, _installed
    registries = _registry_class()
    if registries is None:
        return
    _from_torchlib = registries.__dict__["from_torchlib"]
    build = _from_torchlib.__func__

    def from_torchlib(cls: Any, *args: Any, **kwargs: Any) -> Any:
        key = (build, cls, args, tuple(sorted(kwargs.items())))
        with _REGISTRIES_LOCK:
            read, built = _REGISTRIES.get(key, (None, None))
        if built is None or read is None or read != _registry_inputs():
            built = build(cls, *args, **kwargs)
            read = _registry_inputs()  # after the build, which imports onnxscript's functions the first time
            with _REGISTRIES_LOCK:
                _REGISTRIES[key] = (read, built)
        return _registry_copy(built)

    _installed = classmethod(from_torchlib)
    registries.from_torchlib = _installed


def _stop_reusing_registries() -> None:
    """Put torch's builder back, unless someone replaced ours meanwhile (a test's mock, another
    library's patch): theirs stays, and restores what it found when it ends."""
    global _from_torchlib, _installed
    registries = _registry_class()
    if _installed is not None and registries is not None and registries.__dict__.get("from_torchlib") is _installed:
        registries.from_torchlib = _from_torchlib
    _from_torchlib = _installed = None


_reused_registries = _HeldWhileInside(_reuse_registries, _stop_reusing_registries)


def torchlib_registry_reused() -> contextlib.AbstractContextManager[None]:
    """Let torch.onnx.export build its registry of torchlib functions once per process, not once
    per export.

    Every torch.onnx.export call builds the registry anew: it looks up each of torchlib's some
    thousand functions and its torch operator, 1.4-1.6 s on a 2-core EPYC, about a third of
    tracing a block or the tiny decoder (4.7 s), and the same registry every time for one opset
    in one process while nothing new is loaded. While this is active, in any thread, torch's
    `ONNXRegistry.from_torchlib` hands each export a copy of the one it built for the same
    arguments, rebuilt when what it was built from has changed (`_registry_inputs`); once the
    last trace leaves, and in a torch that keeps the registry elsewhere, torch builds its own as
    always. tests/export/test_registry_reuse.py holds an export on the reused registry to the
    bytes of torch's own, also after a library registered new operators."""
    return _reused_registries.held()


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Around a torch.onnx.export call (a block's, the decoder's): torch's output quiet, fewer
    garbage collections, the torchlib registry reused, no autograd."""
    with _quiet(), fewer_collections(), torchlib_registry_reused(), torch.no_grad():
        yield


def attach_function_bodies(model: onnx.ModelProto) -> None:
    """Give every custom node a standard-op function body (the portable fallback).

    torch.onnx.export inlines model-local functions, so the bodies are added after export;
    each imports ai.onnx at the model's opset, as the checker requires.
    """
    used = {(n.domain, n.op_type) for n in _all_nodes(model.graph)}
    present = {(f.domain, f.name) for f in model.functions}
    for key, op_module in CUSTOM_OPS.items():
        if key in used and key not in present:
            model.functions.append(op_module.function_proto())
    domains = {o.domain for o in model.opset_import}
    for domain in {d for d, _ in used if (d, _) in CUSTOM_OPS}:
        if domain not in domains:
            model.opset_import.append(onnx.helper.make_opsetid(domain, moe.VERSION))


def _all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attr.g)


def custom_op_counts(model: onnx.ModelProto) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for node in _all_nodes(model.graph):
        key = (node.domain, node.op_type)
        if key in CUSTOM_OPS:
            counts[key] = counts.get(key, 0) + 1
    return counts


def name_scopes(node: onnx.NodeProto) -> list[str]:
    """The node's recorded scopes, outermost first: module paths, then the fx node's own name."""
    return parse_scopes(next((p.value for p in node.metadata_props if p.key == SCOPE_KEY), None))


def parse_scopes(text: str | None) -> list[str]:
    """The scopes torch's exporter records under SCOPE_KEY (a list written as Python), or []."""
    if not text:
        return []
    try:
        scopes = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return []
    return [str(s) for s in scopes] if isinstance(scopes, list) else []


def module_path(node: onnx.NodeProto, scope_prefix: str = "") -> str:
    """The PyTorch module a node was traced in ("layers.3.ffn"), `scope_prefix` stripped; ""
    for the exported module itself or when the exporter recorded nothing."""
    modules = name_scopes(node)[:-1]  # the last scope is the fx node, not a module
    path = modules[-1] if modules else ""
    return path[len(scope_prefix):] if scope_prefix and path.startswith(scope_prefix) else path


def name_custom_nodes(model: onnx.ModelProto, scope_prefix: str = "") -> None:
    """Name every custom node after its module (`layers.3.ffn`), as `named_modules()` does.

    torch names them `node__symbolic_N`, which tells a reader of `moedeploy check` or a
    profile nothing. Names stay unique: a clash gets `/1`, `/2`, ... appended; a node traced
    in the exported module itself is named after its op.
    """
    taken = {n.name for n in model.graph.node}
    for node in model.graph.node:
        if (node.domain, node.op_type) not in CUSTOM_OPS:
            continue
        base = module_path(node, scope_prefix) or node.op_type
        name, i = base, 0
        while name in taken and name != node.name:
            i += 1
            name = f"{base}/{i}"
        taken.discard(node.name)
        taken.add(name)
        node.name = name


_SUM_OF_DIMS = re.compile(r"\w+(?: \+ \w+)+")


def normalize_dim_sums(model: onnx.ModelProto) -> None:
    """Spell every symbolic sum of dims one way: its terms sorted (`past_seq + seq`).

    torch prints the same sum as `past_seq + seq` on one output and `seq + past_seq` on
    another; the manifest and TensorRT profiles read these names, so one dim gets one name.
    """
    values = [*model.graph.input, *model.graph.output, *model.graph.value_info]
    for value in values:
        for dim in value.type.tensor_type.shape.dim:
            if _SUM_OF_DIMS.fullmatch(dim.dim_param):
                dim.dim_param = " + ".join(sorted(dim.dim_param.split(" + ")))


def to_onnx(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_shapes: Any,
    scope_prefix: str = "",
) -> onnx.ModelProto:
    """Trace with torch.export (dynamo), optimise, attach function bodies, full-check.

    scope_prefix: the module path of the model inside an export wrapper (e.g. "decoder."),
    left out of node names so they read as the model's own `named_modules()`.
    """
    try:
        with tracing():
            program = torch.onnx.export(
                module,
                args,
                dynamo=True,
                opset_version=OPSET,
                input_names=list(input_names),
                output_names=list(output_names),
                dynamic_shapes=dynamic_shapes,
                optimize=True,
                verbose=False,
            )
    except Exception as e:
        raise export_failure(e) from e
    model = program.model_proto
    attach_function_bodies(model)
    name_custom_nodes(model, scope_prefix)
    normalize_dim_sums(model)
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"exported graph fails the ONNX checker: {str(e).splitlines()[0]}") from e
    return model
