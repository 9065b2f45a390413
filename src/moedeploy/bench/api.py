"""`moedeploy bench`: every backend on the same decode workload, beside the machine's roofline."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from moedeploy.bench.checks import BACKENDS, require_backends, require_engine, require_ort_dtype
from moedeploy.bench.decode import Settings, keeps_extra_buffers, run_in_subprocess
from moedeploy.bench.machine import describe
from moedeploy.bench.peers import PEERS, check_config, gguf_file, missing
from moedeploy.bench.roofline import decode_step_bytes, decode_step_flops, weight_bytes
from moedeploy.bench.spread import busy_warning, probes_warning, spreads
from moedeploy.export import Artifact, export
from moedeploy.export.artifact import parse_dtype
from moedeploy.export.quantize import (
    LM_HEAD,
    QUANT_FORMAT,
    QuantizeError,
    head_block,
    manifest_formats,
    parse_scheme,
)
from moedeploy.models import PRESETS, DecoderConfig, preset
from moedeploy.models.blockquant import QuantScheme
from moedeploy.models.checkpoint import CheckpointWeights
from moedeploy.models.weights import fingerprint
from moedeploy.utils.cache import cache_dir
from moedeploy.utils.io import OutputRefused, atomic_write_json
from moedeploy.utils.progress import size_text

__all__ = ["BACKENDS", "bench", "cache_dir"]
Progress = Callable[[str], None]


#: the backends that run the artifact on ONNX Runtime
ORT_BACKENDS = ("ort", "ort-gqa", "ort-gqa-experts", "ort-contrib")


def preset_folder(name: str) -> Path:
    return cache_dir() / "bench" / f"decoder-{name}-fp32-seed0"


def checkpoint_folder(weights_sha256: str) -> Path:
    """A checkpoint's cached fp32 export, named by its weights fingerprint (not its path: a moved
    or copied checkpoint finds its export, and a checkpoint whose weights changed gets a new one)."""
    return cache_dir() / "bench" / f"checkpoint-{weights_sha256[:16]}-fp32"


def is_checkpoint(target: str) -> bool:
    """A checkpoint folder (Hugging Face or moedeploy): config.json, and no manifest.json (an artifact)."""
    folder = Path(target)
    return folder.is_dir() and (folder / "config.json").is_file() and not (folder / "manifest.json").is_file()


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def existing_artifact(target: str, progress: Progress | None = None, verify: bool = True) -> Artifact | None:
    """The decoder artifact `target` names if it exists: a folder, or a preset's cached export (else None,
    and `progress` hears why a cached one cannot be used). `verify=False`: a folder's files are not
    hashed (its manifest is read for a check that comes before the load that hashes them).

    A checkpoint folder is not an artifact: `prepare_checkpoint` handles it.
    """
    if Path(target).is_dir():
        if not (Path(target) / "manifest.json").is_file():
            raise ValueError(f"{target} is neither a decoder artifact (no manifest.json) nor a checkpoint folder "
                             "(no config.json); pass an artifact folder, a checkpoint folder or a preset")
        artifact = Artifact.load(target, verify=verify)
        if artifact.kind != "decoder":
            raise ValueError(f"{target} holds a {artifact.kind!r}; bench measures decoder artifacts")
        return artifact
    if target not in PRESETS:
        raise ValueError(f"{target!r} is neither an artifact folder, a checkpoint folder nor a preset "
                         f"({', '.join(PRESETS)})")
    folder = preset_folder(target)
    if not (folder / "manifest.json").is_file():
        return None
    try:
        artifact = Artifact.load(folder)  # every file against its recorded sha256
    except (ValueError, OSError) as e:
        why = f"it does not load: {e}"
    else:
        if not (why := preset_cache_problem(artifact, target)):
            return artifact
    if progress:
        progress(f"the cached export {folder} cannot be used ({why}): exporting again")
    return None


def preset_cache_problem(artifact: Artifact, name: str) -> str:
    """Why a sound artifact in a preset's cache folder is not the export bench makes there (the preset
    in fp32, unquantized, at seed 0), or ''. Any sealed export copied into that folder loaded, and was
    timed under the preset's name."""
    if artifact.kind != "decoder" or artifact.dtype != "fp32" or artifact.manifest.get("quantization"):
        what = "a quantized" if artifact.manifest.get("quantization") else \
            f"{'an' if artifact.dtype.startswith('f') else 'a'} {artifact.dtype}"  # an fp16, a bf16
        return f"it holds {what} {artifact.kind!r}, not the fp32 decoder"
    if artifact.manifest["config"].get("source", {}).get("preset") != name or artifact.manifest.get("seed") != 0:
        return f"it is not the {name!r} preset at seed 0"
    try:
        same_config = config_of(artifact) == preset(name)
    except (TypeError, ValueError):
        same_config = False
    return "" if same_config else f"its config is not the {name!r} preset's"


