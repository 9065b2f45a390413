"""The artifact directory: everything downstream of export reads this, never a live nn.Module.

    <artifact>/model.onnx        (+ model.onnx.data when the weights pass 2 GB)
    <artifact>/manifest.json     what the graph is, its I/O, dynamic ranges, sha256 of every file
    <artifact>/golden/inputs.json    Polygraphy JSON: a list of feed dicts
    <artifact>/golden/outputs.json   Polygraphy RunResults of eager PyTorch on those inputs
    <artifact>/reference.safetensors the eager weights of a block (decoders are rebuilt instead)

An artifact is only as safe as its manifest: `Artifact.load` checks the manifest against the
schema below before any command trusts a field of it, and refuses files that are not listed,
not hashed, or that lie outside the folder (a `..` path, an absolute path, a symlink out).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import onnx
import torch
from onnx.external_data_helper import _get_all_tensors, uses_external_data

from moedeploy import names
from moedeploy.export.tokenizer_files import tokenizer_problems
from moedeploy.models.config import DecoderConfig
from moedeploy.names import MANIFEST

#: model.onnx's metadata key for the sha256 of the manifest's "quantization" section (section_digest)
QUANTIZATION_DIGEST_KEY = "moedeploy.quantization_sha256"
#: the manifest's own key for the sha256 of everything else in it (`sealed`, `seal_problem`)
MANIFEST_DIGEST_KEY = "manifest_sha256"
#: what moedeploy's commands write into an artifact beside its listed files (compare's report/,
#: ONNX Runtime's lowered-session cache/, TensorRT's engines/); a test holds these to their modules
DERIVED_DIRS = ("report", "cache", "engines")
REPORT_DIR = DERIVED_DIRS[0]
#: everything compare writes into report/, which it replaces whole (compare/api.py): anything
#: else there is the user's, kept by compare and by a re-export alike
REPORT_FILES = ("run_results.json", "accuracy.json", "report.json", "report.md", "report.html")


def report_strangers(folder: Path) -> list[str]:
    """The names in a report/ folder that compare did not write (compare and export keep them)."""
    return [e.name for e in sorted(folder.iterdir()) if e.name not in REPORT_FILES]


MODEL_FILE = "model.onnx"
MODEL_DATA_FILE = MODEL_FILE + ".data"
GOLDEN_INPUTS = "golden/inputs.json"
GOLDEN_OUTPUTS = "golden/outputs.json"
EAGER_RUNNER = "torch-eager"
SCHEMA_VERSION = 1
EXTERNAL_DATA_THRESHOLD = 1_800_000_000  # protobuf's hard limit is 2 GiB

KINDS = ("block", "decoder")
#: Triton model names become folder names: no separators, no `..`, nothing that needs quoting
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
DIM_NAME = re.compile(r"\w+")
INT32_END = 2**31  # TensorRT profiles and Triton dims are int32

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
names.check_same_names("dtypes", DTYPES, names.DTYPES)
#: NumPy element type of an artifact's float tensors (NumPy has no bfloat16: bf16 travels as fp32)
NP_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": np.float32}


class ArtifactError(ValueError):
    """A folder that is not a valid artifact; the message says what is wrong."""


def parse_dtype(name: str) -> torch.dtype:
    if problem := names.dtype_problem(name):
        raise ValueError(problem)
    return DTYPES[name]


def quiet_polygraphy() -> None:
    """Polygraphy logs every save/load at INFO to stdout; keep our output clean."""
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """NumPy has no bfloat16: bf16 tensors are stored as the fp32 values they exactly equal."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


#: a model.onnx with its weights inline (a block's) is parsed on every verified load to hold the
#: manifest's I/O to the graph's only up to this size (a large one is checked by its sha256 alone)
INLINE_GRAPH_CHECKED_BYTES = 64 * 2**20


def io_spec(values: Any) -> list[dict[str, Any]]:
    """[{name, dtype, shape}] of ONNX graph inputs/outputs, symbolic dims as their names."""
    spec = []
    for v in values:
        tt = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else d.dim_value for d in tt.shape.dim]
        spec.append({
            "name": v.name,
            "dtype": onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name
            if tt.elem_type != onnx.TensorProto.BFLOAT16 else "bfloat16",
            "shape": dims,
        })
    return spec


