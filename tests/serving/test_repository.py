"""`triton-repo`: model repositories for a standalone Triton, each config.pbtxt parsed with
tritonclient's model_config_pb2 (Triton's own schema) and checked field by field.

No standalone Triton runs here (PyTriton bundles only the Python backend); the ONNX model
file is instead run at the config's shapes in a plain ONNX Runtime session, against eager
PyTorch. The TensorRT cases use a placeholder file as the plan: they test which plan is
chosen and what is written, never a TensorRT run.
"""

from __future__ import annotations

import json
import shlex

import onnxruntime as ort
import pytest
import torch

from moedeploy.export.artifact import sha256
from moedeploy.export.decoder import past_names, present_names
from moedeploy.serving.repository import RepositoryOptions, write_repository
from moedeploy.serving.specs import ServingError
from tests.export.artifacts import eager_block, rewrite_manifest

pb = pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="needs tritonclient[all]")
text_format = pytest.importorskip("google.protobuf.text_format")


def parse(path) -> object:
    return text_format.Parse(path.read_text(), pb.ModelConfig())


def dtype_name(value: int) -> str:
    return pb.DataType.Name(value)


def test_block_repository(store, tmp_path) -> None:
    artifact = store.block("moe")
    result = write_repository(artifact, tmp_path / "repo", RepositoryOptions(instances=2, kind="cpu", max_queue_delay_us=500))
    assert result.model_dir == tmp_path / "repo" / "moe"
    assert sorted(p.relative_to(result.model_dir).as_posix() for p in result.model_dir.rglob("*")) == [
        "1", "1/model.onnx", "config.pbtxt",
    ]
    assert sha256(result.model_file) == artifact.manifest["files"]["model.onnx"]
    config = parse(result.config)
    assert config.name == "moe" and config.backend == "onnxruntime"
    assert config.max_batch_size == 16
    assert config.default_model_filename == "model.onnx"
    assert [(i.name, dtype_name(i.data_type), list(i.dims)) for i in config.input] == [("x", "TYPE_FP32", [-1, 64])]
    assert [(o.name, dtype_name(o.data_type), list(o.dims)) for o in config.output] == [("y", "TYPE_FP32", [-1, 64])]
    assert config.HasField("dynamic_batching") and config.dynamic_batching.max_queue_delay_microseconds == 500
    [group] = config.instance_group
    assert group.count == 2 and pb.ModelInstanceGroup.Kind.Name(group.kind) == "KIND_CPU"
    assert result.launch == f"tritonserver --model-repository={(tmp_path / 'repo').resolve()}"


def test_the_model_file_runs_at_the_configs_shapes(store, tmp_path) -> None:
    """Batch dim + config dims (-1 filled in) into the repository's model.onnx = eager PyTorch."""
    result = write_repository(store.block("moe"), tmp_path / "repo")
    config = parse(result.config)
    [x_spec] = config.input
    shape = [config.max_batch_size, *(7 if d == -1 else d for d in x_spec.dims)]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(result.model_file), options, providers=["CPUExecutionProvider"])
    [y] = session.run([config.output[0].name], {x_spec.name: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(y), eager_block("moe")(x), atol=1e-5, rtol=1e-5)


def test_decoder_repository_declares_the_kv_cache(store, tmp_path) -> None:
    config = parse(write_repository(store.decoder("fp32"), tmp_path / "repo", RepositoryOptions(max_batch_size=4)).config)
    assert config.name == "decoder" and config.max_batch_size == 4
    assert [i.name for i in config.input] == ["input_ids", *past_names(2)]
    assert [o.name for o in config.output] == ["logits", *present_names(2)]
    inputs = {i.name: i for i in config.input}
    assert dtype_name(inputs["input_ids"].data_type) == "TYPE_INT64" and list(inputs["input_ids"].dims) == [-1]
    assert list(inputs["past_key_values.1.value"].dims) == [2, -1, 16]
    assert not inputs["past_key_values.1.value"].optional  # a standalone ONNX Runtime takes an empty cache
    assert list(config.output[0].dims) == [-1, 256]


def test_fp16_and_no_dynamic_batching(store, tmp_path) -> None:
    options = RepositoryOptions(dynamic_batching=False)
    config = parse(write_repository(store.block("rmsnorm", "fp16"), tmp_path / "repo", options).config)
    assert dtype_name(config.input[0].data_type) == "TYPE_FP16"
    assert not config.HasField("dynamic_batching")
    assert pb.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind) == "KIND_AUTO"


