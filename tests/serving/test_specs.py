"""What Triton is told about each artifact: names, dims without the batch dim, dtypes."""

from __future__ import annotations

import pytest

from moedeploy.serving.specs import ServingError, served_models


def test_block_is_one_model_named_after_its_manifest(store) -> None:
    [model] = served_models(store.block("moe"))
    assert model.name == "moe"
    assert [(t.name, t.dtype, t.dims) for t in model.inputs] == [("x", "float32", (-1, 64))]
    assert [(t.name, t.dims) for t in model.outputs] == [("y", (-1, 64))]
    assert model.max_batch_size == 16


def test_fp16_block_keeps_its_dtype(store) -> None:
    [model] = served_models(store.block("rmsnorm", "fp16"), max_batch_size=4)
    assert model.inputs[0].triton_dtype == "TYPE_FP16"
    assert model.max_batch_size == 4


def test_decoder_is_served_as_logits_generation_and_stream(store) -> None:
    logits, generate, stream = served_models(store.decoder("fp32"))
    assert logits.name == "decoder" and generate.name == "decoder_generate"
    assert logits.inputs[0].name == "input_ids" and logits.inputs[0].dims == (-1,) and not logits.inputs[0].optional
    past = logits.inputs[1]
    assert (past.name, past.dims, past.optional) == ("past_key_values.0.key", (2, -1, 16), True)
    assert [o.name for o in logits.outputs][:2] == ["logits", "present.0.key"]
    assert logits.outputs[0].dims == (-1, 256)
    assert [(t.name, t.dtype, t.dims, t.optional) for t in generate.inputs][:3] == [
        ("input_ids", "int64", (-1,), False), ("max_new_tokens", "int64", (1,), True), ("temperature", "float32", (1,), True),
    ]
    assert [(t.name, t.dims) for t in generate.outputs] == [("output_ids", (-1,))]
    assert generate.max_batch_size == logits.max_batch_size == 8
    # the stream: TensorRT-LLM's names, text or ids in, one request per execution
    assert stream.name == "decoder_stream" and stream.max_batch_size == 1
    assert [(t.name, t.dtype, t.optional) for t in stream.inputs] == [
        ("text_input", "bytes", True), ("input_ids", "int64", True), ("max_tokens", "int64", True),
        ("temperature", "float32", True), ("top_k", "int64", True), ("top_p", "float32", True), ("seed", "int64", True),
        ("stop", "bytes", True)]
    assert [(t.name, t.dtype, t.dims) for t in stream.outputs] == [
        ("output_ids", "int64", (-1,)), ("text_output", "bytes", (1,)), ("finish_reason", "bytes", (1,))]


def test_max_batch_size_below_one_is_refused(store) -> None:
    with pytest.raises(ServingError, match="max batch size must be >= 1"):
        served_models(store.block("moe"), max_batch_size=0)