def config_of(artifact: Artifact) -> DecoderConfig:
    return DecoderConfig.from_manifest(artifact.manifest["config"])


def target_config(target: str) -> DecoderConfig:
    """The model config of a bench target without exporting it: a checkpoint's config.json, an
    artifact's manifest, a preset's own (what the scripts under benchmarks/ check sizes against
    before their first export)."""
    if is_checkpoint(target):
        return CheckpointWeights(target).config
    if not Path(target).is_dir() and target in PRESETS:
        return preset(target)  # its cache folder is used only while it holds this config (preset_cache_problem)
    return config_of(existing_artifact(target, verify=False))  # hashed once, by the load that follows


def export_preset(name: str, progress: Progress) -> Artifact:
    folder = preset_folder(name)
    progress(f"exporting the {name!r} decoder once into the cache {folder} (MOEDEPLOY_CACHE moves it)")
    return cache_export(folder, preset_name=name)


def check_sizes(batch: int, prompt_len: int, new_tokens: int, threads: int, repeat: int) -> None:
    """The CLI checks these as it parses them; this says the same to a Python caller, naming the
    size that is wrong."""
    for option, value, least in (("--batch", batch, 1), ("--prompt-len", prompt_len, 1),
                                 ("--new-tokens", new_tokens, 2), ("--threads", threads, 1), ("--repeat", repeat, 1)):
        if value < least:
            why = " (the first new token is the prefill's: a decode step needs a second)" if option == "--new-tokens" else ""
            raise ValueError(f"{option} must be >= {least}{why}, got {value}")


def check_positions(config: DecoderConfig, prompt_len: int, new_tokens: int,
                    options: str = "--prompt-len + --new-tokens") -> None:
    if prompt_len + new_tokens > config.max_positions:
        raise ValueError(f"{options} ({prompt_len} + {new_tokens}) exceeds the model's "
                         f"{config.max_positions} positions; ask for at most {config.max_positions} in all")


def check_peers(config: DecoderConfig, backends: list[str], batch: int, optional: dict[str, str] | None = None,
                quantized: bool = False, dtype: str = "fp32") -> None:
    """Every peer in `backends` computes this model at this batch (of this artifact, quantized or
    not), or a one-line error. A peer `--peers` added (named in `optional`) is instead dropped
    from `backends`, and why is put in `optional` beside the peers that are not installed."""
    for peer in [p for p in PEERS if p in backends]:
        try:
            check_config(peer, config, batch, quantized, dtype)
        except ValueError as e:
            if optional is None or peer not in optional:
                raise
            backends.remove(peer)
            optional[peer] = str(e)


def with_peers(backends: list[str]) -> tuple[list[str], dict[str, str]]:
    """`--peers`: the backends plus every peer installed here, and for each peer not asked for by
    name, why it is left out ('' while none is known: `check_peers` fills in a model it cannot run)."""
    skipped = {peer: missing(peer) or "" for peer in PEERS if peer not in backends}
    return backends + [p for p in skipped if not skipped[p]], skipped


def trusted_cache(folder: Path, weights_sha256: str, config: DecoderConfig) -> tuple[Artifact | None, str]:
    """The cached export in `folder` if it was made from these weights and this config, else None
    and why not. The manifest's `config.source.weights_sha256` is the exporter's
    `fingerprint(weights, float32)`, the quantity `weights_sha256` here is."""
    if not (folder / "manifest.json").is_file():
        return None, ""
    try:
        artifact = Artifact.load(folder)  # every file against its recorded sha256
    except (ValueError, OSError) as e:
        return None, f"it does not load: {e}"
    if artifact.kind != "decoder" or artifact.dtype != "fp32":
        return None, f"it holds a {artifact.dtype} {artifact.kind!r}, not an fp32 decoder"
    recorded = artifact.manifest["config"].get("source", {}).get("weights_sha256")
    if recorded != weights_sha256:
        return None, "its weights fingerprint differs from the checkpoint's"
    try:
        same_config = config_of(artifact) == config
    except (TypeError, ValueError):
        same_config = False
    if not same_config:
        return None, "its config differs from the checkpoint's config.json"
    return artifact, ""