def save_model(model: onnx.ModelProto, folder: Path) -> list[str]:
    """Write model.onnx (external data past ~2 GB); returns the files written."""
    if model.ByteSize() > EXTERNAL_DATA_THRESHOLD:
        onnx.save_model(
            model, str(folder / MODEL_FILE), save_as_external_data=True,
            all_tensors_to_one_file=True, location=MODEL_DATA_FILE,
        )
        return [MODEL_FILE, MODEL_DATA_FILE]
    onnx.save_model(model, str(folder / MODEL_FILE))
    return [MODEL_FILE]


def save_golden(
    folder: Path, feeds: list[dict[str, np.ndarray]], outputs: list[dict[str, np.ndarray]] | None
) -> list[str]:
    """Golden inputs, and eager PyTorch's outputs on them unless `outputs` is None (--no-golden)."""
    from polygraphy.comparator import RunResults
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.json import save_json

    quiet_polygraphy()
    (folder / "golden").mkdir(exist_ok=True)
    save_json(feeds, str(folder / GOLDEN_INPUTS))
    if outputs is None:
        return [GOLDEN_INPUTS]
    results = RunResults()
    results.append((EAGER_RUNNER, [IterationResult(o, runtime=0.0, runner_name=EAGER_RUNNER) for o in outputs]))
    results.save(str(folder / GOLDEN_OUTPUTS))
    return [GOLDEN_INPUTS, GOLDEN_OUTPUTS]


# --- the manifest's schema -----------------------------------------------------------------
# Each check yields the problems it finds; the caller takes the first one, so a check may
# assume every check before it passed (a later one never runs on a malformed field).

Problems = Iterator[str]


def first_manifest_problem(manifest: Any) -> str | None:
    """The first way `manifest` breaks the schema an exporter writes, or None when it is valid."""
    return next(_manifest_problems(manifest), None)


def model_name_problem(name: Any) -> str | None:
    """Why `name` cannot be a Triton model name (it becomes a folder of the model repository)."""
    if not isinstance(name, str) or not MODEL_NAME.fullmatch(name) or ".." in name:
        return f"name {name!r} is not a valid model name (letters, digits, '_', '.', '-'; no '..')"
    return None


def is_relative_inside(rel: Any) -> bool:
    """A plain relative POSIX path that cannot climb out of the folder it is relative to."""
    if not isinstance(rel, str) or not rel or "\\" in rel:
        return False
    path = PurePosixPath(rel)
    return not path.is_absolute() and ".." not in path.parts and path.parts != ()


def _manifest_problems(m: Any) -> Problems:
    if not isinstance(m, dict):
        yield f"holds a JSON {type(m).__name__}, not an object"
        return
    if m.get("schema_version") != SCHEMA_VERSION:
        yield f"schema_version is {_shown(m, 'schema_version')}; this moedeploy reads version {SCHEMA_VERSION}"
    yield from _choice_problems(m, "kind", KINDS)
    yield from _choice_problems(m, "dtype", tuple(DTYPES))
    if problem := model_name_problem(m.get("name")):
        yield problem
    for key in ("opset", "seed"):
        if not _is_int(m.get(key)):
            yield f"{key} is {_shown(m, key)}, not an integer"
    yield from _custom_ops_problems(m.get("custom_ops"))
    for key in ("inputs", "outputs"):
        yield from _io_problems(key, m.get(key))
    yield from _range_problems(m.get("dynamic_ranges"), m["inputs"])
    yield from _tolerance_problems(m.get("tolerances", {}))
    yield from _config_problems(m["kind"], m.get("config"))
    if not isinstance(m.get("golden_outputs", True), bool):
        yield f"golden_outputs is {_shown(m, 'golden_outputs')}, not true or false"
    yield from _files_problems(m["kind"], m.get("files"), m.get("golden_outputs", True))
    yield from tokenizer_problems(m.get("tokenizer"), m.get("files"))
    if "quantization" in m:
        yield from _quantization_problems(m["quantization"])


