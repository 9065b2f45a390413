"""What Triton is told about an artifact: model names, tensors, dims without the batch dim.

Triton batches along dim 0 when a model declares `max_batch_size >= 1` and then wants every
tensor's shape *without* that dim. Our artifacts name dim 0 of every input and output
"batch" (the decoder's KV cache included), so the server and the model repository writer
both read the dims from the manifest here, in one place: symbolic dims become -1.

The decoder gets two more models beside its logits graph: `<name>_generate`, the whole
generation loop behind one request (token ids in, the sequence with its continuation out),
and `<name>_stream`, a decoupled model that answers one request with one response per new
token as it is made (text or token ids in; the token and its text piece out), with the input
names of TensorRT-LLM's Triton backend where they fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moedeploy.export.artifact import Artifact

BATCH_DIM = "batch"
GENERATE_SUFFIX = "_generate"
STREAM_SUFFIX = "_stream"
TRITON_DTYPES = {
    "float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16",
    "int64": "TYPE_INT64", "int32": "TYPE_INT32", "bool": "TYPE_BOOL", "bytes": "TYPE_STRING",
}

# The generation model's tensors. Each optional input holds one value per request, sent as
# [batch, 1] (Triton batches every input along dim 0) with the same value in every row; an
# absent one takes the default of MoEDecoder.generate.
GENERATE_INPUT = "input_ids"
GENERATE_OUTPUT = "output_ids"
DEFAULT_MAX_NEW_TOKENS = 32
GENERATE_OPTIONS = {  # name -> dtype
    "max_new_tokens": "int64",
    "temperature": "float32",
    "top_k": "int64",
    "top_p": "float32",
    "seed": "int64",
    "eos_token_id": "int64",
}


# The streaming model's tensors (one value each unless said; TensorRT-LLM's names): the prompt
# as text (the artifact's tokenizer encodes it) or as input_ids, never both; each response
# carries the new token's id and its text piece (empty while a character is incomplete).
STREAM_TEXT_INPUT = "text_input"
STREAM_TEXT_OUTPUT = "text_output"
STREAM_STOP_INPUT = "stop"  # stop strings, [1, n]: the text ends before the first one found
STREAM_FINISH_OUTPUT = "finish_reason"  # "" until the last response: "stop" (EOS id, stop string) or "length"
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000  # characters in one stop string
STREAM_OPTIONS = {  # name -> dtype
    "max_tokens": "int64",
    "temperature": "float32",
    "top_k": "int64",
    "top_p": "float32",
    "seed": "int64",
}


class ServingError(ValueError):
    """An artifact or a setting that cannot be served as asked; the message says why."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as Triton declares it: dims exclude the batch dim, -1 is dynamic."""

    name: str
    dtype: str  # NumPy dtype name, as in the manifest
    dims: tuple[int, ...]
    optional: bool = False

    @property
    def triton_dtype(self) -> str:
        return TRITON_DTYPES[self.dtype]


@dataclass(frozen=True)
class ModelSpec:
    """One model on the server: its name, tensors and the largest batch one execution takes."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int


def default_max_batch_size(artifact: Artifact) -> int:
    """The batch range's max in the manifest: the TensorRT profile's limit, and the tested one."""
    return int(artifact.manifest["dynamic_ranges"][BATCH_DIM]["max"])


def _tensor(artifact: Artifact, spec: dict) -> TensorSpec:
    shape = spec["shape"]
    if not shape or shape[0] != BATCH_DIM:
        raise ServingError(
            f"{artifact.path}: tensor {spec['name']!r} has shape {shape}; Triton's dynamic batching "
            f"needs dim 0 of every tensor to be the {BATCH_DIM!r} dim"
        )
    dims = tuple(d if isinstance(d, int) else -1 for d in shape[1:])
    return TensorSpec(spec["name"], spec["dtype"], dims)


def graph_model(artifact: Artifact, max_batch_size: int | None = None) -> ModelSpec:
    """The artifact's graph as a Triton model: its manifest name and its own I/O names."""
    batch = max_batch_size if max_batch_size is not None else default_max_batch_size(artifact)
    if batch < 1:
        raise ServingError(f"max batch size must be >= 1 (Triton batches along dim 0), got {batch}")
    return ModelSpec(
        artifact.name,
        tuple(_tensor(artifact, s) for s in artifact.manifest["inputs"]),
        tuple(_tensor(artifact, s) for s in artifact.manifest["outputs"]),
        batch,
    )


def with_optional_past(model: ModelSpec) -> ModelSpec:
    """The logits model with its past_key_values.* inputs optional: absent means an empty cache.

    PyTriton's transport cannot carry a zero-sized tensor, so the prefill (past length 0)
    is asked for by leaving the cache out instead of sending it empty.
    """
    inputs = tuple(replace(t, optional=True) if t.name.startswith("past_key_values.") else t for t in model.inputs)
    return replace(model, inputs=inputs)