def prepare_checkpoint(target: str, backends: list[str], batch: int, prompt_len: int, new_tokens: int,
                       progress: Progress, optional_peers: dict[str, str] | None = None) -> tuple[Artifact, bool]:
    """A checkpoint folder's fp32 export in the cache, and whether it was written now.

    The cache is used only when its manifest records this checkpoint's weights fingerprint
    (streamed over every tensor, in fp32 as the exporter hashes it) and config; anything else
    is exported again, over it.
    """
    weights = CheckpointWeights(target)  # an unsupported family or a damaged folder fails here, in one line
    check_positions(weights.config, prompt_len, new_tokens)
    check_peers(weights.config, backends, batch, optional_peers)
    progress(f"fingerprinting the weights of {target}")
    weights_sha256 = fingerprint(weights, torch.float32, progress)
    folder = checkpoint_folder(weights_sha256)
    cached, why = trusted_cache(folder, weights_sha256, weights.config)
    if "trt" in backends:
        if cached is None:
            from moedeploy.runtime.tensorrt import TensorRTUnavailable

            raise TensorRTUnavailable(
                f"backend 'trt' needs a TensorRT engine: `moedeploy export decoder --checkpoint {target} --out "
                "artifacts/dec`, `moedeploy build artifacts/dec`, then `moedeploy bench artifacts/dec --backend trt`"
            )
        require_engine(cached, target)
    if cached is not None:
        progress(f"reading the cached export {folder} (its weights fingerprint and config match {target})")
        return cached, False
    if why:
        progress(f"the cached export {folder} cannot be used ({why}): exporting again")
    progress(f"exporting checkpoint {target} once into the cache {folder} (MOEDEPLOY_CACHE moves it)")
    artifact = export("decoder", folder, checkpoint=target, dtype="fp32", force=True, progress=progress)
    if artifact.manifest["config"]["source"].get("weights_sha256") != weights_sha256:
        raise ValueError(f"the weights of {target} changed while they were being exported; run bench again")
    return artifact, True


def prepare(target: str, backends: list[str], batch: int, prompt_len: int, new_tokens: int,
            progress: Progress, optional_peers: dict[str, str] | None = None) -> tuple[Artifact, bool | None]:
    """The artifact to time, and for a preset or a checkpoint whether its cached export was written
    now (None: the user's artifact folder).

    A preset or a checkpoint is exported only after every check that needs no export has passed.
    """
    if is_checkpoint(target):
        return prepare_checkpoint(target, backends, batch, prompt_len, new_tokens, progress, optional_peers)
    artifact = existing_artifact(target, progress)
    config = config_of(artifact) if artifact else preset(target)
    check_positions(config, prompt_len, new_tokens)
    check_peers(config, backends, batch, optional_peers,
                quantized=artifact is not None and bool(artifact.manifest.get("quantization")),
                dtype=artifact.dtype if artifact is not None else "fp32")
    if "trt" in backends:
        require_engine(artifact, target)
    if set(ORT_BACKENDS) & set(backends):
        require_ort_dtype(artifact)
    if Path(target).is_dir():
        return artifact, None
    if artifact is not None:
        return artifact, False
    return export_preset(target, progress), True


#: the backends that time a quantized variant (`--quantize`): ONNX Runtime's, on MatMulNBits.
#: eager torch would time the dequantized float model, llama.cpp and TensorRT refuse the artifact.
QUANTIZED_BACKENDS = ORT_BACKENDS


def parse_variants(quantize: list[str] | None, block_size: int, backends: list[str]) -> list[QuantScheme]:
    """`--quantize int8,int4` as schemes (symmetric, int4 mixed: the export's defaults), checked
    before any work."""
    if not quantize:
        return []
    try:
        schemes = [parse_scheme(q, block_size) for q in dict.fromkeys(quantize)]
    except QuantizeError as e:
        raise ValueError(str(e)) from None
    if not set(QUANTIZED_BACKENDS) & set(backends):
        raise ValueError(f"--quantize times the quantized exports on ONNX Runtime: add one of "
                         f"{', '.join(QUANTIZED_BACKENDS)} to --backend")
    return schemes


#: errors that say bench's cache folder cannot be written (not a fault of the export itself)
CACHE_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def in_cache(e: OSError, folder: Path) -> bool:
    """Whether `e` is a refused write inside bench's cache `folder` (not a checkpoint shard it read)."""
    return e.errno in CACHE_NOT_WRITABLE and (not e.filename or Path(os.path.abspath(e.filename)).is_relative_to(
        os.path.abspath(folder)))


def cache_not_writable(e: OSError, folder: Path) -> OSError:
    """The error for a cache bench may not write: the folder and the fix, not the temporary file
    the write failed on."""
    return OSError(e.errno, f"cannot write bench's cache {folder} ({e.strerror or e}); set MOEDEPLOY_CACHE to a "
                            "folder you can write")


