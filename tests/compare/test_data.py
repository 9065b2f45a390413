"""The seeded data loader (dynamic ranges, determinism) and tolerance resolution."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moedeploy.compare.api import compare, resolve_tolerances
from moedeploy.compare.data import ArtifactDataLoader
from moedeploy.export.artifact import Artifact
from moedeploy.models import DecoderConfig
from tests.compare.helpers import fresh_copy
from tests.export.artifacts import rewrite_manifest

# Per design: blocks are judged at (1e-5, 1e-5) in fp32 and (1e-2, 1e-2) in fp16, the
# decoder at (1e-4, 1e-4) in fp32.
BLOCK_FP32 = (1e-5, 1e-5)
BLOCK_FP16 = (1e-2, 1e-2)
DECODER_FP32 = (1e-4, 1e-4)


def symbolic_sizes(artifact: Artifact, feed: dict[str, np.ndarray]) -> dict[str, int]:
    """The size each symbolic dim takes in `feed`; asserts static dims and consistency."""
    sizes: dict[str, int] = {}
    for spec in artifact.manifest["inputs"]:
        shape = feed[spec["name"]].shape
        assert len(shape) == len(spec["shape"]), spec["name"]
        for dim, size in zip(spec["shape"], shape, strict=True):
            if isinstance(dim, int):
                assert size == dim, (spec["name"], dim, size)
            else:
                assert sizes.setdefault(dim, size) == size, f"{dim} differs between inputs"
    return sizes


@pytest.fixture(scope="module", params=["decoder", "moe"])
def artifact(request, artifacts) -> Artifact:
    return artifacts.decoder() if request.param == "decoder" else artifacts.block(request.param)


def test_feeds_have_the_artifacts_inputs_and_dtypes(artifact):
    feed = ArtifactDataLoader(artifact, 3, seed=0)[0]  # opt sizes: big enough for moments
    assert list(feed) == [i["name"] for i in artifact.manifest["inputs"]]
    for spec in artifact.manifest["inputs"]:
        value = feed[spec["name"]]
        assert value.dtype == np.dtype(spec["dtype"])
        if value.dtype.kind == "f":  # standard normal values, not zeros or garbage
            assert np.isfinite(value).all()
            assert 0.8 < value.std() < 1.2 and abs(value.mean()) < 0.2


def test_iteration_zero_uses_every_dims_opt(artifact):
    ranges = artifact.manifest["dynamic_ranges"]
    sizes = symbolic_sizes(artifact, ArtifactDataLoader(artifact, 2, seed=5)[0])
    assert sizes == {name: r["opt"] for name, r in ranges.items() if name in sizes}
    assert set(sizes) == set(ranges)  # every dynamic dim is exercised


def test_every_dim_stays_within_its_range(artifact):
    ranges = artifact.manifest["dynamic_ranges"]
    seen: dict[str, set[int]] = {name: set() for name in ranges}
    for seed in range(4):
        loader = ArtifactDataLoader(artifact, 6, seed)
        assert len(loader) == 6 and len(list(loader)) == 6
        for feed in loader:
            for name, size in symbolic_sizes(artifact, feed).items():
                assert ranges[name]["min"] <= size <= ranges[name]["max"], (name, size, ranges[name])
                seen[name].add(size)
    for name, sizes in seen.items():
        assert len(sizes) > 2, f"{name} hardly varies: {sizes}"  # later iterations really draw sizes


def test_token_ids_lie_in_the_vocabulary(artifacts):
    artifact = artifacts.decoder()
    vocab = artifact.manifest["config"]["vocab_size"]
    ids = np.concatenate([f["input_ids"].ravel() for f in ArtifactDataLoader(artifact, 4, 0)])
    assert ids.min() >= 0 and ids.max() < vocab
    assert len(np.unique(ids)) > vocab // 2


def test_deterministic_for_a_seed_and_different_for_another(artifact):
    a = list(ArtifactDataLoader(artifact, 3, seed=11))
    b = list(ArtifactDataLoader(artifact, 3, seed=11))
    c = list(ArtifactDataLoader(artifact, 3, seed=12))
    for fa, fb in zip(a, b, strict=True):
        assert fa.keys() == fb.keys()
        for name in fa:
            np.testing.assert_array_equal(fa[name], fb[name])
    # iteration 0 has the same (opt) shapes for both seeds but other values
    for name in a[0]:
        assert a[0][name].shape == c[0][name].shape
    assert any(not np.array_equal(a[0][n], c[0][n]) for n in a[0])
    assert any(
        fa[n].shape != fc[n].shape or not np.array_equal(fa[n], fc[n])
        for fa, fc in zip(a[1:], c[1:], strict=True)
        for n in fa
    )


def test_loader_rejects_bad_iterations(artifacts):
    artifact = artifacts.block("moe")
    with pytest.raises(ValueError, match="iterations"):
        ArtifactDataLoader(artifact, 0)
    loader = ArtifactDataLoader(artifact, 2)
    with pytest.raises(IndexError):
        loader[2]


SHORT_CONFIG = DecoderConfig(
    vocab_size=64, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, n_experts=2, top_k=1,
    expert_hidden=32, max_positions=64, rope_theta=10000.0,
)


def test_decoder_feeds_fit_the_position_table(artifacts):
    artifact = artifacts.checkpoint_decoder("short-decoder", SHORT_CONFIG)
    limit = artifact.manifest["config"]["max_positions"]
    for seed in range(3):
        for feed in ArtifactDataLoader(artifact, 4, seed):
            sizes = symbolic_sizes(artifact, feed)
            assert sizes["past_seq"] + sizes["seq"] <= limit, (seed, sizes)


def test_compare_a_decoder_with_a_short_position_table(artifacts, tmp_path):
    artifact = artifacts.checkpoint_decoder("short-decoder", SHORT_CONFIG)
    report = compare(fresh_copy(artifact, tmp_path / "short"))
    assert report["passed"] is True


# --- tolerances -------------------------------------------------------------------------


def _tolerances(report: dict) -> dict[str, tuple[float, float]]:
    (comparison,) = report["comparisons"]
    return {name: (s["atol"], s["rtol"]) for name, s in comparison["outputs"].items()}


def test_manifest_tolerances_are_the_default(compared_decoder):
    decoder, report = compared_decoder
    manifest = json.loads((decoder / "manifest.json").read_text())
    declared = {name: (t["atol"], t["rtol"]) for name, t in manifest["tolerances"].items()}
    assert set(declared) == {o["name"] for o in manifest["outputs"]}
    assert set(declared.values()) == {DECODER_FP32}
    assert _tolerances(report) == declared
    on_disk = json.loads((decoder / "report" / "report.json").read_text())
    assert _tolerances(on_disk) == declared


@pytest.mark.parametrize(("dtype", "expected"), [("fp32", BLOCK_FP32), ("fp16", BLOCK_FP16)])
def test_block_tolerances_by_dtype(artifacts, tmp_path, dtype, expected):
    block = fresh_copy(artifacts.block("rmsnorm", dtype), tmp_path / "rmsnorm")
    report = compare(block, iterations=2)
    assert _tolerances(report) == {"y": expected}
    assert report["passed"] is True
    # without tolerances in the manifest, the dtype's default applies
    manifest_file = block / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    del manifest["tolerances"]
    rewrite_manifest(block, manifest)
    assert resolve_tolerances(Artifact.load(block), None, None) == {"y": expected}


def test_atol_and_rtol_override_the_manifest(artifacts, tmp_path):
    block = fresh_copy(artifacts.block("moe"), tmp_path / "moe")
    assert compare(block, iterations=1)["passed"] is True
    assert _tolerances(compare(block, atol=0.5, iterations=1)) == {"y": (0.5, BLOCK_FP32[1])}
    assert _tolerances(compare(block, rtol=0.25, iterations=1)) == {"y": (BLOCK_FP32[0], 0.25)}
    on_disk = json.loads((block / "report" / "report.json").read_text())
    assert _tolerances(on_disk) == {"y": (BLOCK_FP32[0], 0.25)}


def test_zero_tolerance_fails_because_onnx_runtime_is_not_bit_exact(artifacts, tmp_path):
    from polygraphy.comparator import RunResults

    folder = fresh_copy(artifacts.decoder(), tmp_path / "decoder")
    report = compare(folder, atol=0.0, rtol=0.0, iterations=2)
    assert report["passed"] is False
    outputs = report["comparisons"][0]["outputs"]
    assert any(not s["passed"] for s in outputs.values())
    # cross-check with the raw results: exactly the outputs with some nonzero difference fail
    results = RunResults.load(str(folder / "report" / "run_results.json"))
    for output, stats in outputs.items():
        differs = any(
            not np.array_equal(e[output], o[output])
            for e, o in zip(results["torch-eager"], results["onnxrt"], strict=True)
        )
        assert stats["passed"] is (not differs), output


@pytest.mark.parametrize("tolerance", [{"atol": -1e-3}, {"atol": float("nan")}, {"rtol": float("inf")}])
def test_negative_or_not_finite_tolerances_are_rejected(artifacts, tolerance):
    """NaN would fail every output, infinity pass any: neither is a tolerance."""
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        compare(artifacts.block("moe"), **tolerance)