def test_rewriting_one_model_keeps_the_others(store, tmp_path) -> None:
    repo = tmp_path / "repo"
    write_repository(store.block("moe"), repo)
    write_repository(store.decoder("fp32"), repo)
    write_repository(store.block("moe"), repo, RepositoryOptions(max_batch_size=2))
    assert sorted(p.name for p in repo.iterdir()) == ["decoder", "moe"]
    assert parse(repo / "moe" / "config.pbtxt").max_batch_size == 2


def fake_plan(artifact, tmp_path, aot: bool, max_batch: int = 16, name: str | None = None):
    """A copy of the artifact with a placeholder plan + build metadata as `moedeploy build` writes it."""
    import shutil

    copy = tmp_path / "artifact"
    if not copy.exists():
        shutil.copytree(artifact.path, copy)
    engines = copy / "engines"
    engines.mkdir(exist_ok=True)
    stem = name or f"nvidia-h100_trt10.13_fp32_{'aot' if aot else 'jit'}"
    (engines / f"{stem}.plan").write_bytes(b"placeholder, not a TensorRT plan")
    seal = json.loads((copy / "manifest.json").read_text())["manifest_sha256"]  # what `build` records
    meta = {"dtype": "fp32", "aot": aot, "artifact_manifest_sha256": seal,
            "profile": {"x": {"min": [1, 1, 64], "opt": [2, 16, 64], "max": [max_batch, 256, 64]}}}
    (engines / f"{stem}.json").write_text(json.dumps(meta))
    return copy


ELF_PLACEHOLDER = b"\x7fELF placeholder"  # a shared library's first bytes; nothing loads it here


def test_tensorrt_repository_from_an_aot_plan(store, tmp_path) -> None:
    artifact = fake_plan(store.block("moe"), tmp_path, aot=True, max_batch=8)
    lib = tmp_path / "libextra_plugins.so"
    lib.write_bytes(ELF_PLACEHOLDER)
    result = write_repository(artifact, tmp_path / "repo", RepositoryOptions(backend="tensorrt", plugin_libs=[lib]))
    config = parse(result.config)
    assert config.platform == "tensorrt_plan" and config.default_model_filename == "model.plan"
    assert config.max_batch_size == 8  # capped by the plan's optimisation profile
    assert pb.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind) == "KIND_GPU"
    assert result.model_file.read_bytes() == b"placeholder, not a TensorRT plan"
    assert (result.model_dir / "plugins" / lib.name).is_file()
    assert shlex.split(result.launch) == ["tritonserver", f"--model-repository={(tmp_path / 'repo').resolve()}",
                                          f"--backend-config=tensorrt,plugins={(result.model_dir / 'plugins' / lib.name).resolve()}"]


def test_the_launch_line_pastes_into_a_shell_with_spaces_and_quotes_in_paths(store, tmp_path) -> None:
    """The printed command named `--model-repository=/tmp/ü dir/re po` unquoted: pasted, the
    shell split it into three arguments."""
    artifact = fake_plan(store.block("moe"), tmp_path, aot=True)
    libs = tmp_path / "my libs"
    libs.mkdir()
    lib = libs / "lib'p.so"
    lib.write_bytes(ELF_PLACEHOLDER)
    out = tmp_path / "ü dir" / "re po"
    result = write_repository(artifact, out, RepositoryOptions(backend="tensorrt", plugin_libs=[lib]))
    assert shlex.split(result.launch) == ["tritonserver", f"--model-repository={out.resolve()}",
                                          f"--backend-config=tensorrt,plugins={(result.model_dir / 'plugins' / lib.name).resolve()}"]


@pytest.mark.parametrize(("setup", "options", "message"), [
    ("none", {}, "no TensorRT plan for fp32"),
    ("jit", {}, "is a JIT plan"),
    ("two", {}, "holds several AOT plans"),
    ("aot", {"max_batch_size": 32}, r"--max-batch-size 32 exceeds the plan's optimisation profile \(batch <= 16\)"),
    ("aot", {"kind": "cpu"}, "TensorRT plans run on the GPU"),
])
def test_tensorrt_repository_refusals(store, tmp_path, setup: str, options: dict, message: str) -> None:
    artifact = store.block("moe").path
    if setup in ("jit", "aot", "two"):
        artifact = fake_plan(store.block("moe"), tmp_path, aot=setup != "jit")
    if setup == "two":
        fake_plan(store.block("moe"), tmp_path, aot=True, name="nvidia-a100_trt10.13_fp32_aot")
    with pytest.raises(ServingError, match=message):
        write_repository(artifact, tmp_path / "repo", RepositoryOptions(backend="tensorrt", **options))
    assert not (tmp_path / "repo" / "moe").exists()


