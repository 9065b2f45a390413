"""The artifact folder: a checked ONNX model with custom ops + bodies, a truthful manifest,
golden I/O that Polygraphy reads, and atomic writes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import onnxscript
import pytest
import torch

import moedeploy
from moedeploy.export import BLOCKS, ArtifactError, export_block
from moedeploy.export.artifact import Artifact
from moedeploy.runtime.ort import create_session
from tests.export.artifacts import eager_block, graph_nodes

# (kind, name, dtype, fold_bn): everything the other export tests create anyway.
ARTIFACTS = (
    [("block", name, "fp32", True) for name in BLOCKS]
    + [("block", name, "fp16", True) for name in ("rmsnorm", "moe", "decoder_layer", "batchnorm_mlp")]
    + [("block", name, "bf16", True) for name in ("rmsnorm", "moe")]
    + [("block", name, "fp32", False) for name in ("batchnorm", "batchnorm1d_transposed_mlp")]
    + [("decoder", "decoder", "fp32", True), ("decoder", "decoder", "fp16", True)]
)

# Which custom ops each model must contain, written down from the models' code.
EXPECTED_CUSTOM_OPS = {
    "rmsnorm": {("moe", "RMSNorm"): 1},
    "moe": {("moe", "MoE"): 1},
    "decoder_layer": {("moe", "RMSNorm"): 2, ("moe", "MoE"): 1},
    "decoder_layer_dense": {("moe", "RMSNorm"): 2},
    "decoder": {("moe", "RMSNorm"): 5, ("moe", "MoE"): 2},  # 2 layers x 2 norms + final norm
}
NP_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
ONNX_TYPES = {"fp32": onnx.TensorProto.FLOAT, "fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}


def get(store, key) -> Artifact:
    kind, name, dtype, fold = key
    return store.decoder(dtype) if kind == "decoder" else store.block(name, dtype, fold)


def ids(key) -> str:
    return "-".join(str(k) for k in key[1:])


@pytest.mark.parametrize("key", ARTIFACTS, ids=ids)
def test_model_checks_and_custom_ops_have_bodies(store, key) -> None:
    artifact = get(store, key)
    onnx.checker.check_model(str(artifact.model_path), full_check=True)
    model = onnx.load(str(artifact.model_path))
    opsets = {o.domain: o.version for o in model.opset_import}
    assert opsets.get("", opsets.get("ai.onnx")) == 23

    functions = {(f.domain, f.name): f for f in model.functions}
    counts: dict[tuple[str, str], int] = {}
    for node in graph_nodes(model):
        if node.domain == "moe":
            counts[(node.domain, node.op_type)] = counts.get((node.domain, node.op_type), 0) + 1
            assert (node.domain, node.op_type) in functions, f"{node.op_type} has no function body"
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs.get("plugin_namespace") == b"moe"
    assert counts == EXPECTED_CUSTOM_OPS.get(key[1], {})
    if counts:
        assert opsets.get("moe") == 3  # opset moe 3: MoE group scoring, clamped SwiGLU (RMSNorm unchanged since 1)
    for f in functions.values():
        f_opsets = {o.domain: o.version for o in f.opset_import}
        assert f_opsets.get("", f_opsets.get("ai.onnx")) == 23
        assert all(n.domain in ("", "ai.onnx") for n in f.node)  # bodies use standard ops only
    # The manifest's custom_ops say the same.
    listed = {(o["domain"], o["op_type"]): o["count"] for o in artifact.manifest["custom_ops"]}
    assert listed == counts
    # each op's version is the "moe" opset the graph imports
    moe_opset = {o.domain: o.version for o in model.opset_import}.get("moe")
    assert all(o["version"] == moe_opset == 3 and o["plugin_namespace"] == "moe" for o in artifact.manifest["custom_ops"])
    # the graph's element type is the artifact's dtype
    float_inputs = [i for i in model.graph.input if i.type.tensor_type.elem_type != onnx.TensorProto.INT64]
    assert float_inputs and all(i.type.tensor_type.elem_type == ONNX_TYPES[key[2]] for i in float_inputs)


@pytest.mark.parametrize("key", ARTIFACTS, ids=ids)
def test_manifest(store, key) -> None:
    kind, name, dtype, _ = key
    artifact = get(store, key)
    m = json.loads((artifact.path / "manifest.json").read_text())
    assert (m["name"], m["kind"], m["dtype"], m["opset"], m["seed"]) == (name, kind, dtype, 23, 0)
    assert m["versions"]["torch"] == torch.__version__
    assert m["versions"]["onnx"] == onnx.__version__
    assert m["versions"]["onnxruntime"] == onnxruntime.__version__
    assert m["versions"]["onnxscript"] == onnxscript.__version__
    assert m["versions"]["moedeploy"] == moedeploy.__version__

    model = onnx.load(str(artifact.model_path))
    for spec, values in ((m["inputs"], model.graph.input), (m["outputs"], model.graph.output)):
        assert [s["name"] for s in spec] == [v.name for v in values]
        for s, v in zip(spec, values, strict=True):
            dims = v.type.tensor_type.shape.dim
            assert len(s["shape"]) == len(dims)
            for d, proto in zip(s["shape"], dims, strict=True):
                if proto.dim_param:
                    assert isinstance(d, str) and d == proto.dim_param
                else:
                    assert isinstance(d, int) and d == proto.dim_value
    if kind == "block":
        assert m["inputs"] == [{"name": "x", "dtype": NP_NAMES[dtype], "shape": ["batch", "seq", 64]}]
        assert m["outputs"] == [{"name": "y", "dtype": NP_NAMES[dtype], "shape": ["batch", "seq", 64]}]
    else:
        assert m["inputs"][0] == {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}
        names = [i["name"] for i in m["inputs"][1:]]
        assert names == [f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")]
        assert all(i["shape"] == ["batch", 2, "past_seq", 16] for i in m["inputs"][1:])
        assert [o["name"] for o in m["outputs"]] == ["logits"] + [
            f"present.{i}.{kv}" for i in range(2) for kv in ("key", "value")
        ]
        assert m["outputs"][0]["shape"][0] == "batch" and m["outputs"][0]["shape"][2] == 256

    symbolic = {d for i in m["inputs"] for d in i["shape"] if isinstance(d, str)}
    assert symbolic  # every artifact here has dynamic dims
    for dim in symbolic:
        r = m["dynamic_ranges"][dim]
        assert all(isinstance(r[k], int) for k in ("min", "opt", "max"))
        assert 0 <= r["min"] <= r["opt"] <= r["max"]
    if kind == "decoder":
        assert m["dynamic_ranges"]["past_seq"]["min"] == 0  # prefill has an empty cache
        assert m["dynamic_ranges"]["seq"]["max"] <= m["config"]["max_positions"]

    # files: every file in the folder, relative paths, sha256 recomputed here
    # (cache/ holds lowered sessions that runtime tests sharing this session's store may have made:
    # derived files the manifest does not list, by design)
    on_disk = {p.relative_to(artifact.path).as_posix() for p in artifact.path.rglob("*") if p.is_file()
               and not p.relative_to(artifact.path).as_posix().startswith("cache/")}
    assert set(m["files"]) | {"manifest.json"} == on_disk
    for rel, digest in m["files"].items():
        assert not Path(rel).is_absolute()
        assert hashlib.sha256((artifact.path / rel).read_bytes()).hexdigest() == digest
    assert {"model.onnx", "golden/inputs.json", "golden/outputs.json"} <= set(m["files"])

    tol = m["tolerances"]
    assert set(tol) == {o["name"] for o in m["outputs"]}


@pytest.mark.parametrize("key", ARTIFACTS, ids=ids)
def test_golden_loads_with_polygraphy(store, key) -> None:
    from polygraphy.comparator import RunResults
    from polygraphy.json import load_json

    artifact = get(store, key)
    feeds = load_json(str(artifact.path / "golden" / "inputs.json"))
    results = RunResults.load(str(artifact.path / "golden" / "outputs.json"))
    assert len(feeds) == 1 and len(results) == 1
    runner, iterations = results[0]
    assert runner == "torch-eager" and len(iterations) == 1
    manifest = artifact.manifest
    assert list(feeds[0].keys()) == [i["name"] for i in manifest["inputs"]]
    assert list(iterations[0].keys()) == [o["name"] for o in manifest["outputs"]]
    for spec, array in zip(manifest["inputs"], feeds[0].values(), strict=True):
        assert isinstance(array, np.ndarray) and array.ndim == len(spec["shape"])
        assert all(d == s for d, s in zip(array.shape, spec["shape"], strict=True) if isinstance(s, int))
        if spec["dtype"] != "bfloat16":  # NumPy has no bfloat16: stored as exact fp32 values
            assert array.dtype.name == spec["dtype"]
    if key[0] == "block":
        assert feeds[0]["x"].shape == (2, 16, 64) and iterations[0]["y"].shape == (2, 16, 64)
        assert np.isfinite(iterations[0]["y"]).all() and np.abs(iterations[0]["y"]).max() > 0.1


def test_seed_is_recorded_and_changes_the_weights(store) -> None:
    artifact = store.block("rmsnorm", seed=7)
    assert artifact.manifest["seed"] == 7
    (feed,) = artifact.golden_inputs()
    (golden,) = artifact.golden_outputs()
    x = torch.from_numpy(feed["x"])
    with torch.no_grad():
        seed7, seed0 = eager_block("rmsnorm", seed=7)(x).numpy(), eager_block("rmsnorm", seed=0)(x).numpy()
    np.testing.assert_allclose(golden["y"], seed7, rtol=1e-6, atol=1e-6)
    assert np.abs(seed7 - seed0).max() > 1e-2


def test_a_modified_artifact_is_refused(store, tmp_path: Path) -> None:
    copy = tmp_path / "moe"
    shutil.copytree(store.block("moe").path, copy)
    Artifact.load(copy)  # intact copy verifies
    data = bytearray((copy / "model.onnx").read_bytes())
    data[-1] ^= 0xFF
    (copy / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256"):
        Artifact.load(copy)
    with pytest.raises(ArtifactError, match="sha256"):
        create_session(str(copy))
    data[-1] ^= 0xFF  # restored: verifies again
    (copy / "model.onnx").write_bytes(bytes(data))
    Artifact.load(copy)
    (copy / "golden" / "outputs.json").unlink()
    with pytest.raises(ArtifactError, match="missing"):
        Artifact.load(copy)


# --- atomic writes ------------------------------------------------------------------------------


def test_reexport_replaces_the_folder_and_leaves_no_temp(tmp_path: Path) -> None:
    out = tmp_path / "art"
    export_block("rmsnorm", out, seed=1)
    (out / "report").mkdir()  # compare's report of the old export: moedeploy's, and stale now
    (out / "report" / "report.json").write_text("{}")
    export_block("rmsnorm", out, seed=2)
    assert not (out / "report").exists()
    assert Artifact.load(out).manifest["seed"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_a_manifest_its_own_check_refuses_never_replaces_the_old_artifact(tmp_path: Path, monkeypatch) -> None:
    """The manifest is held to Artifact.load's checks before the new folder replaces `out`: a
    float sliding_window in config.json reached the manifest, which only load refused, after
    the good artifact had been replaced by one nothing could open."""
    from moedeploy.export import exporter

    out = tmp_path / "art"
    export_block("rmsnorm", out, seed=1)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    checked = []

    def refusing(manifest):
        checked.append(manifest["seed"])
        return "config fields sliding_window are not integers"

    monkeypatch.setattr(exporter, "first_manifest_problem", refusing)
    with pytest.raises(ArtifactError, match=rf"the export made a manifest its own check refuses \(config fields "
                                            rf"sliding_window are not integers\); {out} is as it was"):
        export_block("rmsnorm", out, seed=2)
    assert checked == [2]  # the new manifest, sealed as it would be written
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_failed_export_keeps_the_old_artifact_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    from moedeploy.export import exporter

    out = tmp_path / "art"
    export_block("rmsnorm", out, seed=1)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(exporter, "save_golden", broken)
    with pytest.raises(OSError, match=rf"(?i)no space left on the device while writing {out}"):
        export_block("rmsnorm", out, seed=2)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]

    # a new target in folders that do not exist yet: the failure removes what it created
    with pytest.raises(OSError, match=r"(?i)no space"):
        export_block("rmsnorm", tmp_path / "new" / "deeper" / "art")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
