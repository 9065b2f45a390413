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
from tests.serving.helpers import HOST, client, free_ports, grpc_stream, infer, tokens_and_text

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


def test_a_quantized_decoders_mapped_sessions_are_named_in_a_warning(int8_decoder, caplog) -> None:
    """--packed-weights stream keeps its memory promise for a quantized decoder (its logits model
    maps the artifact's file), but ONNX Runtime's int8/int4 kernels decode 20-30x slower there,
    so the server says which model runs mapped and how to repack it; with --packed-weights all
    it repacks (ONNX Runtime's default: the prepacking entry unset) and nothing is said."""
    from moedeploy.runtime.ort import DISABLE_PREPACKING
    from moedeploy.serving import ModelServer, ServeOptions

    logits_spec = next(spec for _, spec in ModelServer([int8_decoder]).specs if spec.name == int8_decoder.name)
    for packed, mapped in (("stream", True), ("all", False)):
        caplog.clear()
        server = ModelServer([int8_decoder], ServeOptions(packed_weights=packed))
        runner = server._runner(int8_decoder, logits_spec, in_flight=True)
        try:
            options = runner.sess.get_session_options()
            if mapped:
                assert options.get_session_config_entry(DISABLE_PREPACKING) == "1"
            else:
                with pytest.raises(RuntimeError):
                    options.get_session_config_entry(DISABLE_PREPACKING)
        finally:
            runner.deactivate()
        warnings = [r.getMessage() for r in caplog.records if "memory-mapped codes" in r.getMessage()]
        assert warnings == ([f"{int8_decoder.name} runs over the quantized artifact's memory-mapped codes, where "
                             "ONNX Runtime's MatMulNBits and QMoE decode 20-30x slower than on their repacked layout; "
                             "--packed-weights all repacks it too (memory: a copy of the weights per session)"]
                            if mapped else [])


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
    alone = {level: OrtDecoder(artifact, attention_lowering="gqa", logits="last", nbits_accuracy=level)
             for level in (4, 0)}
    generator = np.random.default_rng(7)
    prompts = [generator.integers(0, 256, n).tolist() for n in (5, 11, 17)]
    expected = [alone[4].generate([p], max_new_tokens=new)[0, len(p):].tolist() for p in prompts]
    prefill = {}  # the logits model's graph: the traced attention, every position's logits
    for level in (4, 0):
        decoder = OrtDecoder(artifact, nbits_accuracy=level)
        decoder.reset(1, len(prompts[2]))
        prefill[level] = decoder.step(torch.tensor([prompts[2]]), 0)[0, -1].numpy()
    http, grpc, metrics = free_ports(3)
    # --packed-weights all: the logits model repacks too (mapped, ONNX Runtime's int4/int8 kernels
    # compute the dequantized products in float whatever the level: see the warning's test)
    options = ServeOptions(host=HOST, http_port=http, grpc_port=grpc, metrics_port=metrics, exit_timeout_s=1,
                           log_file=tmp_path / "tritonserver.log", packed_weights="all")
    with ModelServer([artifact], options) as server, ThreadPoolExecutor(len(prompts)) as pool:
        streams = pool.map(lambda p: grpc_stream(server, {"input_ids": np.array([p], dtype=np.int64),
                                                          "max_tokens": np.array([[new]], dtype=np.int64)},
                                                 model=f"{artifact.name}_stream"), prompts)
        got = [tokens_and_text(stream)[0] for stream in streams]
        (scheduler,) = server._schedulers
        made = scheduler.tokens_generated
        logits = infer("grpc", client("grpc", server), artifact.name,
                       {"input_ids": np.array([prompts[2]], dtype=np.int64)}, ["logits"])["logits"][0, -1]
    assert got == expected
    assert made == new * len(prompts)  # every token by the in-flight scheduler
    np.testing.assert_allclose(logits, prefill[4], rtol=1e-5, atol=1e-5)
    assert np.abs(logits - prefill[0]).max() > 100 * np.abs(logits - prefill[4]).max() + 1e-4