def _quantization_problems(q: Any) -> Problems:
    """The section export/quantize.manifest_section writes: its shape and values, so a reader
    never meets a missing key or a format no exporter makes."""
    if not isinstance(q, dict):
        yield f"quantization is {q!r}, not an object"
        return
    for key, ok, what in [("bits", lambda v: v in (4, 8) and _is_int(v), "4 or 8"),
                          ("block_size", lambda v: _is_int(v) and v >= 16 and not v & (v - 1), "a power of two >= 16"),
                          ("symmetric", lambda v: isinstance(v, bool), "true or false"),
                          ("mixed", lambda v: isinstance(v, bool) or v is None, "true or false"),
                          ("tensors", lambda v: isinstance(v, dict) and v, "an object of tensor names to bits")]:
        if not ok(q.get(key)):
            yield f"quantization.{key} is {_shown(q, key)}, not {what}"
            return
    if q.get("mixed") and q["bits"] != 4:
        yield "quantization.mixed is true, but only int4 exports are mixed"
    for name, bits in q["tensors"].items():
        if bits not in (4, 8) or not _is_int(bits):
            yield f"quantization.tensors[{name!r}] is {bits!r}, not 4 or 8"
    blocks = q.get("block_sizes", {})
    if not isinstance(blocks, dict):
        yield f"quantization.block_sizes is {blocks!r}, not an object of tensor names to block sizes"
        return
    for name, block in blocks.items():
        if name not in q["tensors"]:
            yield f"quantization.block_sizes names {name!r}, which quantization.tensors does not list"
        elif not _is_int(block) or block < 16 or block & (block - 1):
            yield f"quantization.block_sizes[{name!r}] is {block!r}, not a power of two >= 16"


#: DequantizeLinear codes' ONNX type -> (bits, symmetric: signed codes, no zero point)
CODE_FORMATS = {onnx.TensorProto.INT8: (8, True), onnx.TensorProto.UINT8: (8, False),
                onnx.TensorProto.INT4: (4, True), onnx.TensorProto.UINT4: (4, False)}


def graph_formats(model: onnx.ModelProto) -> set[tuple[int, int, bool]]:
    """The (bits, block size, symmetric) formats a graph's DequantizeLinear nodes read their
    weight codes in (only quantized exports have any)."""
    types = {t.name: t.data_type for t in model.graph.initializer}
    formats = set()
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input and types.get(node.input[0]) in CODE_FORMATS:
            bits, symmetric = CODE_FORMATS[types[node.input[0]]]
            formats.add((bits, next((a.i for a in node.attribute if a.name == "block_size"), 0), symmetric))
    return formats


def manifest_formats_listed(q: dict | None) -> set[tuple[int, int, bool]]:
    """The (bits, block size, symmetric) formats a (schema-checked) quantization section lists."""
    if not q:
        return set()
    blocks = q.get("block_sizes") or {}
    return {(bits, blocks.get(name, q["block_size"]), q["symmetric"]) for name, bits in q["tensors"].items()}


def _formats_text(formats: set[tuple[int, int, bool]]) -> str:
    return ", ".join(f"int{b} in blocks of {k}{'' if sym else ' (asymmetric)'}" for b, k, sym in sorted(formats)) \
        or "no quantized weight"


