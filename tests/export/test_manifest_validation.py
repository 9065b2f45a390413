"""`Artifact.load` trusts nothing in manifest.json: every field downstream code reads has the
shape an exporter writes, every file the artifact needs is listed and hashed, and no file,
listed or referenced by model.onnx, lies outside the folder. Each refusal is one line naming
the problem and the fix; each case here was accepted (or a traceback) before.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from moedeploy.export.artifact import MANIFEST, Artifact, ArtifactError
from moedeploy.runtime.ort import create_session
from tests.export.artifacts import plain_session, rewrite_manifest

Edit = Callable[[dict[str, Any], Path], None]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copy_artifact(artifact: Artifact, dest: Path) -> Path:
    """A private copy: the session's artifacts are shared by every test."""
    shutil.copytree(artifact.path, dest, ignore=shutil.ignore_patterns("cache", "report", "engines"))
    return dest


def tampered(artifact: Artifact, tmp_path: Path, edit: Edit) -> Path:
    """A copy of `artifact` whose manifest (and files) `edit` changed in place."""
    folder = copy_artifact(artifact, tmp_path / "artifact")
    manifest = json.loads((folder / MANIFEST).read_text())
    edit(manifest, folder)
    rewrite_manifest(folder, manifest)  # sealed: these tests are of the schema, test_manifest_seal of the seal
    return folder


def refusal(folder: Path) -> str:
    with pytest.raises(ArtifactError) as caught:
        Artifact.load(folder)
    message = str(caught.value)
    assert "\n" not in message and "re-export the artifact" in message
    return message


# --- edits ------------------------------------------------------------------------------------


def list_outside_file(rel: str) -> Edit:
    """List a real file outside the artifact with its true sha256, as a forged manifest would."""
    def edit(m: dict[str, Any], folder: Path) -> None:
        m["files"][rel] = digest((folder / rel) if not rel.startswith("/") else Path(rel))
    return edit


def symlink_model_out(m: dict[str, Any], folder: Path) -> None:
    outside = folder.parent / "elsewhere.onnx"
    shutil.copyfile(folder / "model.onnx", outside)  # a valid model, so only its place is wrong
    (folder / "model.onnx").unlink()
    (folder / "model.onnx").symlink_to(outside)
    m["files"]["model.onnx"] = digest(outside)


def symlink_golden_folder_out(m: dict[str, Any], folder: Path) -> None:
    """Not the file but a folder on its way leads out: golden/ -> ../golden-elsewhere."""
    shutil.move(folder / "golden", folder.parent / "golden-elsewhere")
    (folder / "golden").symlink_to(folder.parent / "golden-elsewhere")


def symlink_loop(m: dict[str, Any], folder: Path) -> None:
    (folder / "model.onnx").unlink()
    (folder / "model.onnx").symlink_to("model.onnx")


def unlist(rel: str) -> Edit:
    def edit(m: dict[str, Any], folder: Path) -> None:
        del m["files"][rel]
    return edit


def set_field(path: str | tuple[str, ...], value: Any) -> Edit:
    """m[a][b]... = value for path 'a.b...' (a tuple when a key holds a dot); DELETE removes the key."""
    *parents, last = path.split(".") if isinstance(path, str) else path

    def at(target: Any, key: str) -> Any:  # a list's entries by number ('outputs.0.name')
        return int(key) if isinstance(target, list) else key

    def edit(m: dict[str, Any], folder: Path) -> None:
        target = m
        for key in parents:
            target = target[at(target, key)]
        if value is DELETE:
            del target[at(target, last)]
        else:
            target[at(target, last)] = value
    return edit


DELETE = object()


def name_outside_external_data(location: str) -> Edit:
    """model.onnx keeps its weights in external data at `location` (outside the folder; {tmp}
    is the test's tmp_path), and the manifest hashes the edited model: only the location is wrong."""
    def edit(m: dict[str, Any], folder: Path) -> None:
        save_with_external_data(folder, location.format(tmp=folder.parent))
        m["files"]["model.onnx"] = digest(folder / "model.onnx")
    return edit


def save_with_external_data(folder: Path, location: str) -> None:
    model = onnx.load(str(folder / "model.onnx"))
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)
    data = folder / "model.onnx.data"
    target = (folder / location).resolve() if not location.startswith("/") else Path(location)
    if target != data.resolve():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(data, target)
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for tensor in graph.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(graph, str(folder / "model.onnx"))


