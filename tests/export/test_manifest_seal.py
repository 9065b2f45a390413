"""manifest.json is sealed: export records the sha256 of its contents in it, and a load refuses a
manifest whose contents changed since. Before, the files' hashes (kept in the manifest) covered
every file but the manifest: tolerances raised by hand to 1e9 made compare PASS a wrong graph,
and a shortened outputs list failed inside compare with a zip() error.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from moedeploy.compare.api import compare
from moedeploy.export.artifact import MANIFEST, Artifact, ArtifactError
from tests.compare.helpers import assert_one_error_line, run_cli


def _copy(artifact: Artifact, dest: Path) -> Path:
    shutil.copytree(artifact.path, dest, ignore=shutil.ignore_patterns("cache", "report", "engines"))
    return dest


def _canonical_sha256(manifest: dict) -> str:
    """The seal by its definition: sha256 of the rest of the manifest as sorted, compact JSON."""
    rest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_an_export_seals_its_manifest(store) -> None:
    manifest = json.loads((store.block("moe").path / MANIFEST).read_text())
    assert manifest["manifest_sha256"] == _canonical_sha256(manifest)


def test_a_tolerance_raised_by_hand_is_refused_not_passed(store, tmp_path) -> None:
    folder = _copy(store.block("moe"), tmp_path / "moe")
    manifest = json.loads((folder / MANIFEST).read_text())
    for tolerance in manifest["tolerances"].values():
        tolerance["atol"] = 1e9
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
    with pytest.raises(ArtifactError, match=r"manifest\.json was edited after export .*re-export the artifact"):
        Artifact.load(folder)
    assert_one_error_line(run_cli("compare", folder), str(folder / MANIFEST), "edited after export")
    assert not (folder / "report").exists()


def test_a_shortened_outputs_list_is_refused_at_load(store, tmp_path) -> None:
    folder = _copy(store.decoder(), tmp_path / "decoder")
    manifest = json.loads((folder / MANIFEST).read_text())
    assert len(manifest["outputs"]) > 1
    manifest["outputs"] = manifest["outputs"][:1]
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="edited after export"):
        compare(folder, iterations=1)
    assert not (folder / "report").exists()


def test_reformatting_the_json_is_not_an_edit(store, tmp_path) -> None:
    """An editor that re-indents the file or reorders its keys changes no value: still loads."""
    folder = _copy(store.block("moe"), tmp_path / "moe")
    manifest = json.loads((folder / MANIFEST).read_text())
    reordered = dict(reversed(list(manifest.items())))
    (folder / MANIFEST).write_text(json.dumps(reordered, indent=7))
    assert Artifact.load(folder).manifest["tolerances"] == manifest["tolerances"]


def test_deleting_the_seal_does_not_undo_it(store, tmp_path) -> None:
    """Before, a manifest without the key read as one from before the seal: delete it, raise the
    tolerances, and compare passed anything again."""
    folder = _copy(store.block("moe"), tmp_path / "moe")
    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["manifest_sha256"]
    manifest["tolerances"]["y"]["atol"] = 1e9
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"manifest\.json has no manifest_sha256: it was edited, or written by a "
                                            r"moedeploy from before manifests were sealed"):
        Artifact.load(folder)


def test_an_edited_file_hash_is_called_an_edit_of_the_manifest(store, tmp_path) -> None:
    """Not blamed on model.onnx, which is untouched."""
    folder = _copy(store.block("moe"), tmp_path / "moe")
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"]["model.onnx"] = "0" * 64
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="edited after export"):
        Artifact.load(folder)


def test_an_export_does_not_trust_an_edited_manifest_with_what_it_may_delete(store, tmp_path) -> None:
    """A files list edited to claim the user's file made a re-export delete it."""
    from moedeploy.export import export
    from moedeploy.utils.io import OutputRefused

    folder = _copy(store.block("rmsnorm"), tmp_path / "rmsnorm")
    (folder / "notes.txt").write_text("mine")
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"]["notes.txt"] = "0" * 64
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(OutputRefused, match=r"manifest\.json was edited after export or predates sealed manifests"):
        export("rmsnorm", folder)
    assert (folder / "notes.txt").read_text() == "mine"


def test_an_edit_that_also_breaks_the_schema_is_named_as_an_edit(store, tmp_path) -> None:
    """atol 1e9 also fails the schema's bound: the message said so, as if export had written it."""
    folder = _copy(store.block("moe"), tmp_path / "moe")
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["tolerances"]["y"] = {"atol": 1e9, "rtol": 1e9}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="edited after export"):
        Artifact.load(folder)


def test_a_ctrl_c_that_torch_onnx_export_wraps_is_raised_as_itself() -> None:
    """torch.onnx.export caught the KeyboardInterrupt of a Ctrl-C during tracing and raised its own
    error: the export said 'torch.onnx.export failed' with torch's colour codes, exit 1."""
    from moedeploy.export.onnx_export import ExportError, export_failure

    def wrapped(inner: BaseException) -> Exception:
        try:
            try:
                raise inner
            except BaseException:
                raise RuntimeError("\x1b[96mThis is step 1/3\x1b[0m of exporting the model to ONNX.") from None
        except RuntimeError as e:
            return e

    ctrl_c = KeyboardInterrupt()
    assert export_failure(wrapped(ctrl_c)) is ctrl_c
    plain = export_failure(wrapped(ValueError("bad op")))
    assert isinstance(plain, ExportError)
    assert str(plain) == "torch.onnx.export failed: RuntimeError: This is step 1/3 of exporting the model to ONNX."