def block_size_problem_for(target: str, scheme: QuantScheme) -> str | None:
    """What export would refuse in `scheme`'s block size for the preset or checkpoint `target`
    (export's defaults: int4 mixed), found from the weights' shapes alone: a checkpoint's
    headers, a preset's modules on the meta device."""
    from moedeploy.export.quantize import block_size_problem, maybe_quantized, surely_quantized
    from moedeploy.models import MoEDecoder
    from moedeploy.models.weights import ModuleWeights

    if is_checkpoint(target):
        weights = CheckpointWeights(target)
    elif target in PRESETS:
        with torch.device("meta"):
            weights = ModuleWeights(MoEDecoder(preset(target)))
    else:
        return None
    return block_size_problem(surely_quantized(weights), scheme, scheme.bits == 4, None, maybe_quantized(weights))


def cache_export(folder: Path, **options: Any) -> Artifact:
    """`export("decoder", folder, ...)` into bench's cache, whose refusal to replace a folder
    holding the user's files gives bench's advice (bench has no --out or --force)."""
    try:
        return export("decoder", folder, **options)
    except OutputRefused as e:
        what = str(e).split(";")[0]  # what is in the way, without export's advice (--out, --force)
        raise OutputRefused(f"{what}; it is where bench caches this export: move what is yours out of it, or set "
                            "MOEDEPLOY_CACHE to another folder") from None
    except OSError as e:
        if in_cache(e, folder.parent):
            raise cache_not_writable(e, folder.parent) from None
        if e.errno != errno.ENOSPC:
            raise
        what = (e.strerror or str(e)).split(";")[0]  # without export's advice (--out)
        raise OSError(errno.ENOSPC, f"{what}; free space, or set MOEDEPLOY_CACHE to a folder on a disk with room "
                                    "for bench's exports", e.filename) from None


def quantized_variant(fp32: Artifact, scheme: QuantScheme, target: str, progress: Progress) -> Artifact:
    """The quantized export of the preset or checkpoint whose fp32 export is `fp32`, cached beside
    it and reused only while it records this scheme and the same weights fingerprint. A stale
    export is replaced; a folder of that name moedeploy did not write is refused, not replaced."""
    folder = fp32.path.with_name(f"{fp32.path.name}-{scheme.name}b{scheme.block_size}")
    weights_sha256 = fp32.manifest["config"]["source"].get("weights_sha256")
    if (folder / "manifest.json").is_file():
        try:
            cached = Artifact.load(folder)  # every file against its recorded sha256
            q = cached.manifest.get("quantization") or {}
            head = manifest_formats(q).get(LM_HEAD) if "tensors" in q else None
            hidden = fp32.manifest["config"]["hidden_size"]
            if cached.dtype == fp32.dtype and (q.get("format"), q.get("bits"), q.get("block_size"), q.get("symmetric"),
                                               q.get("mixed")) == (
                    QUANT_FORMAT, scheme.bits, scheme.block_size, scheme.symmetric, scheme.bits == 4) \
                    and (head is None or head.block_size == head_block(scheme.block_size, head.bits, hidden)) \
                    and cached.manifest["config"]["source"].get("weights_sha256") == weights_sha256:
                progress(f"reading the cached {scheme.name} export {folder}")
                return cached
        except (ValueError, OSError):
            pass  # stale or damaged: export again
    if folder.exists() and not (folder / "manifest.json").is_file() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"{folder} is where bench caches the {scheme.name} export, and it holds something moedeploy "
                         "did not write: move it, or set MOEDEPLOY_CACHE to another folder")
    progress(f"exporting {target} as {scheme.name} (blocks of {scheme.block_size}, the LM head's by export's default) "
             f"into the cache {folder}")
    source = {"checkpoint": target} if is_checkpoint(target) else {"preset_name": target}
    artifact = cache_export(folder, **source, quantization=scheme, progress=progress)
    if artifact.manifest["config"]["source"].get("weights_sha256") != weights_sha256:
        raise ValueError(f"the weights of {target} changed while they were being exported; run bench again")
    return artifact


def export_format(artifact: Artifact) -> str:
    """What bench calls an export: its weights' format ("int8", "int4") or its dtype ("fp32")."""
    q = artifact.manifest.get("quantization")
    return f"int{q['bits']}" if q else artifact.dtype


