"""The lowered-graph cache in <artifact>/cache/ is checked like the artifact: its sidecar
records the sha256 of every cache file when it is written, and a cache that no longer
matches is rebuilt (or, where it cannot be, bypassed), never loaded."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import moedeploy.runtime.ort as ort_module
from moedeploy.export.artifact import MANIFEST, Artifact
from moedeploy.runtime.ort import CACHE_DIR, create_session
from tests.export.artifacts import plain_session, rewrite_manifest
from tests.runtime.lowering_garbage import graphs_left_by

TOL = {"rtol": 1e-5, "atol": 1e-5}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def moe(store, tmp_path) -> Artifact:
    """A private copy of the moe block with a fresh cache (the store's artifacts are shared)."""
    folder = tmp_path / "moe"
    shutil.copytree(store.block("moe").path, folder, ignore=shutil.ignore_patterns(CACHE_DIR, "report"))
    artifact = Artifact.load(folder)
    create_session(artifact)  # writes the cache
    return artifact


def cache_files(artifact: Artifact, suffix: str) -> list[Path]:
    return sorted((artifact.path / CACHE_DIR).glob(f"*{suffix}"))


def overwrite_64_floats(path: Path) -> bytes:
    """The issue's edit: 64 float32 values in place, size and name unchanged."""
    with path.open("r+b") as f:
        f.write(np.full(64, 3.0, np.float32).tobytes())
    return path.read_bytes()


def golden_error(artifact: Artifact) -> float:
    feed = artifact.golden_inputs()[0]
    return float(np.abs(create_session(artifact).run(feed)[0] - artifact.golden_outputs()[0]["y"]).max())


def test_the_sidecar_records_every_cache_file(moe) -> None:
    [sidecar] = cache_files(moe, ".json")
    record = json.loads(sidecar.read_text())
    on_disk = {p.name: digest(p) for p in (moe.path / CACHE_DIR).iterdir() if p != sidecar}
    assert {Path(n).suffix for n in on_disk} == {".onnx", ".data"}
    assert record["files"] == on_disk
    assert record["lowering"]["moe_experts"] == 1  # counts still travel with it
    assert record["source"] == {"model.onnx": moe.manifest["files"]["model.onnx"]}


def test_an_overwritten_cache_is_rebuilt_and_never_served(moe, caplog) -> None:
    """Before, the modified weights were served: compare failed and blamed the export."""
    [data] = cache_files(moe, ".onnx.data")
    good = data.read_bytes()
    assert overwrite_64_floats(data) != good
    with caplog.at_level(logging.WARNING, logger="moedeploy.runtime.ort"):
        error = golden_error(moe)
    assert error <= 1e-5  # eager PyTorch's golden outputs
    assert data.read_bytes() == good  # rebuilt byte for byte
    assert "does not match the sha256 recorded when it was written" in caplog.text
    assert "not used" in caplog.text


def test_an_edited_cached_graph_is_rebuilt(moe) -> None:
    """The graph file is hashed too (it names the data file and holds the small constants)."""
    [graph] = cache_files(moe, ".onnx")
    model = onnx.load(str(graph), load_external_data=False)
    model.producer_name = "someone else"
    onnx.save(model, str(graph))
    assert golden_error(moe) <= 1e-5
    record = json.loads(cache_files(moe, ".json")[0].read_text())
    assert record["files"][graph.name] == digest(graph)
    assert onnx.load(str(graph), load_external_data=False).producer_name != "someone else"


def test_a_cache_that_cannot_be_rebuilt_is_bypassed(moe, monkeypatch) -> None:
    """A read-only artifact (simulated: root may write anywhere) with a modified cache: the
    graph is lowered in memory, the modified files are neither used nor touched."""
    [data] = cache_files(moe, ".onnx.data")
    modified = overwrite_64_floats(data)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(moe.path / CACHE_DIR))

    monkeypatch.setattr(ort_module, "write_cache", read_only)
    assert golden_error(moe) <= 1e-5
    assert data.read_bytes() == modified


