"""How a CPU session comes to run the native MoE kernel (plugins/native), and that a decoder on
it gives eager PyTorch's logits and passes `compare` on every ONNX Runtime lowering; the
library's build: reused without headers or compiler, never another CPU's, refused in one line."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

from moedeploy.cli import app
from moedeploy.export import Artifact, export_decoder
from moedeploy.runtime.moe_tuning import TUNED_FILE, Tuning, record
from moedeploy.runtime.ort import (
    CACHE_DIR,
    CPU,
    SessionError,
    create_session,
    lowered_model,
    moe_path_and_source,
)
from tests.export.artifacts import SEED, decoder_feed, decoder_inputs, eager_decoder


@pytest.fixture(scope="module")
def artifact(native_kernels, tmp_path_factory):
    return export_decoder(tmp_path_factory.mktemp("native") / "decoder", dtype="fp32", seed=SEED)


def test_a_cpu_session_takes_the_native_kernel_and_gives_eager_logits(native_kernels, artifact) -> None:
    assert moe_path_and_source(artifact, 2)[0] == "native"
    lowered = create_session(artifact, threads=2)
    decoder = eager_decoder()
    n_moe = sum(decoder.config.is_moe_layer(i) for i in range(decoder.config.n_layers))
    assert lowered.lowering["moe_native"] == n_moe > 0 and not lowered.lowering["moe_split"]
    graph = onnx.load_from_string(lowered_model(artifact, CPU, "native")[0])
    kernels = [n for n in graph.graph.node if n.op_type == "MoEExperts"]
    assert len(kernels) == n_moe and all(onnx.helper.get_node_attr_value(n, "panels") == 1 for n in kernels)
    assert all(name.endswith(".panels") for n in kernels for name in n.input[2:])  # placeholders: supplied at load
    shared = onnx.load_from_string(lowered_model(artifact, CPU, "native", relayout=False)[0])
    assert all(onnx.helper.get_node_attr_value(n, "panels") == 0 for n in shared.graph.node if n.op_type == "MoEExperts")
    mapped = create_session(artifact, threads=2, prepack=False)  # shares the mapped file: rows, no copy of its own
    assert mapped.lowering["moe_native"] == n_moe
    for past_len, seq in ((0, 6), (6, 1)):  # a prompt, then one token
        ids, new_ids, past = decoder_inputs(decoder, 1, past_len, seq, seed=7)
        with torch.no_grad():
            expected = decoder(ids)[:, past_len:].numpy()
        for session in (lowered, mapped):
            (logits,) = session.run(decoder_feed(new_ids, past), ["logits"])
            np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", ["moe", "decoder_layer"])
def test_a_block_artifact_runs_on_the_native_kernel(native_kernels, tmp_path_factory, block: str) -> None:
    """Blocks load their lowered graph from a cache file, not bytes: it must name the kernel's
    domain, or the session cannot find MoEExperts."""
    from moedeploy.export.blocks import DIM
    from tests.export.artifacts import ArtifactStore, eager_block

    artifact = ArtifactStore.for_session(tmp_path_factory).block(block)
    lowered = create_session(artifact, threads=2)
    assert lowered.lowering["moe_native"] == 1
    x = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(11))
    (y,) = lowered.run({lowered.session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        expected = eager_block(block)(x)
    np.testing.assert_allclose(y, expected.numpy(), rtol=1e-4, atol=1e-5)


def test_greedy_tokens_on_the_native_kernel_are_eager_pytorchs(native_kernels, artifact) -> None:
    from moedeploy.runtime.generation import OrtDecoder

    decoder = OrtDecoder(artifact, threads=2, attention_lowering="gqa", logits="greedy", kv_cache="inplace")
    assert decoder.lowered.lowering["moe_native"] > 0
    prompt = torch.randint(0, eager_decoder().config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = eager_decoder().generate(prompt, max_new_tokens=16)
    assert torch.equal(decoder.generate(prompt, max_new_tokens=16), expected)


def test_compare_passes_on_every_lowering_with_the_native_kernel(native_kernels, artifact) -> None:
    from moedeploy.compare.api import compare

    report = compare(artifact, backends=("ort", "ort-gqa", "ort-inflight"), iterations=2)
    assert report["passed"], report
    paths = [c.get("path", "") for c in report["comparisons"]]
    assert any("MoEExperts" in p for p in paths), paths


def test_native_off_or_unbuildable_leaves_the_other_paths(native_kernels, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MOEDEPLOY_NATIVE", "0")
    native_kernels.forget()
    assert moe_path_and_source() == ("split", "the default; the native kernel is not used here: MOEDEPLOY_NATIVE=0 "
                                              "turns the native kernels off")
    monkeypatch.setenv("MOEDEPLOY_MOE_PATH", "native")
    with pytest.raises(SessionError, match="MOEDEPLOY_MOE_PATH=native, but the native kernel is not available here: "
                                           "MOEDEPLOY_NATIVE=0 turns the native kernels off"):
        moe_path_and_source()
    monkeypatch.delenv("MOEDEPLOY_NATIVE")
    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("MOEDEPLOY_ORT_INCLUDE", str(tmp_path))
    native_kernels.forget()
    with pytest.raises(SessionError, match=f"MOEDEPLOY_ORT_INCLUDE={tmp_path} holds no onnxruntime_c_api.h"):
        moe_path_and_source()
    native_kernels.forget()


def test_a_built_library_is_reused_without_headers_but_never_for_another_cpu(native_kernels, monkeypatch) -> None:
    built = native_kernels.library_path()
    monkeypatch.delenv("MOEDEPLOY_ORT_INCLUDE", raising=False)
    monkeypatch.setattr(native_kernels, "candidate_includes", list)
    monkeypatch.setenv("CXX", "/bin/false")
    marker = built.parent / native_kernels.MACHINE_FILE
    assert marker.read_text() == native_kernels.machine_hash() + "\n"  # whose build it is, for `prune`
    os.utime(marker, (0, 0))
    native_kernels.forget()
    assert native_kernels.library_path() == built  # neither headers nor a compiler needed any more
    assert time.time() - marker.stat().st_mtime < 60  # loaded now: not stale for the next build's prune
    assert native_kernels.status() == f"built for this CPU ({built})"  # `moedeploy version`'s line
    real = native_kernels.cpu_identity()
    assert any(line.startswith(("flags=", "Features=")) and len(line) > 20 for line in real), real
    monkeypatch.setattr(native_kernels, "cpu_identity", lambda: [*real[:-1], real[-1] + " another"])
    native_kernels.forget()
    with pytest.raises(native_kernels.NativeUnavailable, match="no ONNX Runtime C API headers"):
        native_kernels.library_path()
    assert native_kernels.status().startswith("not available (no ONNX Runtime C API headers")
    native_kernels.forget()


def _fresh_build_with(native, monkeypatch, cache: Path, cxx: str) -> None:
    """The headers the suite has, an empty cache, and `cxx` as the compiler."""
    from tests.conftest import NATIVE_TEST_INCLUDE

    if NATIVE_TEST_INCLUDE:
        monkeypatch.setenv("MOEDEPLOY_ORT_INCLUDE", NATIVE_TEST_INCLUDE)
    monkeypatch.setenv("MOEDEPLOY_CACHE", str(cache))
    monkeypatch.setenv("CXX", cxx)
    native.forget()


def test_a_compiler_that_is_not_there_leaves_sessions_on_the_other_paths(native_kernels, monkeypatch, tmp_path) -> None:
    _fresh_build_with(native_kernels, monkeypatch, tmp_path / "cache", str(tmp_path / "no-such-compiler"))
    path, source = moe_path_and_source()  # no traceback for a user who never asked; bench says why
    assert path == "split" and re.fullmatch(r"the default; the native kernel is not used here: building the native "
                                            r"kernels failed: .*no-such-compiler.*", source), source
    with pytest.raises(native_kernels.NativeUnavailable, match=r"building the native kernels failed: .*no-such-compiler"):
        native_kernels.library_path()
    native_kernels.forget()


def test_a_failed_build_says_why_and_leaves_nothing(native_kernels, monkeypatch, tmp_path) -> None:
    _fresh_build_with(native_kernels, monkeypatch, tmp_path / "cache", "/bin/false")
    with pytest.raises(native_kernels.NativeUnavailable, match=r"compiling moe_experts.cc failed \(/bin/false\): no output"):
        native_kernels.library_path()
    assert list((tmp_path / "cache" / "native").iterdir()) == []
    native_kernels.forget()


def test_a_library_onnx_runtime_cannot_load_leaves_the_other_paths_with_the_reason(monkeypatch, tmp_path) -> None:
    """A built library that will not load (a damaged file here; a noexec cache or an older C++
    runtime elsewhere) made every CPU session fail; now sessions take the split, and the line
    that says why names the file and the way out. Needs no headers: the library is a fake."""
    from moedeploy.plugins import native

    monkeypatch.delenv("MOEDEPLOY_NATIVE", raising=False)
    monkeypatch.delenv("MOEDEPLOY_MOE_PATH", raising=False)
    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path))
    folder = tmp_path / "native" / f"{native.build_key()}-api17"
    folder.mkdir(parents=True)
    (folder / native.LIBRARY).write_bytes(b"not a shared library")
    native.forget()
    try:
        why = f"ONNX Runtime cannot load {folder / native.LIBRARY} ("
        assert native.status().startswith(f"not available ({why}")
        assert f"remove {folder} to build it again, or set MOEDEPLOY_NATIVE=0" in native.status()
        with pytest.raises(native.NativeUnavailable, match=re.escape(why)):
            native.library_path()
        path, source = moe_path_and_source()
        assert path == "split" and source.startswith(f"the default; the native kernel is not used here: {why}")
        monkeypatch.setenv("MOEDEPLOY_MOE_PATH", "native")
        with pytest.raises(SessionError, match=re.escape(f"the native kernel is not available here: {why}")):
            moe_path_and_source()
    finally:
        native.forget()


def test_a_stray_build_folder_and_a_hung_compiler_are_named(native_kernels, monkeypatch, tmp_path) -> None:
    _fresh_build_with(native_kernels, monkeypatch, tmp_path / "cache", native_kernels.compiler())
    include, _ = native_kernels.headers()
    stray = tmp_path / "cache" / "native" / f"{native_kernels.build_key()}-api{native_kernels.api_version(include)}"
    stray.mkdir(parents=True)
    (stray / "notes.txt").write_text("not ours to remove")
    with pytest.raises(native_kernels.NativeUnavailable, match=f"{re.escape(str(stray))} exists without "
                                                               r"libmoedeploy_cpu.so in it \(Directory not empty\); remove it"):
        native_kernels.library_path()
    assert (stray / "notes.txt").read_text() == "not ours to remove"
    hung = tmp_path / "hung-cxx"  # a driver whose child hangs, as cc1plus would under g++
    hung.write_text(f"#!/bin/sh\nsleep 30 &\necho $! > {tmp_path / 'child'}\nwait\n")
    hung.chmod(0o755)
    _fresh_build_with(native_kernels, monkeypatch, tmp_path / "cache2", str(hung))
    monkeypatch.setattr(native_kernels, "COMPILE_TIMEOUT_S", 1)
    start = time.monotonic()
    with pytest.raises(native_kernels.NativeUnavailable, match=r"compiling moe_experts.cc \(.*hung-cxx\) took over 1 s"):
        native_kernels.library_path()
    assert time.monotonic() - start < 15  # not held until the child's 30 s are up
    assert list((tmp_path / "cache2" / "native").iterdir()) == []  # the staging folder is gone
    child = Path(f"/proc/{(tmp_path / 'child').read_text().strip()}/stat")
    for _ in range(50):  # killed with the driver (its process group), then reaped
        if not child.exists() or child.read_text().split(") ")[1].startswith("Z"):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the compiler's child outlived the timeout")
    native_kernels.forget()


def own_copy(artifact, folder: Path) -> Artifact:
    """A private copy of the decoder (tune writes into its cache/; the module's artifact stays recordless)."""
    shutil.copytree(artifact.path, folder, ignore=shutil.ignore_patterns(CACHE_DIR, "report"))
    return Artifact.load(folder)


def test_tune_times_the_native_kernel_beside_the_other_paths_and_sessions_follow_it(native_kernels, artifact,
                                                                                   tmp_path) -> None:
    own = own_copy(artifact, tmp_path / "decoder")
    result = CliRunner().invoke(app, ["tune", str(own.path), "--threads", "2", "--rounds", "3", "--prompt-len", "8",
                                      "--new-tokens", "4"])
    assert result.exit_code == 0, result.output
    entry, = json.loads((own.path / CACHE_DIR / TUNED_FILE).read_text())["entries"]
    assert len(entry["split_ms"]) == len(entry["experts_ms"]) == len(entry["native_ms"]) == 3
    assert entry["tokens_identical"] is True and entry["native_kernel"] == native_kernels.build_key()
    # the choice, recomputed here from the recorded times: split or If per expert first (3% either
    # side, the split in a tie), then the kernel against the faster of them, each a median of
    # paired ratios; the kernel stays unless more than 3% slower
    ratio = sorted(s / e for s, e in zip(entry["split_ms"], entry["experts_ms"], strict=True))[1]
    faster = "experts" if ratio > 1 else "split"
    native_ratio = sorted(n / o for n, o in zip(entry["native_ms"], entry[f"{faster}_ms"], strict=True))[1]
    assert entry["native_ratio"] == pytest.approx(native_ratio, rel=1e-12)
    assert entry["path"] == (("experts" if ratio > 1.03 else "split") if native_ratio > 1.03 else "native")
    assert "the project's kernel" in result.stdout and f"take {entry['path']}" in " ".join(result.stdout.split())
    assert moe_path_and_source(own, 2) == (entry["path"], f"as `moedeploy tune` recorded for this machine in "
                                                          f"{own.path / CACHE_DIR / TUNED_FILE}")


def test_a_record_applies_only_beside_the_kernel_it_was_measured_with(native_kernels, artifact, tmp_path, monkeypatch,
                                                                      caplog) -> None:
    own = own_copy(artifact, tmp_path / "decoder")
    monkeypatch.setenv("MOEDEPLOY_NATIVE", "0")
    native_kernels.forget()
    record(own, 2, Tuning("experts", "measured", 1.1, [1.1], [1.0], True))  # timed with the kernel off
    assert moe_path_and_source(own, 2)[0] == "experts"
    monkeypatch.delenv("MOEDEPLOY_NATIVE")
    native_kernels.forget()
    with caplog.at_level(logging.WARNING):  # the kernel is built: that record never timed it
        assert moe_path_and_source(own, 2)[0] == "native"
    assert "it was measured without the native kernel, which is built here now" in caplog.text
    record(own, 2, Tuning("experts", "measured", 1.1, [1.1], [1.0], True, [1.2], 1.2))  # the kernel timed, and slower
    assert moe_path_and_source(own, 2)[0] == "experts"
    entries = json.loads((own.path / CACHE_DIR / TUNED_FILE).read_text())["entries"]
    assert [e["native_kernel"] for e in entries] == [None, native_kernels.build_key()]  # both kept: each its own case
    native_kernels.forget()


def test_a_record_steers_only_the_prepacked_sessions_it_timed(native_kernels, artifact, tmp_path) -> None:
    """tune times prepacked sessions; one sharing the mapped weights (prepack=False: serve's later
    instances) runs the kernel on rows and no split, and keeps the default, the kernel."""
    from moedeploy.runtime.ort import create_session, session_moe

    own = own_copy(artifact, tmp_path / "decoder")
    record(own, 2, Tuning("experts", "measured", 1.1, [1.1], [1.0], True, [1.2], 1.2))  # the kernel timed, and slower
    assert session_moe("CPUExecutionProvider", 2, "auto", own, prepack=True) == ("auto", 1)  # the If per expert
    assert session_moe("CPUExecutionProvider", 2, "auto", own, prepack=False) == ("native", 1)
    shared = create_session(own, ["CPUExecutionProvider"], threads=2, prepack=False)
    prepacked = create_session(own, ["CPUExecutionProvider"], threads=2)
    assert shared.lowering["moe_native"] == prepacked.lowering["moe_experts"] == own.manifest["config"]["n_layers"]