# (case, edit, phrase the one-line refusal must contain)
BLOCK_CASES: list[tuple[str, Edit, str]] = [
    ("dotdot-file", list_outside_file("../../../../../../../../etc/passwd"), "'../../../../../../../../etc/passwd' is not a relative path inside"),
    ("absolute-file", list_outside_file("/etc/hostname"), "'/etc/hostname' is not a relative path inside"),
    ("model-symlink-out", symlink_model_out, "model.onnx leads to"),
    ("golden-folder-symlink-out", symlink_golden_folder_out, "golden/inputs.json leads to"),
    ("model-symlink-loop", symlink_loop, "model.onnx is missing"),
    ("model-unlisted", unlist("model.onnx"), "files does not list model.onnx"),
    ("golden-unlisted", unlist("golden/outputs.json"), "files does not list golden/outputs.json"),
    ("reference-unlisted", unlist("reference.safetensors"), "files does not list reference.safetensors"),
    ("files-empty", set_field("files", {}), "files does not list model.onnx"),
    ("files-a-list", set_field("files", ["model.onnx"]), "files is not an object"),
    ("files-bad-digest", set_field(("files", "model.onnx"), "abc"), "not a sha256 hex digest"),
    ("no-kind", set_field("kind", DELETE), "kind is missing, not one of block, decoder"),
    ("unknown-kind", set_field("kind", "encoder"), "kind is 'encoder'"),
    ("unknown-dtype", set_field("dtype", "fp8"), "dtype is 'fp8'"),
    ("name-escapes", set_field("name", "../../escaped_model"), "name '../../escaped_model' is not a valid model name"),
    ("name-with-slash", set_field("name", "a/b"), "is not a valid model name"),
    ("name-empty", set_field("name", ""), "is not a valid model name"),
    ("name-not-a-string", set_field("name", 7), "is not a valid model name"),
    ("schema-version", set_field("schema_version", 2), "schema_version is 2"),
    ("seed-a-string", set_field("seed", "0"), "seed is '0', not an integer"),
    ("inputs-a-dict", set_field("inputs", {"x": 1}), "inputs is not a non-empty list"),
    ("inputs-empty", set_field("inputs", []), "inputs is not a non-empty list"),
    ("input-without-name", set_field("inputs", [{"dtype": "float32", "shape": [1]}]), "has no name"),
    ("output-bad-dtype", set_field("outputs", [{"name": "y", "dtype": "floaty", "shape": ["batch"]}]), "dtype 'floaty'"),
    ("output-negative-dim", set_field("outputs", [{"name": "y", "dtype": "float32", "shape": ["batch", -1]}]), "has shape"),
    ("range-max-past-int32", set_field("dynamic_ranges.batch.max", 2**31), "0 <= min <= opt <= max < 2**31"),
    ("range-min-above-opt", set_field("dynamic_ranges.seq.min", 17), "'seq'"),
    ("range-negative", set_field("dynamic_ranges.batch.min", -1), "'batch'"),
    ("range-float", set_field("dynamic_ranges.batch.opt", 2.5), "'batch'"),
    ("range-bool", set_field("dynamic_ranges.batch.min", True), "'batch'"),
    ("range-missing", set_field("dynamic_ranges.seq", DELETE), "dim 'seq' with no entry in dynamic_ranges"),
    ("ranges-a-list", set_field("dynamic_ranges", []), "dynamic_ranges is not an object"),
    ("tolerance-negative", set_field("tolerances.y.atol", -1.0), "tolerances 'y'"),
    ("tolerance-a-string", set_field("tolerances.y.rtol", "tight"), "tolerances 'y'"),
    ("config-a-list", set_field("config", []), "config is not an object"),
    ("block-name-missing", set_field("config.block", DELETE), "config.block"),
    ("custom-ops-a-dict", set_field("custom_ops", {}), "custom_ops is not a list"),
    ("output-renamed", set_field("outputs.0.name", "z"), "manifest.json's outputs are not model.onnx's"),
    ("input-dim", set_field("inputs.0.shape.1", 32), "manifest.json's inputs are not model.onnx's"),
    ("external-data-dotdot", name_outside_external_data("../weights.bin"), "from '../weights.bin', outside the artifact folder"),
    ("external-data-absolute", name_outside_external_data("{tmp}/weights.bin"), "weights.bin', outside the artifact folder"),
]
DECODER_CASES: list[tuple[str, Edit, str]] = [
    # valid by the schema, but not the graph's: triton-repo wrote a config for them, compare failed inside
    ("output-renamed", set_field("outputs.0.name", "z"), "manifest.json's outputs are not model.onnx's"),
    ("input-dtype", set_field("inputs.0.dtype", "int32"), "manifest.json's inputs are not model.onnx's"),
    ("config-field-missing", set_field("config.vocab_size", DELETE), "config lacks the decoder fields vocab_size"),
    ("config-field-a-string", set_field("config.n_layers", "two"), "config fields n_layers are not integers"),
    ("config-field-a-float", set_field("config.vocab_size", 256.0), "config fields vocab_size are not integers"),
    ("config-invalid", set_field("config.top_k", 9), "config is not a valid decoder configuration"),
]