def test_a_plan_not_built_from_this_artifact_is_refused(store, tmp_path) -> None:
    """A plan was taken on its file name: one from another artifact (by --engine), one with no
    build record, or model.onnx itself was deployed as this artifact's plan, exit 0."""
    import shutil

    artifact = fake_plan(store.block("moe"), tmp_path, aot=True)
    other = fake_plan(store.block("rmsnorm"), tmp_path / "other", aot=True)
    foreign = next((other / "engines").glob("*.plan"))
    with pytest.raises(ServingError, match=r"was not built from .* as it is now: its build record names another "
                                           r"manifest, sha256 [0-9a-f]{12}\.\.\., where this artifact's is"):
        write_repository(artifact, tmp_path / "repo", RepositoryOptions(backend="tensorrt", engine=foreign))
    # a stale plan beside a fresh one (an old JIT plan whose record predates the seal) is left out
    # of the choice, not a reason to refuse the fresh one
    stale = artifact / "engines" / "nvidia-h100_trt10.13_fp32_jit"
    stale.with_suffix(".plan").write_bytes(b"old")
    stale.with_suffix(".json").write_text(json.dumps({"dtype": "fp32", "aot": False}))
    result = write_repository(artifact, tmp_path / "fresh", RepositoryOptions(backend="tensorrt"))
    assert result.model_file.read_bytes() == b"placeholder, not a TensorRT plan"
    with pytest.raises(ServingError, match=r"its build record, from before plans recorded their artifact, cannot say"):
        write_repository(artifact, tmp_path / "repo", RepositoryOptions(backend="tensorrt",
                                                                        engine=stale.with_suffix(".plan")))
    with pytest.raises(ServingError, match=r"model\.onnx is not a TensorRT plan \(\.plan\); build one with"):
        write_repository(artifact, tmp_path / "repo", RepositoryOptions(backend="tensorrt", engine=artifact / "model.onnx"))
    for record in (artifact / "engines").glob("*.json"):
        record.unlink()
    with pytest.raises(ServingError, match=r"has no build record \(nvidia-h100_trt10\.13_fp32_aot\.json\) beside it"):
        write_repository(artifact, tmp_path / "repo", RepositoryOptions(backend="tensorrt"))
    assert not (tmp_path / "repo").exists()
    shutil.rmtree(other)