def section_digest(section: Any) -> str:
    """sha256 of a manifest section as canonical JSON: model.onnx records the quantization
    section's under QUANTIZATION_DIGEST_KEY, so an edit to it (which the files' hashes, kept in
    the manifest itself, cannot catch) is refused at load instead of silently changing what the
    eager reference, the roofline and bench's cache read."""
    return hashlib.sha256(json.dumps(section, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


#: the names ONNX Runtime's lowered-graph cache (runtime/ort.cache_name: ort_<provider>_<lowering>_<key>
#: and its .onnx, .onnx.data, .json), `moedeploy tune`'s record (runtime/moe_tuning.TUNED_FILE) and
#: TensorRT's plans (runtime/tensorrt.engine_name and the plan's .log and .json) take in cache/ and
#: engines/; a test holds them to those functions
DERIVED_FILES = {
    "cache": re.compile(r"ort_[a-z0-9]+_[a-z]+_[0-9a-f]{16}\.(onnx|onnx\.data|json)|moe_path\.json"),
    "engines": re.compile(r"[a-z0-9-]+_trt[\w.+-]+_(fp32|fp16|bf16)_(aot|jit)\.(plan|log|json)"),
}


def derived_strangers(folder: Path) -> list[str]:
    """The names in an artifact's cache/ or engines/ that its commands did not write: anything
    not named as they name their files, and anything not a plain file (export keeps them)."""
    pattern = DERIVED_FILES[folder.name]
    return [e.name for e in sorted(folder.iterdir())
            if e.is_symlink() or not e.is_file() or not pattern.fullmatch(e.name)]


def sealed(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with the digest of the rest of it under MANIFEST_DIGEST_KEY, as export writes it.

    The files' hashes live in the manifest, so nothing covered the manifest itself: tolerances
    raised by hand to 1e9 made compare PASS anything, and a shortened outputs list paired the
    wrong tensors. The digest is not a signature (whoever edits the file can recompute it); it
    makes an edit by hand, or by a tool that does not know the artifact, refused at load instead
    of trusted. compare's --atol/--rtol are the way to judge with other tolerances.
    """
    body = {k: v for k, v in manifest.items() if k != MANIFEST_DIGEST_KEY}
    return {**body, MANIFEST_DIGEST_KEY: section_digest(body)}


def seal_problem(manifest: dict[str, Any]) -> str | None:
    """Why the manifest's contents are not what export sealed, or None. A manifest without the seal
    is refused too: taking it as one from before the seal would let deleting the key undo it."""
    if MANIFEST_DIGEST_KEY not in manifest:
        return (f"has no {MANIFEST_DIGEST_KEY}: it was edited, or written by a moedeploy from before manifests "
                "were sealed, so its tolerances, inputs and outputs cannot be trusted; re-export the artifact")
    if sealed(manifest)[MANIFEST_DIGEST_KEY] != manifest[MANIFEST_DIGEST_KEY]:
        return (f"was edited after export (its {MANIFEST_DIGEST_KEY} does not match its contents), so its "
                "tolerances, inputs and outputs cannot be trusted; re-export the artifact")
    return None


def _shown(m: dict[str, Any], key: str) -> str:
    return repr(m[key]) if key in m else "missing"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _choice_problems(m: dict[str, Any], key: str, choices: tuple[str, ...]) -> Problems:
    if m.get(key) not in choices:
        yield f"{key} is {_shown(m, key)}, not one of {', '.join(choices)}"


def _custom_ops_problems(ops: Any) -> Problems:
    if not isinstance(ops, list):
        yield "custom_ops is not a list"
        return
    for op in ops:
        if not (isinstance(op, dict) and all(isinstance(op.get(k), str) for k in ("domain", "op_type"))
                and _is_int(op.get("count"))):
            yield f"custom_ops entry {op!r} needs a domain, an op_type and a count"


def _io_problems(key: str, specs: Any) -> Problems:
    """A non-empty list of {name, dtype, shape}: what ONNX Runtime, TensorRT and Triton are fed."""
    if not isinstance(specs, list) or not specs:
        yield f"{key} is not a non-empty list"
        return
    for spec in specs:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            yield f"{key} entry {spec!r} has no name"
        elif not _is_dtype_name(spec.get("dtype")):
            yield f"{key} {spec['name']!r} has dtype {spec.get('dtype')!r}, not a NumPy dtype name"
        elif not isinstance(spec.get("shape"), list) or not all(_is_dim(d) for d in spec["shape"]):
            yield f"{key} {spec['name']!r} has shape {spec.get('shape')!r}; dims are names or ints in [0, 2**31)"
    names = [spec["name"] for spec in specs]
    if len(set(names)) != len(names):
        yield f"{key} repeats a name: {names}"


def _is_dtype_name(name: Any) -> bool:
    if name == "bfloat16":  # NumPy has none; io_spec writes ONNX's name
        return True
    try:
        return isinstance(name, str) and np.dtype(name).name == name
    except TypeError:
        return False


def _is_dim(dim: Any) -> bool:
    return (isinstance(dim, str) and bool(dim)) or (_is_int(dim) and 0 <= dim < INT32_END)


def _range_problems(ranges: Any, inputs: list[dict[str, Any]]) -> Problems:
    """min <= opt <= max, all int32: they become TensorRT profiles and random input sizes."""
    if not isinstance(ranges, dict):
        yield "dynamic_ranges is not an object"
        return
    for dim, r in ranges.items():
        values = [r.get(k) for k in ("min", "opt", "max")] if isinstance(r, dict) else []
        if not (len(values) == 3 and all(_is_int(v) for v in values) and 0 <= values[0] <= values[1] <= values[2] < INT32_END):
            yield f"dynamic_ranges {dim!r} is {r!r}; it needs integers 0 <= min <= opt <= max < 2**31"
    for spec in inputs:
        for d in spec["shape"]:
            if isinstance(d, str) and DIM_NAME.fullmatch(d) and d not in ranges:
                yield f"input {spec['name']!r} has dim {d!r} with no entry in dynamic_ranges"


def _tolerance_problems(tolerances: Any) -> Problems:
    if not isinstance(tolerances, dict):
        yield "tolerances is not an object"
        return
    for name, t in tolerances.items():
        values = [t.get(k, 0.0) for k in ("atol", "rtol")] if isinstance(t, dict) else [None]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in values):
            yield f"tolerances {name!r} is {t!r}; atol and rtol are finite numbers >= 0"


def _config_problems(kind: str, config: Any) -> Problems:
    """What rebuilding the eager reference reads: the block's name, or every decoder field."""
    if not isinstance(config, dict):
        yield "config is not an object"
    elif kind == "block":
        if not isinstance(config.get("block"), str):
            yield "config.block (the block's name) is missing"
    else:
        yield from _decoder_config_problems(config)


def _decoder_config_problems(config: dict[str, Any]) -> Problems:
    names = [f.name for f in fields(DecoderConfig)]
    missing = [n for n in names if n not in config]
    if missing:
        yield f"config lacks the decoder fields {', '.join(missing)}"
        return
    if not isinstance(config.get("source", {}), dict):
        yield "config.source is not an object"
    not_ints = [f.name for f in fields(DecoderConfig) if f.type == "int" and not _is_int(config[f.name])]
    if not_ints:
        yield f"config fields {', '.join(not_ints)} are not integers"
    try:
        DecoderConfig(**{n: config[n] for n in names})
    except (TypeError, ValueError) as e:
        yield f"config is not a valid decoder configuration ({e})"


def _files_problems(kind: str, files: Any, golden_outputs: bool = True) -> Problems:
    """Every file the artifact needs is listed with a sha256, and lies inside the folder."""
    if not isinstance(files, dict):
        yield "files is not an object of {relative path: sha256}"
        return
    for rel, digest in files.items():
        if not is_relative_inside(rel):
            yield f"files entry {rel!r} is not a relative path inside the artifact folder"
        elif not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
            yield f"files entry {rel!r} has {digest!r}, not a sha256 hex digest"
    for rel in required_files(kind, golden_outputs):
        if rel not in files:
            yield f"files does not list {rel}, so nothing checks it"


def required_files(kind: str, golden_outputs: bool = True) -> tuple[str, ...]:
    """The files every artifact of `kind` has (model.onnx.data only when the graph uses it;
    golden outputs unless the export was told not to run the eager model, `--no-golden`)."""
    from moedeploy.export.reference import REFERENCE_FILE  # reference.py imports this module

    common = (MODEL_FILE, GOLDEN_INPUTS, *([GOLDEN_OUTPUTS] if golden_outputs else []))
    return (*common, REFERENCE_FILE) if kind == "block" else common


def _external_data_problems(model: onnx.ModelProto, files: dict[str, str]) -> Problems:
    """The tensors model.onnx keeps outside itself must be in model.onnx.data, listed and hashed."""
    for tensor in _get_all_tensors(model):  # the tensors onnx.load itself would resolve (private, but its own)
        if uses_external_data(tensor):
            location = {e.key: e.value for e in tensor.external_data}.get("location", "")
            if not is_relative_inside(location):
                yield f"{MODEL_FILE} reads tensor {tensor.name!r} from {location!r}, outside the artifact folder"
            elif PurePosixPath(location).as_posix() != MODEL_DATA_FILE:
                yield f"{MODEL_FILE} reads tensor {tensor.name!r} from {location!r}; exports keep it in {MODEL_DATA_FILE}"
            elif MODEL_DATA_FILE not in files:
                yield f"{MODEL_FILE} uses {MODEL_DATA_FILE}, which files does not list, so nothing checks it"


# --- the artifact folder ------------------------------------------------------------------


def _mentions(path: Path, needle: bytes) -> bool:
    """Whether the file's bytes contain `needle` (memory-mapped: no copy of a large file)."""
    if path.stat().st_size == 0:
        return False
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(needle) >= 0


def _real_path(path: Path) -> Path:
    """Every symlink resolved; unlike Path.resolve, a symlink loop is no exception (it is then
    simply not a file)."""
    return Path(os.path.realpath(path))


@dataclass
class Artifact:
    """A loaded artifact folder: its manifest and where its files are."""

    path: Path
    manifest: dict[str, Any]

    @classmethod
    def load(cls, path: str | Path, verify: bool = True) -> Artifact:
        """Read and validate the manifest; with `verify`, check every file's sha256 too.

        The schema and the files' places are always checked (cheap); hashing reads every
        byte, which a worker process re-opening an artifact its parent verified may skip.
        """
        path = Path(path)
        if problem := names.artifact_folder_problem(path):
            raise ArtifactError(problem)
        manifest_file = path / MANIFEST
        artifact = cls(path, {})
        artifact.check_inside(MANIFEST)
        try:
            manifest = json.loads(manifest_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ArtifactError(f"{manifest_file} is not readable JSON: {e}") from None
        # first: an edit is named as one, not as whatever field it made invalid, nor as a change to
        # the file whose hash it altered
        if isinstance(manifest, dict) and (problem := seal_problem(manifest)):
            raise ArtifactError(f"{manifest_file} {problem}")
        if problem := first_manifest_problem(manifest):
            raise ArtifactError(f"{manifest_file}: {problem}; re-export the artifact")
        artifact.manifest = manifest
        artifact.check_files()
        if verify:
            artifact.verify()
        return artifact

    def resolve_inside(self, rel: str) -> Path | None:
        """`rel` with every symlink resolved, or None when that leads out of the folder."""
        resolved = _real_path(self.path / rel)
        return resolved if resolved.is_relative_to(_real_path(self.path)) else None

    def check_inside(self, rel: str) -> Path:
        """`rel` resolved, refused when it (or a symlink on its way) leads out of the folder."""
        resolved = self.resolve_inside(rel)
        if resolved is None:
            raise ArtifactError(
                f"{self.path}: {rel} leads to {_real_path(self.path / rel)}, outside the artifact (a symlink?); "
                "re-export the artifact"
            )
        return resolved

    def check_files(self) -> None:
        """Every file the manifest lists is a file inside the folder."""
        for rel in self.manifest["files"]:
            if not self.check_inside(rel).is_file():
                raise ArtifactError(f"{self.path}: {rel} is missing; re-export the artifact")

    def verify(self) -> None:
        """Every file the manifest lists has its recorded sha256, and model.onnx reads no other."""
        for rel, digest in self.manifest["files"].items():
            if sha256(self.check_inside(rel)) != digest:
                raise ArtifactError(f"{self.path}: {rel} does not match its sha256 in {MANIFEST}; it was modified "
                                    "or cut short since export: re-export the artifact")
        self.check_external_data()

    def check_external_data(self) -> None:
        """model.onnx reads external data only from model.onnx.data, listed and hashed; and the
        manifest's quantization section is the one model.onnx records the digest of.

        Parsing a graph with inline weights costs a second of every load on the small
        decoder; a tensor can name external data only with the key "location" in the
        file's bytes, so a large graph without those bytes (or the digest's key) is not parsed
        at all. A parsed graph's inputs and outputs must be the manifest's (a manifest edited
        and sealed again made triton-repo write a config for outputs the graph does not have).
        """
        recorded = _mentions(self.model_path, QUANTIZATION_DIGEST_KEY.encode())
        if "quantization" in self.manifest and not recorded and not _mentions(self.model_path, b"DequantizeLinear"):
            raise ArtifactError(f"{self.path}: {MANIFEST} has a quantization section but {MODEL_FILE} reads no "
                                "quantized weight (no DequantizeLinear); the manifest was edited: re-export the artifact")
        if not _mentions(self.model_path, b"location") and not recorded \
                and self.model_path.stat().st_size > INLINE_GRAPH_CHECKED_BYTES:
            return
        try:
            model = onnx.load(str(self.model_path), load_external_data=False)
        except Exception as e:  # protobuf's DecodeError and onnx's own errors share no base class
            raise ArtifactError(f"{self.model_path} is not a readable ONNX model ({e}); re-export the artifact") from None
        for side, values in (("inputs", model.graph.input), ("outputs", model.graph.output)):
            # what serving configs, golden I/O and compare's feeds are made from: the graph's own
            if self.manifest[side] != io_spec(values):
                raise ArtifactError(f"{self.path}: {MANIFEST}'s {side} are not {MODEL_FILE}'s (names, dtypes or "
                                    "shapes; the manifest was edited); re-export the artifact")
        if problem := next(_external_data_problems(model, self.manifest["files"]), None):
            raise ArtifactError(f"{self.path}: {problem}; re-export the artifact")
        digest = {p.key: p.value for p in model.metadata_props}.get(QUANTIZATION_DIGEST_KEY)
        if digest is not None and ("quantization" not in self.manifest
                                   or section_digest(self.manifest["quantization"]) != digest):
            what = "lost the quantization section" if "quantization" not in self.manifest else \
                "holds a quantization section other than the one"
            raise ArtifactError(f"{self.path}: {MANIFEST} {what} {MODEL_FILE} was exported with (the manifest was "
                                "edited), so the weights' formats cannot be trusted; re-export the artifact")
        # always, digest or not: a manifest and a digest both rewritten (int8 claimed over int4 codes) pass the
        # digest, not the graph's own formats
        stored, listed = graph_formats(model), manifest_formats_listed(self.manifest.get("quantization"))
        if stored != listed:
            said = f"lists {_formats_text(listed)}" if listed else "has no quantization section"
            raise ArtifactError(f"{self.path}: {MANIFEST} {said}, but {MODEL_FILE} stores {_formats_text(stored)} "
                                "(the manifest was edited); re-export the artifact")

    def model_files(self) -> list[str]:
        """The files a runtime needs to load the graph: model.onnx and, when listed, its data."""
        return [rel for rel in (MODEL_FILE, MODEL_DATA_FILE) if rel in self.manifest["files"]]

    def stored_weight_bytes(self) -> int:
        """The bytes of the weights the graph reads from its data file: the sum of its tensors'
        lengths. Not the file's size, which counts the gaps that align each tensor for mapping
        (64 KiB each: most of a tiny model's file, and holes on disk)."""
        if MODEL_DATA_FILE not in self.manifest["files"]:
            return 0
        model = onnx.load(str(self.model_path), load_external_data=False)
        return sum(int({e.key: e.value for e in t.external_data}.get("length", 0))
                   for t in _get_all_tensors(model) if uses_external_data(t))

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    @property
    def model_path(self) -> Path:
        return self.path / MODEL_FILE

    def input_names(self) -> list[str]:
        return [i["name"] for i in self.manifest["inputs"]]

    def output_names(self) -> list[str]:
        return [o["name"] for o in self.manifest["outputs"]]

    def golden_inputs(self) -> list[dict[str, np.ndarray]]:
        from polygraphy.json import load_json

        quiet_polygraphy()
        return [dict(feed) for feed in load_json(str(self.path / GOLDEN_INPUTS))]

    def golden_outputs(self) -> list[dict[str, np.ndarray]]:
        from polygraphy.comparator import RunResults

        if not self.manifest.get("golden_outputs", True):
            raise ArtifactError(
                f"{self.path} was exported with --no-golden, so it holds no eager outputs; "
                f"`moedeploy compare {self.path}` runs the eager model instead"
            )
        quiet_polygraphy()
        results = RunResults.load(str(self.path / GOLDEN_OUTPUTS))
        return [dict(it) for it in results[0][1]]
