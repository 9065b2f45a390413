"""A quantized decoder is served at --accuracy-level: 4 (int8 activations, the default) or 0
(the dequantized products in float). Level 4 is what makes a quantized artifact fast on ONNX
Runtime's CPU kernels; before it was wired in, serve ran int8 artifacts at level 0, about 40x
slower than `bench` measured them. Observable without timing: QMoE takes int8 experts at level
4 only (its CPU int8 kernel has int8 activations only), so the lowering says which level ran."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from moedeploy.export import export
from moedeploy.models.blockquant import QuantScheme
from moedeploy.models.config import preset
from moedeploy.serving.specs import ServingError
from tests.serving.helpers import (
    HOST,
    client,
    free_ports,
    grpc_stream,
    infer,
    repacks,
    tokens_and_text,
)

pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton")


@pytest.fixture(scope="module")
def int8_decoder(tmp_path_factory):
    return export("decoder", tmp_path_factory.mktemp("q") / "tiny-int8", preset_name="tiny",
                  quantization=QuantScheme(8, 32))


@pytest.mark.parametrize(("level", "on_qmoe"), [(4, True), (0, False)])
def test_every_session_of_a_served_quantized_decoder_runs_at_the_accuracy_level(int8_decoder, level, on_qmoe) -> None:
    from moedeploy.serving import ModelServer, ServeOptions

    layers = preset("tiny").n_layers
    server = ModelServer([int8_decoder], ServeOptions(accuracy_level=level))  # not started: its sessions alone
    scheduler = server._inflight_scheduler(int8_decoder, f"{int8_decoder.name}_stream")
    try:
        assert scheduler.decoder.lowered.lowering["moe_qmoe"] == (layers if on_qmoe else 0)
    finally:
        scheduler.stop()
    for _, spec in server.specs:
        if spec.name.endswith("_stream"):
            continue
        runner = server._runner(int8_decoder, spec, in_flight=True)
        try:
            assert runner.lowering["moe_qmoe"] == (layers if on_qmoe else 0), spec.name
            assert runner.lowering["matmul_nbits"] > 0
        finally:
            runner.deactivate()


def test_an_unknown_accuracy_level_is_refused_in_one_line() -> None:
    from moedeploy.serving import ServeOptions

    with pytest.raises(ServingError, match=r"--accuracy-level must be one of 0, 4 \(4: int8 activations"):
        ServeOptions(accuracy_level=2).validate()


def test_only_the_logits_model_of_a_quantized_decoder_maps_its_weights_and_a_warning_says_so(int8_decoder, caplog) -> None:
    """--packed-weights stream keeps its memory promise for a quantized decoder's logits model
    (mapped), but ONNX Runtime's int8/int4 kernels compute in float and 20-30x slower there, so the
    server names that model, once however many instances, with the option that repacks it. The
    generate model repacks beside in-flight batching too, so that a request that misses the batch
    gets the same tokens as one in it; with --packed-weights all everything repacks, unannounced."""
    from moedeploy.serving import ModelServer, ServeOptions

    specs = {spec.name: spec for _, spec in ModelServer([int8_decoder]).specs}
    logits, generate = specs[int8_decoder.name], specs[f"{int8_decoder.name}_generate"]
    for packed, expected in (("stream", [False, False, True]), ("all", [True, True, True])):
        caplog.clear()
        server = ModelServer([int8_decoder], ServeOptions(packed_weights=packed))
        runners = [server._runner(int8_decoder, spec, in_flight=True) for spec in (logits, logits, generate)]
        try:
            assert [repacks(r.sess) for r in runners] == expected
        finally:
            for runner in runners:
                runner.deactivate()
        warnings = [r.getMessage() for r in caplog.records if "memory-mapped codes" in r.getMessage()]
        assert len(warnings) == (1 if packed == "stream" else 0), warnings
        if warnings:
            assert warnings[0].startswith(f"{int8_decoder.name} runs over") and "--packed-weights all" in warnings[0]


def test_a_served_int4_decoder_answers_as_the_model_alone_at_level_4(tmp_path) -> None:
    """Through the real server, an int4 decoder at the default level: three concurrent streams,
    batched in flight, each get the greedy tokens of ONNX Runtime's model alone at level 4
    (OrtDecoder, one sequence, no server); the logits model's prefill equals the model alone at
    level 4 to rounding, and differs from level 0 by more (int8 activations), with
    --packed-weights all."""
    pytest.importorskip("tritonclient.grpc", reason="the serving tests talk to Triton through tritonclient[all]")
    from moedeploy.runtime.generation import OrtDecoder
    from moedeploy.serving import ModelServer, ServeOptions

    artifact = export("decoder", tmp_path / "tiny-int4", preset_name="tiny", quantization=QuantScheme(4, 32))
    new = 24
    alone = OrtDecoder(artifact, attention_lowering="gqa", logits="last", nbits_accuracy=4)
    generator = np.random.default_rng(7)
    prompts = [generator.integers(0, 256, n).tolist() for n in (5, 11, 17)]
    expected = [alone.generate([p], max_new_tokens=new)[0, len(p):].tolist() for p in prompts]
    prefill = {}  # the logits model's graph: the traced attention, every position's logits
    for level in (4, 0):
        decoder = OrtDecoder(artifact, nbits_accuracy=level)
        decoder.reset(1, len(prompts[2]))
        prefill[level] = decoder.step(torch.tensor([prompts[2]]), 0)[0, -1].numpy()
    http, grpc, metrics = free_ports(3)
    # --packed-weights all: the logits model repacks too (mapped, ONNX Runtime's int4/int8 kernels
    # compute the dequantized products in float whatever the level; the test below shows it)
    options = ServeOptions(host=HOST, http_port=http, grpc_port=grpc, metrics_port=metrics, exit_timeout_s=1,
                           log_file=tmp_path / "tritonserver.log", packed_weights="all")
    with ModelServer([artifact], options) as server, ThreadPoolExecutor(len(prompts)) as pool:
        streams = pool.map(lambda p: grpc_stream(server, {"input_ids": np.array([p], dtype=np.int64),
                                                          "max_tokens": np.array([[new]], dtype=np.int64)},
                                                 model=f"{artifact.name}_stream"), prompts)
        got = [tokens_and_text(stream, text=False)[0] for stream in streams]
        (scheduler,) = server._schedulers
        made = scheduler.tokens_generated
        logits = infer("grpc", client("grpc", server), artifact.name,
                       {"input_ids": np.array([prompts[2]], dtype=np.int64)}, ["logits"])["logits"][0, -1]
    assert got == expected
    assert made == new * len(prompts)  # every token by the in-flight scheduler
    np.testing.assert_allclose(logits, prefill[4], rtol=1e-5, atol=1e-5)
    assert np.abs(logits - prefill[0]).max() > 100 * np.abs(logits - prefill[4]).max() + 1e-4


def test_over_the_mapped_codes_the_quantized_kernels_compute_the_float_products(int8_decoder) -> None:
    """Why the generate model repacks: the logits model's mapped session (--packed-weights stream)
    gives the dequantized products of level 0 (to 1e-5) although asked for level 4, while the
    repacked session gives level 4's, which differ (int8 activations)."""
    import onnxruntime as ort

    from moedeploy.runtime.ort import create_session
    from moedeploy.serving import ModelServer, ServeOptions

    ids = np.random.default_rng(3).integers(0, 256, (1, 12))
    feed = {"input_ids": ids}

    def logits(session: ort.InferenceSession) -> np.ndarray:
        inputs = {i.name: i for i in session.get_inputs()}
        full = dict(feed)
        for name, meta in inputs.items():
            if name.startswith("past_key_values"):
                full[name] = np.zeros([1, meta.shape[1], 0, meta.shape[3]], np.float32)
        return session.run(["logits"], full)[0]

    level = {n: logits(create_session(int8_decoder, nbits_accuracy=n).session) for n in (0, 4)}
    server = ModelServer([int8_decoder], ServeOptions(packed_weights="stream"))
    spec = next(spec for _, spec in server.specs if spec.name == int8_decoder.name)
    runner = server._runner(int8_decoder, spec, in_flight=True)
    try:
        mapped = logits(runner.sess)
    finally:
        runner.deactivate()
    assert np.abs(level[4] - level[0]).max() > 1e-3
    np.testing.assert_allclose(mapped, level[0], rtol=1e-5, atol=1e-5)