def generation_model(artifact: Artifact, max_batch_size: int | None = None) -> ModelSpec:
    """`<name>_generate`: input_ids [batch, seq] -> output_ids [batch, seq + new], options optional."""
    batch = graph_model(artifact, max_batch_size).max_batch_size
    options = tuple(TensorSpec(name, dtype, (1,), optional=True) for name, dtype in GENERATE_OPTIONS.items())
    return ModelSpec(
        artifact.name + GENERATE_SUFFIX,
        (TensorSpec(GENERATE_INPUT, "int64", (-1,)), *options),
        (TensorSpec(GENERATE_OUTPUT, "int64", (-1,)),),
        batch,
    )


def stream_model(artifact: Artifact) -> ModelSpec:
    """`<name>_stream`: text_input or input_ids [1, seq] -> a response per token (output_ids [1, 1],
    text_output [1, 1]); one request per execution (max batch 1), each with its own generation."""
    options = tuple(TensorSpec(name, dtype, (1,), optional=True) for name, dtype in STREAM_OPTIONS.items())
    return ModelSpec(
        artifact.name + STREAM_SUFFIX,
        (TensorSpec(STREAM_TEXT_INPUT, "bytes", (1,), optional=True),
         TensorSpec(GENERATE_INPUT, "int64", (-1,), optional=True), *options,
         TensorSpec(STREAM_STOP_INPUT, "bytes", (-1,), optional=True)),
        (TensorSpec(GENERATE_OUTPUT, "int64", (-1,)), TensorSpec(STREAM_TEXT_OUTPUT, "bytes", (1,)),
         TensorSpec(STREAM_FINISH_OUTPUT, "bytes", (1,))),
        1,
    )


def served_models(artifact: Artifact, max_batch_size: int | None = None) -> list[ModelSpec]:
    """Every model `moedeploy serve` puts on the server for this artifact."""
    if artifact.kind == "decoder":
        return [with_optional_past(graph_model(artifact, max_batch_size)), generation_model(artifact, max_batch_size),
                stream_model(artifact)]
    return [graph_model(artifact, max_batch_size)]


def _range(artifact: Artifact, label: str | int, batch: int) -> list:
    """[label, low, high] of one dim; a transport cannot carry an empty tensor, so low >= 1."""
    if isinstance(label, int):
        return [str(label), label, label]
    if label == BATCH_DIM:
        return [label, 1, batch]
    r = artifact.manifest["dynamic_ranges"].get(label)
    if r is None:  # an output-only expression or an unranged dim: Triton's -1, no limit of ours
        return [label, 1, 2**62]
    return [label, max(1, int(r["min"])), int(r["max"])]


EMPTY_PAST_HINT = "leave every past_key_values.* input out for an empty cache (the prefill)"


def request_limits(artifact: Artifact, model: ModelSpec, max_request_bytes: int) -> dict:
    """What a request to `model` may hold, per input dim (the manifest's dynamic ranges, which
    the artifact was exported and tested for) and in bytes; checked before the request's
    tensors leave Triton's stub (moedeploy.serving.stub_guard reads this dict)."""
    batch = model.max_batch_size
    inputs: dict[str, list] = {}
    if model.name.endswith((GENERATE_SUFFIX, STREAM_SUFFIX)):
        seq = _range(artifact, "seq", batch)
        max_positions = int(artifact.manifest["config"]["max_positions"])
        # a stream's prompt runs through the generation loop, which takes any length up to
        # max_positions (as its text_input does); one answer's runs the graph's tested range
        seq[2] = max_positions if model.name.endswith(STREAM_SUFFIX) else min(seq[2], max_positions)
        inputs[GENERATE_INPUT] = [[BATCH_DIM, 1, batch], seq]
        options = GENERATE_OPTIONS if model.name.endswith(GENERATE_SUFFIX) else [STREAM_TEXT_INPUT, *STREAM_OPTIONS]
        for name in options:
            inputs[name] = [[BATCH_DIM, 1, batch], ["one value", 1, 1]]
        if model.name.endswith(STREAM_SUFFIX):
            inputs[STREAM_STOP_INPUT] = [[BATCH_DIM, 1, batch], ["stop strings", 1, MAX_STOP_STRINGS]]
    else:
        for spec in artifact.manifest["inputs"]:
            inputs[spec["name"]] = [_range(artifact, d, batch) for d in spec["shape"]]
    hints = {name: EMPTY_PAST_HINT for name in inputs if name.startswith("past_key_values.")}
    return {"inputs": inputs, "empty_hints": hints, "max_request_bytes": int(max_request_bytes)}