def test_a_cache_from_before_the_sidecar_recorded_hashes_is_rebuilt(moe) -> None:
    """Old caches' sidecar held only the lowering counts: nothing vouches for their files."""
    [sidecar] = cache_files(moe, ".json")
    [data] = cache_files(moe, ".onnx.data")
    record = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps(record["lowering"]))
    overwrite_64_floats(data)
    assert golden_error(moe) <= 1e-5
    assert json.loads(sidecar.read_text())["files"][data.name] == digest(data)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_cache_files_follow_the_umask(store, tmp_path, umask: int) -> None:
    """Before, cache/*.onnx.data was 0600 whatever the umask, unlike every other file."""
    folder = tmp_path / "moe"
    shutil.copytree(store.block("moe").path, folder, ignore=shutil.ignore_patterns(CACHE_DIR, "report"))
    old = os.umask(umask)
    try:
        create_session(folder)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (folder / CACHE_DIR).iterdir()}
    assert len(modes) == 3 and set(modes.values()) == {0o666 & ~umask}, modes


def test_new_weights_in_model_onnx_data_get_a_new_cache(store, tmp_path) -> None:
    """With external data, model.onnx holds only offsets: re-exported weights of the same
    shapes leave it byte-identical. The cache must follow model.onnx.data as well."""
    folder = tmp_path / "moe"
    shutil.copytree(store.block("moe").path, folder, ignore=shutil.ignore_patterns(CACHE_DIR, "report"))
    save_externally(folder, scale=1.0)
    before = create_session(folder).run(Artifact.load(folder).golden_inputs()[0])[0]
    model_onnx = (folder / "model.onnx").read_bytes()
    save_externally(folder, scale=2.0)
    assert (folder / "model.onnx").read_bytes() == model_onnx  # only the data changed
    artifact = Artifact.load(folder)
    feed = artifact.golden_inputs()[0]
    expected = plain_session(folder / "model.onnx").run(None, feed)[0]  # no lowering, no cache
    assert not np.allclose(expected, before, **TOL)
    np.testing.assert_allclose(create_session(artifact).run(feed)[0], expected, **TOL)


def save_externally(folder: Path, scale: float) -> None:
    """model.onnx with its weights in model.onnx.data (w_down scaled), re-signed in the manifest."""
    model = onnx.load(str(folder / "model.onnx"))
    w_down = next(t for t in model.graph.initializer if t.name == "w_down")
    w_down.CopyFrom(numpy_helper.from_array(scale * numpy_helper.to_array(w_down), "w_down"))
    (folder / "model.onnx.data").unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"].update({rel: digest(folder / rel) for rel in ("model.onnx", "model.onnx.data")})
    rewrite_manifest(folder, manifest)


def test_a_cache_folder_linked_out_of_the_artifact_is_neither_written_nor_read(store, tmp_path, caplog) -> None:
    """cache/ as a link to a folder elsewhere: the lowered graph was written there (ort_cpu_*.onnx
    in someone else's folder). It is lowered in memory instead, with a warning, and the linked
    folder is left as it was."""
    folder = tmp_path / "moe"
    shutil.copytree(store.block("moe").path, folder, ignore=shutil.ignore_patterns(CACHE_DIR, "report"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine")
    (folder / CACHE_DIR).symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING):
        assert golden_error(Artifact.load(folder)) <= 1e-5
    assert sorted(p.name for p in elsewhere.iterdir()) == ["notes.txt"]
    assert "moedeploy keeps its caches inside the artifact only" in caplog.text and "lowered in memory" in caplog.text


@pytest.mark.parametrize("large", [True, False])
def test_writing_a_large_cache_frees_its_lowering(store, tmp_path, monkeypatch, large) -> None:
    """A block's lowering holds its whole weights in a graph of reference cycles: writing a cache
    of RELEASE_ABOVE_BYTES or more frees that graph at once; a smaller one is left to Python's
    collector. Automatic collection is off meanwhile; the threshold is moved to either side of
    this block's few kilobytes."""
    folder = tmp_path / "moe"
    shutil.copytree(store.block("moe").path, folder, ignore=shutil.ignore_patterns(CACHE_DIR, "report"))
    _, left = graphs_left_by(lambda: create_session(Artifact.load(folder)), monkeypatch, large)
    assert cache_files(Artifact.load(folder), ".json")  # the cache was written, not read
    assert left == 0 if large else left > 0
