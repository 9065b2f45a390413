"""Start-up details that decide whether Triton comes up at all (see DESIGN.md, Serving)."""

from __future__ import annotations

import os
import socket
import sysconfig
from pathlib import Path

import pytest

from moedeploy.serving.server import ServeOptions, check_port_free, python_library_first
from moedeploy.serving.specs import ServingError


def test_this_pythons_libpython_comes_first_only_while_triton_starts(monkeypatch) -> None:
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if not (libdir and soname and (Path(libdir) / soname).is_file()):
        pytest.skip("this Python has no shared libpython; nothing to put first")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/somewhere/else")
    with python_library_first():
        assert os.environ["LD_LIBRARY_PATH"] == f"{libdir}:/somewhere/else"
    assert os.environ["LD_LIBRARY_PATH"] == "/somewhere/else"
    monkeypatch.delenv("LD_LIBRARY_PATH")
    with python_library_first():
        assert os.environ["LD_LIBRARY_PATH"] == libdir
    assert "LD_LIBRARY_PATH" not in os.environ


def test_a_taken_port_is_named_before_start() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServingError, match=f"cannot listen on 127.0.0.1:{port} for grpc"):
            check_port_free("127.0.0.1", port, "grpc")


@pytest.mark.parametrize(("changes", "message"), [
    ({"backend": "tensorrt"}, "unknown backend 'tensorrt'"),
    ({"http_port": 70000}, "--http-port must lie in 1..65535"),
    ({"max_queue_delay_us": -1}, "--max-queue-delay-us must be >= 0"),
])
def test_options_are_checked(changes: dict, message: str) -> None:
    with pytest.raises(ServingError, match=message):
        ServeOptions(**changes).validate()


def test_two_artifacts_with_one_name_are_refused(store) -> None:
    from moedeploy.serving import ModelServer

    moe = store.block("moe")
    with pytest.raises(ServingError, match="two artifacts would serve a model named 'moe'"):
        ModelServer([moe, moe])
