"""Other inference engines timed on the same weights, beside moedeploy: the peers.

`llama.cpp` runs the decoder's weights as an f32 GGUF (`moedeploy.bench.gguf`) through
llama-cpp-python; `openvino` runs the artifact's own graph on OpenVINO's CPU plugin with its KV
cache as state, as optimum-intel does (`moedeploy.bench.openvino_peer`). A peer that is not installed is skipped by `--peers` (with the install
command in the report) and refused in one line when named in `--backend`.
"""

from __future__ import annotations

import errno
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from moedeploy.bench.checks import INSTALL, PEERS, missing  # noqa: F401 (re-exported: the peers' names and needs)
from moedeploy.export.artifact import Artifact
from moedeploy.models.config import DecoderConfig

if TYPE_CHECKING:
    from moedeploy.bench.decode import Stepper

def check_config(peer: str, config: DecoderConfig, batch: int, quantized: bool = False, dtype: str = "fp32") -> None:
    """The peer computes this model and this batch, or a one-line ValueError. `quantized`: the
    artifact's weights are int8/int4, which the peer's f32 weights would not be; `dtype`: the
    artifact's compute dtype."""
    if peer == "llama.cpp":
        if quantized:
            raise ValueError("backend 'llama.cpp' runs the unquantized weights (an f32 GGUF), not this quantized "
                             "artifact's; compare quantized formats with `python benchmarks/quantized.py`")
        if dtype != "fp32":  # its GGUF is f32: it would neither run these weights nor match their fingerprint
            raise ValueError(f"backend 'llama.cpp' is the fp32 comparison (an f32 GGUF of the same weights), not "
                             f"this {dtype} artifact's; bench the fp32 export of the same weights beside it")
        from moedeploy.bench.gguf import require_llama_shaped

        require_llama_shaped(config)
        if batch != 1:
            raise ValueError("backend 'llama.cpp' is benchmarked at --batch 1 (one sequence per context)")
    if peer == "openvino" and (quantized or dtype != "fp32"):
        raise ValueError(f"backend 'openvino' is the fp32 comparison (the graph `ort` runs, at f32 inference "
                         f"precision), not this {'quantized' if quantized else dtype} artifact's; OpenVINO's own "
                         "int8/int4 are compared in `python benchmarks/quantized.py`")


def gguf_file(artifact: Artifact, cache: Path, progress: Callable[[str], None],
              checkpoint: str | Path | None = None) -> Path:
    """The artifact's weights as an f32 GGUF in the cache, written once per weights fingerprint.

    A cached file is reused only when the fingerprint it records is the artifact's and its bytes
    are those written (its sha256 sidecar); the weights written are checked against that
    fingerprint first (an eager rebuild that differs is refused). `checkpoint`: where the
    checkpoint is now (bench's target), when it is not where the export was made from.
    """
    from moedeploy.bench.gguf import digest_problem, recorded_fingerprint, write_gguf
    from moedeploy.models.checkpoint import CheckpointWeights
    from moedeploy.models.weights import ModuleWeights, fingerprint

    source = artifact.manifest["config"].get("source", {})
    expected = source.get("weights_sha256")
    if not expected:
        raise ValueError(f"{artifact.path}'s manifest records no weights fingerprint, so a GGUF made for it could "
                         "not be checked; re-export it with this moedeploy version")
    path = cache / f"gguf-{expected[:16]}-f32.gguf"
    if path.is_file() and recorded_fingerprint(path) == expected:
        if (problem := digest_problem(path)) is None:
            progress(f"llama.cpp: reading the cached {path} (this artifact's weights fingerprint, its bytes as written)")
            return path
        progress(f"llama.cpp: {problem}: writing it again")
    config = DecoderConfig.from_manifest(artifact.manifest["config"])
    if checkpoint := checkpoint or source.get("checkpoint"):
        weights = CheckpointWeights(checkpoint)
    else:
        from moedeploy.export.reference import build_decoder

        weights = ModuleWeights(build_decoder(source.get("preset"), None, artifact.manifest["seed"], torch.float32))
    if fingerprint(weights, torch.float32) != expected:
        raise ValueError(f"the weights rebuilt for {artifact.path} are not the ones it was exported from; re-export it")
    from moedeploy.bench.roofline import weight_bytes
    from moedeploy.utils.io import require_free_space

    require_free_space(path, weight_bytes(config))  # f32: the GGUF is the weights plus a small header
    progress(f"llama.cpp: writing the weights once as an f32 GGUF into the cache {path}")
    try:
        return write_gguf(config, weights, path, expected, progress)
    except OSError as e:
        from moedeploy.bench.api import cache_not_writable, in_cache

        if in_cache(e, cache):
            raise cache_not_writable(e, cache) from None
        if e.errno == errno.EISDIR:
            raise OSError(e.errno, f"{path} is a folder, where bench keeps its GGUF file; move it away, or set "
                                   "MOEDEPLOY_CACHE to another folder") from None
        raise


#: signals of a process that crashed by itself (a fault, an abort), as llama.cpp's AMX kernels do on
#: some AMX CPUs; not SIGKILL or SIGTERM, which another process (the OOM killer, a user) sends
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT})
T = TypeVar("T")


