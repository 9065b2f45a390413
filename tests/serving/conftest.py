"""One Triton server for the serving tests that need one: the tiny MoE block and the tiny
decoder (logits + generation) on ONNX Runtime, on free loopback ports, stopped at the end.

The artifacts come from the session-wide store the export tests share.
"""

from __future__ import annotations

import os

import pytest

from tests.export.artifacts import ArtifactStore
from tests.serving.helpers import HOST, free_ports, gone, stub_pids

# Long enough that 16 concurrent clients' requests meet in one batch, short enough not to
# slow a lone request noticeably.
QUEUE_DELAY_US = 2000


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> ArtifactStore:
    return ArtifactStore.for_session(tmp_path_factory)


@pytest.fixture(scope="session")
def server(store, tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton")
    pytest.importorskip("tritonclient.grpc", reason="the serving tests talk to Triton through tritonclient[all]")
    from moedeploy.serving import ModelServer, ServeOptions
    from moedeploy.serving.server import check_port_free

    http, grpc, metrics = free_ports(3)
    options = ServeOptions(
        backend="ort", host=HOST, http_port=http, grpc_port=grpc, metrics_port=metrics,
        max_queue_delay_us=QUEUE_DELAY_US, exit_timeout_s=1,
        log_file=tmp_path_factory.mktemp("triton") / "tritonserver.log",
    )
    with ModelServer([store.block("moe"), store.decoder("fp32")], options) as running:
        stubs = stub_pids(os.getpid())
        assert len(stubs) == 4  # one Python-backend stub per model instance (moe; decoder, _generate, _stream)
        yield running
    assert gone(stubs), "PyTriton stub processes outlived the server"
    for port, label in ((http, "http"), (grpc, "grpc"), (metrics, "metrics")):
        check_port_free(HOST, port, label)  # stopped means the ports are released
