"""`compare --checkpoint DIR`: a decoder exported from a checkpoint that has since moved.

The eager reference is rebuilt from DIR only when DIR's weights have the fingerprint the
manifest recorded at export (`weights_sha256`); any other weights are refused, because a
reference built from them would make every verdict meaningless.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from polygraphy.comparator import RunResults

from moedeploy.compare.api import compare
from moedeploy.compare.data import ArtifactDataLoader
from moedeploy.export import export
from moedeploy.export.artifact import MANIFEST, Artifact, ArtifactError
from moedeploy.export.decoder import DecoderWithPast, past_names
from moedeploy.models import DecoderConfig, MoEDecoder
from tests.compare.helpers import assert_one_error_line, fresh_copy, run_cli
from tests.export.artifacts import rewrite_manifest

CONFIG = DecoderConfig(
    vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=3, top_k=2,
    expert_hidden=48, max_positions=64, rope_theta=10000.0,
)


def _checkpoint(folder: Path, seed: int) -> Path:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        MoEDecoder(CONFIG).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def moved(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(artifact, the checkpoint's old place, its new place): exported, then the folder moved."""
    root = tmp_path_factory.mktemp("moved")
    old = _checkpoint(root / "mixtral", seed=5)
    export("decoder", root / "artifact", checkpoint=old)
    new = root / "elsewhere" / "mixtral"
    new.parent.mkdir()
    shutil.move(old, new)
    return root / "artifact", old, new


def test_missing_checkpoint_is_one_line_naming_the_option(moved, tmp_path):
    artifact, old, _ = moved
    folder = fresh_copy(artifact, tmp_path / "artifact")
    assert_one_error_line(run_cli("compare", folder), str(old), "gone", "--checkpoint")
    assert not (folder / "report").exists()


def test_the_new_place_rebuilds_the_same_reference(moved, tmp_path):
    artifact, _, new = moved
    folder = fresh_copy(artifact, tmp_path / "artifact")
    report = compare(folder, iterations=2, checkpoint=new)
    assert report["passed"] is True
    assert report["reference_checkpoint"] == str(new.resolve())
    assert f"from --checkpoint {new.resolve()}" in (folder / "report" / "report.md").read_text()

    # torch-eager's outputs are the checkpoint's model, loaded here on its own
    model = DecoderWithPast(MoEDecoder.from_pretrained(new).eval()).eval()
    eager = RunResults.load(str(folder / "report" / "run_results.json"))["torch-eager"]
    for feed, result in zip(ArtifactDataLoader(Artifact.load(folder), 2, seed=0), eager, strict=True):
        past = [torch.from_numpy(feed[name]) for name in past_names(CONFIG.n_layers)]
        with torch.no_grad():
            logits, _ = model(torch.from_numpy(feed["input_ids"]), list(zip(past[0::2], past[1::2], strict=True)))
        np.testing.assert_allclose(result["logits"], logits.numpy(), rtol=1e-6, atol=1e-6)


def test_the_cli_takes_the_new_place(moved, tmp_path):
    artifact, _, new = moved
    folder = fresh_copy(artifact, tmp_path / "artifact")
    result = run_cli("compare", folder, "--checkpoint", new, "--iterations", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout


def test_other_weights_are_refused(moved, tmp_path):
    artifact, _, _ = moved
    other = _checkpoint(tmp_path / "other", seed=6)  # same shapes, other values
    folder = fresh_copy(artifact, tmp_path / "artifact")
    with pytest.raises(ArtifactError, match="weights_sha256"):
        compare(folder, checkpoint=other)
    assert_one_error_line(run_cli("compare", folder, "--checkpoint", other), str(other), "weights_sha256")
    assert not (folder / "report").exists()


def test_an_artifact_without_a_fingerprint_cannot_take_a_checkpoint(moved, tmp_path):
    artifact, _, new = moved
    folder = fresh_copy(artifact, tmp_path / "artifact")
    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["config"]["source"]["weights_sha256"]
    rewrite_manifest(folder, manifest)
    with pytest.raises(ArtifactError, match="no weights fingerprint"):
        compare(folder, checkpoint=new)
    assert not (folder / "report").exists()


def test_checkpoint_is_refused_for_a_preset_decoder(artifacts, moved, tmp_path):
    _, _, new = moved
    folder = fresh_copy(artifacts.decoder(), tmp_path / "preset")
    with pytest.raises(ArtifactError, match=r"--checkpoint is for decoders exported from a checkpoint.*'tiny' preset"):
        compare(folder, checkpoint=new)
    assert not (folder / "report").exists()


def test_checkpoint_that_is_not_a_folder_is_refused(moved, tmp_path):
    artifact, _, _ = moved
    folder = fresh_copy(artifact, tmp_path / "artifact")
    with pytest.raises(ArtifactError, match="is not a folder"):
        compare(folder, checkpoint=tmp_path / "nowhere")


def test_the_up_front_reference_is_handed_over_not_kept():
    """Built once before any run (a bad checkpoint fails early), then owned by the runner alone."""
    import gc
    import weakref

    from moedeploy.compare.api import handed_out_once

    built = []

    def rebuild() -> torch.nn.Module:
        built.append(1)
        return torch.nn.Linear(2, 2)

    loader = handed_out_once(rebuild(), rebuild)
    first = loader()
    assert len(built) == 1
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None  # the loader kept no reference: the runner's deactivation frees it
    loader()
    assert len(built) == 2


@pytest.mark.parametrize("moved_too", [False, True])
def test_an_edited_config_json_is_named_not_blamed_on_a_layer(moved, tmp_path, moved_too):
    """The fingerprint covers the weights only: a config.json edited since export (here the norm
    epsilon) is refused naming the field, whether the checkpoint is where it was or passed anew."""
    artifact, _, new = moved
    checkpoint = tmp_path / "mixtral"
    shutil.copytree(new, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["config"]["norm_eps"] = 0.3
    (checkpoint / "config.json").write_text(json.dumps(config))
    folder = fresh_copy(artifact, tmp_path / "artifact")
    if not moved_too:  # the manifest records this copy as the checkpoint's place
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["config"]["source"]["checkpoint"] = str(checkpoint)
        rewrite_manifest(folder, manifest)
    # moedeploy's own format: its config.json holds DecoderConfig's names (test_checkpoint.py: a family's)
    with pytest.raises(ArtifactError, match=r"\(norm_eps: 1e-0\d at export, 0\.3 now") as e:
        compare(folder, checkpoint=checkpoint if moved_too else None)
    # another model's checkpoint passed by mistake reads the same: the advice covers both
    assert "else pass the checkpoint the artifact was exported from" in str(e.value)
    assert not (folder / "report").exists()
