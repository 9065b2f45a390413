"""The artifacts on a real Triton server, through tritonclient over HTTP and gRPC: health,
model metadata, batching config, and outputs equal to eager PyTorch."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
import torch

from moedeploy.export.decoder import DecoderWithPast, past_names, present_names
from tests.export.artifacts import decoder_inputs, eager_block, eager_decoder
from tests.serving.helpers import PROTOCOLS, client, infer, metric

ATOL = RTOL = 1e-4  # ONNX Runtime fp32 vs eager, batched or not (the artifact's decoder tolerance)


@pytest.fixture(scope="module")
def moe_eager():
    return eager_block("moe")


@pytest.fixture(scope="module")
def decoder_eager():
    return eager_decoder()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_health_readiness_and_models(server, protocol: str) -> None:
    c = client(protocol, server)
    assert c.is_server_live()
    assert c.is_server_ready()
    assert server.model_names == ["moe", "decoder", "decoder_generate", "decoder_stream"]
    for name in server.model_names:
        assert c.is_model_ready(name)
    assert not c.is_model_ready("no_such_model")


def test_http_health_endpoints_answer_200(server) -> None:
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/moe/ready"):
        with urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=10) as response:
            assert response.status == 200


def test_model_metadata_uses_the_artifact_names(server) -> None:
    c = client("http", server)
    moe = c.get_model_metadata("moe")
    assert [(i["name"], i["datatype"], i["shape"]) for i in moe["inputs"]] == [("x", "FP32", [-1, -1, 64])]
    assert [(o["name"], o["shape"]) for o in moe["outputs"]] == [("y", [-1, -1, 64])]
    decoder = c.get_model_metadata("decoder")
    assert [i["name"] for i in decoder["inputs"]] == ["input_ids", *past_names(2)]
    assert [o["name"] for o in decoder["outputs"]] == ["logits", *present_names(2)]
    generate = c.get_model_metadata("decoder_generate")
    assert [i["name"] for i in generate["inputs"]] == [
        "input_ids", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "eos_token_id",
    ]
    assert [o["name"] for o in generate["outputs"]] == ["output_ids"]


def test_config_declares_batching_along_dim_0(server) -> None:
    config = client("http", server).get_model_config("moe")
    assert config["max_batch_size"] == 16  # the manifest's batch range max
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert config["input"][0]["dims"] == [-1, 64]  # no batch dim
    generate = client("http", server).get_model_config("decoder_generate")
    assert generate["max_batch_size"] == 8
    assert {i["name"]: i["optional"] for i in generate["input"]}["temperature"] is True


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (3, 17), (16, 5)])
def test_block_outputs_match_eager(server, moe_eager, protocol: str, batch: int, seq: int) -> None:
    x = torch.randn(batch, seq, 64, generator=torch.Generator().manual_seed(batch * 100 + seq))
    y = infer(protocol, client(protocol, server), "moe", {"x": x.numpy()}, ["y"])["y"]
    with torch.no_grad():
        expected = moe_eager(x)
    assert y.shape == (batch, seq, 64) and y.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(y), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_logits_prefill_without_past_then_a_decode_step(server, decoder_eager, protocol: str) -> None:
    """The prefill leaves the cache out; the next step sends back the present it got."""
    c = client(protocol, server)
    outputs = ["logits", *present_names(2)]
    ids, _, _ = decoder_inputs(decoder_eager, batch=2, past_len=0, seq=9, seed=3)
    prefill = infer(protocol, c, "decoder", {"input_ids": ids[:, :8].numpy()}, outputs)
    past = {p: prefill[n] for p, n in zip(past_names(2), present_names(2), strict=True)}
    step = infer(protocol, c, "decoder", {"input_ids": ids[:, 8:].numpy(), **past}, outputs)
    with torch.no_grad():
        full = decoder_eager(ids)  # (2, 9, V), no cache at all
        _, eager_present = DecoderWithPast(decoder_eager)(ids, [(torch.zeros(2, 2, 0, 16),) * 2] * 2)
    logits = np.concatenate([prefill["logits"], step["logits"]], axis=1)
    torch.testing.assert_close(torch.from_numpy(logits), full, atol=ATOL, rtol=RTOL)
    assert step["present.1.value"].shape == (2, 2, 9, 16)
    torch.testing.assert_close(torch.from_numpy(step["present.1.value"]), eager_present[1][1], atol=ATOL, rtol=RTOL)


def test_logits_with_an_eager_cache(server, decoder_eager) -> None:
    """A cache made by eager PyTorch is accepted as it is (names and layout are the artifact's)."""
    _, new_ids, past = decoder_inputs(decoder_eager, batch=3, past_len=5, seq=4, seed=11)
    feed = {"input_ids": new_ids.numpy()}
    for name, (k, v) in zip(past_names(2)[0::2], past, strict=True):
        feed[name] = k.numpy()
        feed[name.replace(".key", ".value")] = v.numpy()
    logits = infer("grpc", client("grpc", server), "decoder", feed, ["logits"])["logits"]
    with torch.no_grad():
        expected, _ = DecoderWithPast(decoder_eager)(new_ids, past)
    torch.testing.assert_close(torch.from_numpy(logits), expected, atol=ATOL, rtol=RTOL)


def test_prometheus_metrics_count_requests(server) -> None:
    x = np.zeros((1, 2, 64), np.float32)
    infer("http", client("http", server), "moe", {"x": x}, ["y"])
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    assert metric(text, "nv_inference_request_success", "moe") >= 1
    assert "nv_inference_queue_duration_us" in text