def variant_roofline(artifact: Artifact, config: DecoderConfig, batch: int, context: int,
                     dequantized: bool = False) -> dict[str, Any]:
    """An artifact's bytes: its weights on disk (a quantized one's codes, scales and zero points)
    and what one decode step reads (weights in their stored format and the KV cache).
    `dequantized`: a quantized artifact's as eager torch reads them, its dequantized weights in
    the artifact's float dtype."""
    itemsize = parse_dtype(artifact.dtype).itemsize
    quantization = None if dequantized else artifact.manifest.get("quantization")
    weights = artifact.stored_weight_bytes() if quantization else weight_bytes(config, itemsize)
    return {"artifact": str(artifact.path), "weight_bytes": weights,
            "decode_step_bytes": decode_step_bytes(config, batch, context, itemsize, quantization)}


def cache_report(artifact: Artifact, written: bool | None, quantized: Sequence[Artifact] = ()) -> dict[str, Any] | None:
    """Where a preset's or a checkpoint's cached export lives and its size, measured after the run (the ort backend
    writes nothing there: a decoder's lowered graph reads the artifact's own weight file); with `--quantize`,
    the quantized exports cached beside it too."""
    if written is None:
        return None
    report: dict[str, Any] = {"path": str(artifact.path), "bytes": folder_bytes(artifact.path), "written": written}
    if quantized:
        report["quantized"] = [{"path": str(q.path), "bytes": folder_bytes(q.path)} for q in quantized]
    return report