def test_plugin_libraries_of_one_name_or_not_shared_libraries_are_refused(store, tmp_path) -> None:
    """Two libraries named alike were copied to one plugins/<name> (the second kept, exit 0); a
    text file was copied as a plugin library."""
    artifact = fake_plan(store.block("moe"), tmp_path, aot=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    libs = [tmp_path / "a" / "libp.so", tmp_path / "b" / "libp.so"]
    for lib in libs:
        lib.write_bytes(ELF_PLACEHOLDER)
    with pytest.raises(ServingError, match=r"plugin libraries .*a/libp\.so and .*b/libp\.so have the same file name"):
        write_repository(artifact, tmp_path / "repo", RepositoryOptions(backend="tensorrt", plugin_libs=libs))
    with pytest.raises(ServingError, match=r"plugin library .*a/libp\.so is named twice in --plugin-lib; name it once"):
        write_repository(artifact, tmp_path / "repo", RepositoryOptions(backend="tensorrt", plugin_libs=[libs[0]] * 2))
    text = tmp_path / "notes.txt"
    text.write_text("not a library")
    with pytest.raises(ServingError, match=r"notes\.txt is not a shared library \(no ELF header\)"):
        write_repository(artifact, tmp_path / "repo", RepositoryOptions(backend="tensorrt", plugin_libs=[text]))
    assert not (tmp_path / "repo").exists()


def test_an_engine_for_the_onnxruntime_backend_is_refused_not_ignored(store, tmp_path) -> None:
    """--engine without --backend tensorrt wrote model.onnx and said nothing of the plan asked for."""
    artifact = fake_plan(store.block("moe"), tmp_path, aot=True)
    plan = next((artifact / "engines").glob("*.plan"))
    with pytest.raises(ServingError, match=r"--engine picks a TensorRT plan; the onnxruntime backend serves model\.onnx"):
        write_repository(artifact, tmp_path / "repo", RepositoryOptions(engine=plan))
    assert not (tmp_path / "repo" / "moe").exists()


def test_unknown_backend_is_refused(store, tmp_path) -> None:
    with pytest.raises(ServingError, match="unknown backend 'triton'; choose from: onnxruntime, tensorrt"):
        write_repository(store.block("moe"), tmp_path / "repo", RepositoryOptions(backend="triton"))


def test_bf16_repository_for_tensorrt_keeps_bf16(store) -> None:
    """Triton has TYPE_BF16 even though NumPy (and so PyTriton) has no bfloat16."""
    from moedeploy.serving.repository import config_text
    from moedeploy.serving.specs import graph_model

    text = config_text(graph_model(store.block("rmsnorm", "bf16")), "tensorrt", RepositoryOptions(), "KIND_GPU", "model.plan")
    config = text_format.Parse(text, pb.ModelConfig())
    assert dtype_name(config.input[0].data_type) == "TYPE_BF16"


# --- nothing outside the artifact and the repository: names, symlinks, unlisted files ---------


def _copy(artifact, dest):
    import shutil

    shutil.copytree(artifact.path, dest, ignore=shutil.ignore_patterns("cache", "report"))
    return dest


def _edit_manifest(folder, **fields) -> None:
    """Sealed again: these tests are of the fields' own checks (tests/export/test_manifest_seal.py is of the seal)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.update(fields)
    rewrite_manifest(folder, manifest)


def test_a_name_that_climbs_out_of_the_repository_is_refused(store, tmp_path) -> None:
    """Before, the name `../../escaped_model` wrote <out>/../../escaped_model."""
    from moedeploy.export.artifact import ArtifactError

    folder = _copy(store.block("moe"), tmp_path / "a" / "b" / "artifact")
    _edit_manifest(folder, name="../../escaped_model")
    out = tmp_path / "a" / "b" / "repo"
    with pytest.raises(ArtifactError, match="is not a valid model name"):
        write_repository(folder, out)
    assert not [p for p in tmp_path.rglob("escaped_model*")]
    assert not out.exists()


def test_a_hand_built_artifact_with_such_a_name_is_refused_too(store, tmp_path) -> None:
    """An Artifact made without Artifact.load (the API allows it) meets the same check."""
    from moedeploy.export.artifact import Artifact

    loaded = store.block("moe")
    forged = Artifact(loaded.path, {**loaded.manifest, "name": "../escaped_model"})
    with pytest.raises(ServingError, match="is not a valid model name"):
        write_repository(forged, tmp_path / "repo" / "inner")
    assert not (tmp_path / "repo" / "escaped_model").exists()


def test_a_model_that_links_out_of_the_artifact_is_not_copied(store, tmp_path) -> None:
    """Before, triton-repo copied whatever model.onnx pointed to (even /etc/passwd)."""
    from moedeploy.export.artifact import ArtifactError

    folder = _copy(store.block("moe"), tmp_path / "artifact")
    outside = tmp_path / "secret.onnx"
    (folder / "model.onnx").rename(outside)
    (folder / "model.onnx").symlink_to(outside)
    with pytest.raises(ArtifactError, match="outside the artifact"):
        write_repository(folder, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


def test_only_the_model_files_the_manifest_hashed_are_copied(store, tmp_path) -> None:
    """A stray model.onnx.data that the manifest does not list is not shipped."""
    folder = _copy(store.block("moe"), tmp_path / "artifact")
    (folder / "model.onnx.data").write_bytes(b"not listed, not hashed")
    result = write_repository(folder, tmp_path / "repo")
    assert sorted(p.name for p in (result.model_dir / "1").iterdir()) == ["model.onnx"]
    assert sha256(result.model_file) == store.block("moe").manifest["files"]["model.onnx"]


def test_a_plan_that_links_out_of_the_artifact_is_refused(store, tmp_path) -> None:
    artifact = fake_plan(store.block("moe"), tmp_path, aot=True)
    plan = next((artifact / "engines").glob("*.plan"))
    outside = tmp_path / "elsewhere.plan"
    plan.rename(outside)
    plan.symlink_to(outside)
    with pytest.raises(ServingError, match="outside the artifact"):
        write_repository(artifact, tmp_path / "repo", RepositoryOptions(backend="tensorrt"))
    assert not (tmp_path / "repo").exists()