@pytest.mark.parametrize(("edit", "phrase"), [c[1:] for c in BLOCK_CASES], ids=[c[0] for c in BLOCK_CASES])
def test_block_manifest_refusals(store, tmp_path, edit: Edit, phrase: str) -> None:
    folder = tampered(store.block("moe"), tmp_path, edit)
    assert phrase in refusal(folder)


@pytest.mark.parametrize(("edit", "phrase"), [c[1:] for c in DECODER_CASES], ids=[c[0] for c in DECODER_CASES])
def test_decoder_manifest_refusals(store, tmp_path, edit: Edit, phrase: str) -> None:
    folder = tampered(store.decoder("fp32"), tmp_path, edit)
    assert phrase in refusal(folder)


def test_the_message_names_the_manifest(store, tmp_path) -> None:
    folder = tampered(store.block("moe"), tmp_path, set_field("files", ["model.onnx"]))
    assert refusal(folder).startswith(f"{folder / MANIFEST}: ")


@pytest.mark.parametrize("manifest", [[1, 2], "text", 3, None])
def test_a_manifest_that_is_not_an_object(store, tmp_path, manifest: Any) -> None:
    folder = copy_artifact(store.block("moe"), tmp_path / "artifact")
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert "not an object" in refusal(folder)


def test_schema_checks_run_without_verify(store, tmp_path) -> None:
    """verify=False skips hashing (a worker re-opening a verified artifact), not the schema."""
    folder = tampered(store.block("moe"), tmp_path, symlink_model_out)
    with pytest.raises(ArtifactError, match="outside the artifact"):
        Artifact.load(folder, verify=False)


def test_an_unlisted_model_is_never_served(store, tmp_path) -> None:
    """The issue's case: model.onnx left out of `files` and its output weights scaled by 10.
    Before, the artifact loaded and ONNX Runtime served outputs off by 10."""
    def corrupt_and_unlist(m: dict[str, Any], folder: Path) -> None:
        model = onnx.load(str(folder / "model.onnx"))
        w_down = next(t for t in model.graph.initializer if t.name == "w_down")
        w_down.CopyFrom(numpy_helper.from_array(10 * numpy_helper.to_array(w_down), "w_down"))
        onnx.save(model, str(folder / "model.onnx"))
        del m["files"]["model.onnx"]

    folder = tampered(store.block("moe"), tmp_path, corrupt_and_unlist)
    assert "files does not list model.onnx" in refusal(folder)
    with pytest.raises(ArtifactError):
        create_session(folder)


def test_fresh_artifacts_validate(store) -> None:
    """What the current exporter writes passes, with every required file listed."""
    for artifact, files in ((store.block("moe"), ["model.onnx"]), (store.decoder("fp32"), ["model.onnx", "model.onnx.data"])):
        loaded = Artifact.load(artifact.path)
        assert loaded.model_files() == files  # a decoder's weights are always streamed to the data file
        required = {"model.onnx", "golden/inputs.json", "golden/outputs.json"}
        if loaded.kind == "block":
            required.add("reference.safetensors")
        assert required <= set(loaded.manifest["files"])


def test_external_data_inside_the_folder_is_accepted_and_runs(store, tmp_path) -> None:
    """The > 2 GB layout (weights in model.onnx.data, listed and hashed) loads and runs, and
    the repository/cache see both model files."""
    def externalise(m: dict[str, Any], folder: Path) -> None:
        save_with_external_data(folder, "model.onnx.data")
        m["files"]["model.onnx"] = digest(folder / "model.onnx")
        m["files"]["model.onnx.data"] = digest(folder / "model.onnx.data")

    folder = tampered(store.block("moe"), tmp_path, externalise)
    artifact = Artifact.load(folder)
    assert artifact.model_files() == ["model.onnx", "model.onnx.data"]
    feed = artifact.golden_inputs()[0]
    expected = plain_session(folder / "model.onnx").run(None, feed)[0]  # the graph's own function bodies
    np.testing.assert_allclose(create_session(artifact).run(feed)[0], expected, rtol=1e-5, atol=1e-5)


def test_external_data_that_files_does_not_list(store, tmp_path) -> None:
    def externalise_unlisted(m: dict[str, Any], folder: Path) -> None:
        save_with_external_data(folder, "model.onnx.data")
        m["files"]["model.onnx"] = digest(folder / "model.onnx")

    folder = tampered(store.block("moe"), tmp_path, externalise_unlisted)
    assert "model.onnx uses model.onnx.data, which files does not list" in refusal(folder)


def test_cli_says_it_in_one_line(store, tmp_path) -> None:
    """Through the command a user runs: one error line, exit code 1, no traceback."""
    from typer.testing import CliRunner

    from moedeploy.cli import app

    folder = tampered(store.block("moe"), tmp_path, set_field("files", ["model.onnx"]))
    result = CliRunner().invoke(app, ["check", str(folder)])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "files is not an object" in lines[0]