def bench(
    target: str,
    backends: list[str],
    batch: int = 1,
    prompt_len: int = 128,
    new_tokens: int = 64,
    threads: int = 2,
    repeat: int = 3,
    json_path: str | Path | None = None,
    progress: Progress | None = None,
    peers: bool = False,
    rounds: int = 1,
    quantize: list[str] | None = None,
    block_size: int = 32,
) -> dict[str, Any]:
    """Time every backend; everything that can be checked is checked before any export or timing.

    peers: add every peer engine installed here (llama.cpp, openvino) on the same weights.
    rounds: run every backend this many times, each in a fresh process, the backends interleaved
    and rotated (round 1: a, b, c; round 2: b, c, a ...), so a slow spell of the machine hits
    them alike; each ratio then also comes paired by round (paired_ratio).
    quantize: also export the preset or checkpoint as these ("int8", "int4"; blocks of
    `block_size`, the LM head's by export's default) and time the ONNX Runtime backends on each, named "<backend> int8" etc., each
    beside its own roofline (bytes on disk, bytes a step reads, the bandwidth bound).
    """
    progress = progress or (lambda _: None)
    if not str(target).strip():  # Path("") is the working folder: benched as if named, and named as ""
        raise ValueError(f"no target given; pass an artifact folder, a checkpoint folder or a preset ({', '.join(PRESETS)})")
    backends = require_backends(backends)
    skipped_peers: dict[str, str] = {}
    if peers:
        backends, skipped_peers = with_peers(backends)
    check_sizes(batch, prompt_len, new_tokens, threads, repeat)
    if set(ORT_BACKENDS) & set(backends):
        from moedeploy.runtime.ort import moe_path

        moe_path()  # a wrong MOEDEPLOY_MOE_PATH refused before any export (a checkpoint's too), not in each worker
    if rounds < 1:
        raise ValueError("--rounds must be >= 1")
    schemes = parse_variants(quantize, block_size, backends)
    if schemes and (Path(target).is_dir() and not is_checkpoint(target)):
        raise ValueError(f"--quantize exports a preset or a checkpoint in int8/int4; {target} is an artifact folder: "
                         "bench a quantized artifact by its folder, or pass the preset or checkpoint")
    for scheme in schemes:  # before the float export (minutes, or hours for a large checkpoint), not after it
        if problem := block_size_problem_for(target, scheme):
            raise ValueError(problem)
    artifact, written = prepare(target, backends, batch, prompt_len, new_tokens, progress, skipped_peers if peers else None)
    skipped_peers = {peer: why for peer, why in skipped_peers.items() if why}  # the others run
    config = config_of(artifact)
    # (label, export, backend, the row it is set against): the float export's rows, then each quantized export's
    base = export_format(artifact)  # an artifact given by folder may itself be quantized: "int8", not "fp32"
    jobs = [(backend, base, backend, None) for backend in backends]
    variants = {base: artifact}
    for scheme in schemes:
        variants[scheme.name] = quantized_variant(artifact, scheme, target, progress)
        jobs += [(f"{b} {scheme.name}", scheme.name, b, b) for b in backends if b in QUANTIZED_BACKENDS]
    peer_model = gguf_file(artifact, cache_dir() / "bench", progress, checkpoint=target if is_checkpoint(target) else None) \
        if "llama.cpp" in backends else None
    progress("measuring the machine (memory bandwidth, GEMM rate)")
    machine = describe(threads)

    # eager torch of a checkpoint reads the folder that was just fingerprinted, not the one the
    # cached export was first made from (the same weights, perhaps at another path)
    checkpoint = str(Path(target).resolve()) if is_checkpoint(target) else None
    runs: dict[str, list[dict]] = {label: [] for label, *_ in jobs}
    for round_no in range(1, rounds + 1):
        for label, variant_name, backend, _ in rotated(jobs, round_no - 1):
            of_rounds = f", round {round_no}/{rounds}" if rounds > 1 else ""
            progress(f"{label}: batch {batch}, prompt {prompt_len}, {new_tokens} new tokens, x{repeat}{of_rounds}")
            runs[label].append(run_in_subprocess(Settings(
                str(variants[variant_name].path), backend, batch, prompt_len, new_tokens, threads, repeat, checkpoint=checkpoint,
                peer_model=str(peer_model) if backend == "llama.cpp" else None,
                peer_extra_buffers=keeps_extra_buffers(runs[label]))) | {"backend": label, "variant": variant_name})
    raw = [merge_rounds(label_runs) for label_runs in runs.values()]

    context = prompt_len + new_tokens // 2  # the average decode step's history
    rooflines = {name: variant_roofline(a, config, batch, context) for name, a in variants.items()}
    # a quantized artifact given by folder: its torch row runs the dequantized float weights
    quantized_base = base.startswith("int")
    float_roof = variant_roofline(artifact, config, batch, context, dequantized=True) if quantized_base else None
    step_bytes = rooflines[base]["decode_step_bytes"]
    step_flops = decode_step_flops(config, batch, context)

    def decode_bound(bandwidth_gbs: float, nbytes: float = step_bytes) -> float:
        """Tokens/s when a step takes its bytes at this bandwidth or its flops at the GEMM rate."""
        return batch / max(nbytes / (bandwidth_gbs * 1e9), step_flops / (machine["gemm_gflops"] * 1e9))

    bound_tps = decode_bound(machine["bandwidth_gbs"])
    for roof in [*rooflines.values(), *([float_roof] if float_roof else [])]:
        roof["decode_bound_tokens_per_s"] = round(decode_bound(machine["bandwidth_gbs"], roof["decode_step_bytes"]), 1)
    model_bytes = rooflines[base]["weight_bytes"]
    prefill_flops = decode_step_flops(config, batch * prompt_len, prompt_len // 2)
    prefill_floor_ms = prefill_flops / (machine["gemm_gflops"] * 1e9) * 1e3

    results = []
    for r in raw:
        if "error" in r:
            results.append({"backend": r["backend"], "metric": "error", "value": r["error"], "unit": ""})
            continue
        for metric, unit in (("prefill_ms", "ms"), ("decode_tokens_per_s", "tokens/s"), ("token_latency_p50_ms", "ms"),
                             ("token_latency_p99_ms", "ms"), ("peak_rss_mb", "MB"), ("load_peak_rss_mb", "MB"),
                             ("backend_rss_mb", "MB")):
            results.append({"backend": r["backend"], "metric": metric, "value": round(r[metric], 3), "unit": unit})
        roof = rooflines[r["variant"]]
        if float_roof is not None and r["backend"] not in QUANTIZED_BACKENDS:
            roof = float_roof
        r["backend_rss_vs_weights"] = r["backend_rss_mb"] * 2**20 / roof["weight_bytes"]
        results.append({"backend": r["backend"], "metric": "backend_rss_vs_weights",
                        "value": round(r["backend_rss_vs_weights"], 3), "unit": ""})
        results.append({"backend": r["backend"], "metric": "fraction_of_bandwidth_bound",
                        "value": round(r["decode_tokens_per_s"] / roof["decode_bound_tokens_per_s"], 3), "unit": ""})
        # against the bandwidth its own worker measured right after timing (the machine's drifts)
        r["decode_bound_tokens_per_s"] = own_bound = decode_bound(r["bandwidth_gbs"], roof["decode_step_bytes"])
        results.append({"backend": r["backend"], "metric": "fraction_of_own_bandwidth_bound",
                        "value": round(r["decode_tokens_per_s"] / own_bound, 3), "unit": ""})
        results.append({"backend": r["backend"], "metric": "fraction_of_prefill_gemm_bound",
                        "value": round(prefill_floor_ms / r["prefill_ms"], 3), "unit": ""})

    ok = [r for r in raw if "error" not in r]
    spread = {r["backend"]: spreads(r) for r in ok}
    warnings = [w for name, figures in spread.items() if (w := busy_warning(name, figures, repeat * rounds))]
    probes = [machine["bandwidth_gbs"], *(p for r in ok for p in r["bandwidth_gbs_all"])]
    if probe_note := probes_warning(probes, rounds):
        warnings.append(probe_note)
    if cache_note := cache_holds_step_warning(machine.get("last_level_cache_mb"), step_bytes):
        warnings.append(cache_note)
    warnings += [f"{r['backend']}: {r['note']}" for r in ok if "note" in r]
    # hf runs transformers' Mixtral with its own random weights: only the others share weights.
    # A quantized export's backends run int8 activations (accuracy level 4), rounded differently
    # by each kernel: their tokens are reported, not held to agree (compare judges their accuracy)
    def tokens_agree(variant: str) -> bool:
        return len({str(r["tokens"]) for r in ok if r["backend"] != "hf" and r["variant"] == variant}) <= 1

    # a quantized artifact given by folder is such an export too: its tokens go with the others'
    agree = None if quantized_base else tokens_agree(base)
    report = {
        "machine": machine,
        "settings": {"target": target, "artifact": str(artifact.path), "batch": batch, "prompt_len": prompt_len,
                     "new_tokens": new_tokens, "threads": threads, "repeat": repeat, "rounds": rounds},
        "roofline": {"decode_step_bytes": step_bytes, "decode_step_flops": step_flops,
                     "kv_cache_bytes_per_token": config.kv_cache_bytes_per_token(parse_dtype(artifact.dtype).itemsize),
                     "decode_bound_tokens_per_s": round(bound_tps, 1), "prefill_gemm_floor_ms": round(prefill_floor_ms, 2),
                     "weight_bytes": model_bytes},
        "variants": rooflines,
        "results": results,
        "spread": {name: {key: s.as_dict() for key, s in figures.items()} for name, figures in spread.items()},
        "warnings": warnings,
        "ratios": _ratios(ok) | _quantized_ratios(ok, {label: base for label, _, _, base in jobs if base}),
        "greedy_tokens_agree": agree,
        "quantized_tokens_agree": {name: tokens_agree(name) for name in variants if name != base or quantized_base},
        "peers_skipped": skipped_peers,
        "cache": cache_report(artifact, written, [v for name, v in variants.items() if name != base]),
        "raw": [{k: v for k, v in r.items() if k != "tokens"} for r in raw],
    }
    if (set(backends) & {"ort", "ort-gqa"} and artifact.kind == "decoder" and artifact.dtype == "fp32"
            and not quantized_base and threads > 1):
        from moedeploy.runtime.ort import moe_path_and_source

        path, source = moe_path_and_source(artifact, threads)  # what their sessions decided (a worker's warnings are not shown)
        path, source = path_that_ran(path, source, [r for r in ok if r["backend"] in ("ort", "ort-gqa")])
        report["moe_path"] = {"path": path, "source": source}
    if json_path:
        atomic_write_json(json_path, report)
    return report


def rotated(jobs: list, shift: int) -> list:
    """The backends of one round, starting `shift` places on: each takes every place in the order
    over the rounds, so none always runs right after the same one or first in a fresh spell."""
    shift %= max(len(jobs), 1)
    return jobs[shift:] + jobs[:shift]


def paired_ratio(numerator: dict, denominator: dict, key: str = "decode_tokens_per_s") -> dict[str, Any] | None:
    """`key` of two backends' merged rounds as a ratio per round (each round's medians, timed
    minutes apart at most, so a machine that drifts over the run moves both alike) and the median
    of those: the figure to compare two systems by on a busy machine. None with fewer than two
    rounds."""
    import statistics

    a, b = numerator.get(f"{key}_rounds"), denominator.get(f"{key}_rounds")
    if not a or not b or len(a) != len(b) or len(a) < 2:
        return None
    by_round = [x / y for x, y in zip(a, b, strict=True)]
    return {"median": round(statistics.median(by_round), 3), "by_round": [round(r, 3) for r in by_round]}


def merge_rounds(runs: list[dict]) -> dict:
    """One backend's rounds as one result: medians over every timed generation of every round
    (and each round's median, for paired_ratio), the highest peak memory; the first error if any
    round failed (a flaky backend is not averaged away), and an error if two rounds generated
    different tokens."""
    import statistics

    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    if len(runs) == 1:  # its probe as a list too, as the report's JSON has it for every row
        return {**runs[0], "bandwidth_gbs_all": [runs[0]["bandwidth_gbs"]]}
    first = runs[0]
    if any(r["tokens"] != first["tokens"] for r in runs):
        return {"backend": first["backend"], "error": "its rounds generated different greedy tokens"}
    merged = dict(first)
    for key in ("prefill_ms", "decode_tokens_per_s"):
        merged[f"{key}_all"] = [v for r in runs for v in r[f"{key}_all"]]
        merged[key] = statistics.median(merged[f"{key}_all"])
        merged[f"{key}_rounds"] = [statistics.median(r[f"{key}_all"]) for r in runs]
    for key in ("token_latency_p50_ms", "token_latency_p99_ms", "load_s"):
        merged[key] = statistics.median(r[key] for r in runs)
    for key in ("peak_rss_mb", "load_peak_rss_mb", "backend_rss_mb"):
        merged[key] = max(r[key] for r in runs)
    merged["baseline_rss_mb"] = min(r["baseline_rss_mb"] for r in runs)
    merged["bandwidth_gbs_all"] = [r["bandwidth_gbs"] for r in runs]
    merged["bandwidth_gbs"] = statistics.median(merged["bandwidth_gbs_all"])
    for r in runs:  # a round that ran without llama.cpp's extra weight buffers marks the whole row
        if "note" in r:
            merged.update(note=r["note"], llama_extra_buffers=r.get("llama_extra_buffers"))
    return merged


#: the default fp32 MoE path (experts cut into pieces) against the other one a CPU session can take
MOE_PATH_PAIR = ("ort-gqa", "ort-gqa-experts")


def _ratios(ok: list[dict]) -> dict[str, dict[str, float]]:
    """Each backend against each baseline present: eager (torch, hf) and the peers; and the
    default MoE path against the If per expert, which is faster depending on the CPU, where
    `ort-gqa` did cut its experts and `ort-gqa-experts` ran them on Ifs (each result's lowering)."""
    by = {r["backend"]: r for r in ok}
    ratios = {}
    for name, r in by.items():
        for base in ("torch", "hf", *PEERS):
            if base in by and base != name:
                ratios[f"{name}_vs_{base}"] = _ratio(r, by[base])
    split, experts = MOE_PATH_PAIR
    # only where ort-gqa cut its experts and ort-gqa-experts ran Ifs: not with one thread,
    # MOEDEPLOY_MOE_PATH=experts or a `moedeploy tune` record saying so (report["moe_path"]),
    # experts that do not qualify, or a quantized artifact (QMoE)
    if split in by and experts in by and lowered(by[split], "moe_split") and lowered(by[experts], "moe_experts"):
        ratios[f"{split}_vs_{experts}"] = _ratio(by[split], by[experts])
    return ratios


def path_that_ran(path: str, source: str, rows: list[dict]) -> tuple[str, str]:
    """The MoE path as the ort rows' workers lowered it: "native" only where their sessions put
    some layer on the native kernel, which takes no expert biases (gpt-oss's), for example; those
    layers take the If per expert instead."""
    if path != "native" or not rows or any(lowered(r, "moe_native") for r in rows):
        return path, source
    return "experts", "the native kernel is built here, but it does not take these experts (expert biases)"


def lowered(result: dict, count: str) -> int:
    """How many nodes a backend's session lowered this way (its worker's lowering counts; 0 without)."""
    return result.get("lowering", {}).get(count, 0)


def _ratio(r: dict, base: dict) -> dict[str, Any]:
    """One backend against another: medians' ratios, and decode by round when there were rounds."""
    ratio = {"decode_speedup": round(r["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3),
             "prefill_time_ratio": round(r["prefill_ms"] / base["prefill_ms"], 3),
             "peak_rss_ratio": round(r["peak_rss_mb"] / base["peak_rss_mb"], 3)}
    if paired := paired_ratio(r, base):
        ratio["decode_speedup_paired"] = paired
    return ratio


def _quantized_ratios(ok: list[dict], bases: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each quantized export's backend against the same backend on the float export."""
    by = {r["backend"]: r for r in ok}
    return {f"{label}_vs_{base}": _ratio(by[label], by[base]) for label, base in bases.items() if label in by and base in by}


#: A last-level cache at least this share of a decode step's bytes can keep the weights every
#: step re-reads (the LM head, attention) between tokens.
CACHE_SHARE_WARNED = 0.25


def cache_holds_step_warning(cache_mb: float | None, step_bytes: float) -> str | None:
    """Why "of bound" may exceed 100% on this CPU: the DRAM-bandwidth bound assumes every weight
    of a step comes from DRAM, which a cache this large relative to the step does not."""
    if not cache_mb or cache_mb * 2**20 < CACHE_SHARE_WARNED * step_bytes:
        return None
    return (f"this CPU's last-level cache ({cache_mb:.0f} MB) holds {min(cache_mb * 2**20 / step_bytes, 1):.0%} of a "
            f"decode step's {size_text(step_bytes)}; weights re-read every step can come from it, so decode can "
            "pass the DRAM-bandwidth bound ('of bound' over 100%); compare backends with each other here")