def plain_buffers_note(what_happened: str) -> str:
    """What a llama.cpp row says when it ran again without its extra weight buffers after `what_happened`."""
    return (f"{what_happened} with its extra weight buffers (AMX / repacked quantized weights) on, and ran again "
            "with them off (llama.cpp's AMX kernels crash so on some AMX CPUs: ggml-org/llama.cpp#20824)")


def llama_model(gguf: str, extra_buffers: bool = True, **kwargs):
    """llama_cpp.Llama over `gguf`. `extra_buffers=False` loads the weights without llama.cpp's extra
    buffer types (model params' `use_extra_bufts`): no AMX or repacked copies of quantized weights,
    which segfault in `ggml_backend_amx_mul_mat` on some AMX hosts. llama-cpp-python takes no
    argument for it, so its default model params are swapped for this one construction."""
    import llama_cpp
    import llama_cpp.llama as high_level

    if extra_buffers:
        return llama_cpp.Llama(model_path=gguf, **kwargs)
    module = high_level.llama_cpp  # the low-level module the constructor reads its defaults from
    defaults = module.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    module.llama_model_default_params = without_extra_buffers
    try:
        return llama_cpp.Llama(model_path=gguf, **kwargs)
    finally:
        module.llama_model_default_params = defaults


def llama_stream_logits(gguf: str, ids: list[int], threads: int, extra_buffers: bool = True):
    """Teacher-forced logits (len(ids), vocab) at every position of `ids`, as one llama.cpp batch."""
    import numpy as np

    n = len(ids)
    llm = llama_model(gguf, extra_buffers, n_ctx=n, n_batch=n, n_ubatch=n, n_threads=threads,
                      n_threads_batch=threads, logits_all=True, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[:n], dtype=np.float32)


def with_extra_buffers_fallback(run: Callable[[bool], T], crash: Callable[[T], str | None],
                                extra_buffers: bool = True) -> tuple[T, str | None]:
    """`run(extra_buffers)`, and where `crash(result)` says it crashed (a line, else None) with the
    buffers on, `run(False)` once more: the one retry policy of the timed workers
    (`decode.retry_llama_without_extra_buffers`) and of the stream logits. Returns the last result
    and the note a report shows beside it when the buffers had to be turned off (else None)."""
    result = run(extra_buffers)
    what = crash(result) if extra_buffers else None
    if what is None:
        return result, None
    return run(False), plain_buffers_note(what)


def llama_stream_logits_in_child(gguf: str, ids: list[int], threads: int, extra_buffers: bool = True,
                                 timeout: float = 1800.0, compute: Callable = llama_stream_logits):
    """`compute(gguf, ids, threads, extra_buffers)` (llama.cpp's stream logits) in a spawned process,
    so that llama.cpp crashing costs its row and not the whole benchmark; after a crash by a
    signal in `CRASH_SIGNALS`, once more without its extra weight buffers
    (`with_extra_buffers_fallback`). Returns the logits and the note a report shows beside them
    when this call had to turn the buffers off (else None); a RuntimeError in one line when it
    got no logits."""
    from moedeploy.utils.child_process import crash_text, in_child

    (outcome, value), note = with_extra_buffers_fallback(
        lambda extra: in_child(compute, (gguf, ids, threads, extra), timeout),
        lambda o: f"llama.cpp was {crash_text(-o[1])}" if o[0] == "signal" and o[1] in CRASH_SIGNALS else None,
        extra_buffers)
    if outcome == "ok":
        return value, note
    what = {"signal": lambda: f"was {crash_text(-value)}", "timeout": lambda: f"took more than {timeout:.0f} s",
            "error": lambda: f"failed: {value}"}[outcome]()
    raise RuntimeError(f"llama.cpp computing {Path(gguf).name}'s logits {what}")


def llama_cpp_stepper(gguf: str, threads: int, total: int, prompt_len: int, extra_buffers: bool = True) -> Stepper:
    """reset(batch, total), step(ids, start) -> last-position logits (1, vocab) on llama.cpp, and
    greedy(ids, start) -> (1, 1): NumPy's argmax over the logits where llama.cpp keeps them (no copy)."""
    import numpy as np
    from llama_cpp import llama_get_logits_ith

    llm = llama_model(gguf, extra_buffers, n_ctx=total, n_batch=max(prompt_len, 1), n_ubatch=max(prompt_len, 1),
                      n_threads=threads, n_threads_batch=threads, use_mmap=True, logits_all=False, verbose=False)

    def reset(batch: int, _total: int) -> None:
        llm.reset()

    def last_logits(ids: torch.Tensor, start: int) -> np.ndarray:
        if llm.n_tokens != start:
            raise RuntimeError(f"llama.cpp context holds {llm.n_tokens} tokens, step starts at {start}")
        llm.eval(ids[0].tolist())
        # the C API's logits of the batch's last token (with logits_all off, llama-cpp-python keeps none)
        return np.ctypeslib.as_array(llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))

    def step(ids: torch.Tensor, start: int) -> torch.Tensor:
        return torch.from_numpy(last_logits(ids, start).copy()).unsqueeze(0)

    def greedy(ids: torch.Tensor, start: int) -> torch.Tensor:
        return torch.tensor([[int(last_logits(ids, start).argmax())]])

    return reset, step, greedy
