"""Which fp32 MoE path decodes faster on this machine, timed on the artifact itself and kept.

A CPU session runs an fp32 decoder's MoE layers one of two ways on ONNX Runtime's own kernels
(`runtime.ort.session_moe`): every expert cut into one piece per thread on com.microsoft::MoE
("split", the default), or one If per expert over prepacked Gemms ("experts"); and where it is
built, on the project's native kernel ("native", then the default). Which decodes faster is a
property of the machine, and not one a rule predicts: in `bench` the split made 1.02-1.22x the If per expert's
tokens/s on a 2-core AVX-512 EPYC, 0.87-0.98x on an AVX2 EPYC, and 0.90x on the AVX-512 kind
again on a day its memory read half as fast (benchmarks/README.md). A default is a guess either way.

So `moedeploy tune` times both on the artifact, in one process, in paired greedy generations
(the sessions alternating, so a busy spell slows both), and writes the faster into the
artifact's cache/ with what it was measured on. Where the project's native kernel is built
(plugins/native, every CPU session's path by default there) it is timed too, against the
faster of the two: it stays unless it decoded more than TIE slower. Its speed is as much the
machine's as the others' (timed on AVX-512 EPYCs only), so this is how a CPU where it loses
finds out. A session takes that path only while the record still describes it (`machine_key`: the CPU, the threads, huge pages, the model files and library
versions, as `cache_origin` checks the lowering cache). Otherwise it says why and takes the
default, never a choice made for another machine. Only sessions that prepack follow it (tune
times those; one sharing the artifact's mapped weights runs other code, `session_moe`).
MOEDEPLOY_MOE_PATH, when set, overrides the record for every session. All paths compute the same function (`compare` checks each
against eager PyTorch), so a record can make a session slower, never wrong.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moedeploy.export.artifact import Artifact

log = logging.getLogger(__name__)

#: the record `moedeploy tune` writes into an artifact's cache/ folder
TUNED_FILE = "moe_path.json"
TUNED_FORMAT = 1
#: a paired ratio within this of 1 is no clear difference: the default stays
TIE = 0.03


@dataclass
class Tuning:
    """One `moedeploy tune` measurement: each path's decode step time per round (ms, the rounds
    paired), the median of split / experts over the rounds, and the path chosen from it."""

    path: str
    verdict: str
    ratio: float
    split_ms: list[float]
    experts_ms: list[float]
    tokens_identical: bool
    #: the native kernel's step times (None: not built here, not timed), and the median of
    #: native / the faster other path's over the rounds
    native_ms: list[float] | None = None
    native_ratio: float | None = None


def choose(split_ms: list[float], experts_ms: list[float]) -> tuple[str, str, float]:
    """(path, verdict, ratio) from paired step times: the ratio is the median over rounds of
    split / experts; the If per expert is chosen when the split takes more than TIE longer, the
    split when it takes TIE less, and the default (split) otherwise."""
    ratio = statistics.median(s / e for s, e in zip(split_ms, experts_ms, strict=True))
    if ratio > 1 + TIE:
        return "experts", f"the If per expert decoded x{ratio:.2f} the split's speed", ratio
    if ratio < 1 - TIE:
        return "split", f"the split decoded x{1 / ratio:.2f} the If per expert's speed", ratio
    return "split", f"no clear difference (x{ratio:.2f}): the default, the split, stays", ratio


def choose_native(other: str, other_ms: list[float], native_ms: list[float]) -> tuple[str, str, float]:
    """(path, verdict, ratio) between the native kernel and `other` (the faster of split and If
    per expert) from paired step times: the ratio is the median over rounds of native / other.
    The kernel, the default where it is built, stays unless it takes more than TIE longer."""
    ratio = statistics.median(n / o for n, o in zip(native_ms, other_ms, strict=True))
    name = {"split": "the split", "experts": "the If per expert"}[other]
    if ratio > 1 + TIE:
        return other, f"{name} decoded x{ratio:.2f} the native kernel's speed", ratio
    if ratio < 1 - TIE:
        return "native", f"the native kernel decoded x{1 / ratio:.2f} {name}'s speed", ratio
    return "native", f"no clear difference to {name} (x{ratio:.2f}): the native kernel stays", ratio


def tuned_file(artifact: Artifact) -> Path:
    from moedeploy.runtime.ort import CACHE_DIR

    return artifact.path / CACHE_DIR / TUNED_FILE


def machine_key(artifact: Artifact, threads: int) -> dict[str, Any]:
    """What a record must match to be used: this CPU (model name, vector instruction sets and
    last-level cache: a VM's "AMD EPYC" names CPUs with and without AVX-512), the thread count,
    whether malloc gets huge pages (the split / If ratio moved from 1.06-1.10 to 1.02 with them
    on an AVX2 EPYC), the artifact's model files and the library versions (a new moedeploy or
    ONNX Runtime may change either path)."""
    from moedeploy.bench.machine import cpu_features, cpu_model, last_level_cache_bytes
    from moedeploy.runtime.ort import cache_origin
    from moedeploy.utils import huge_pages

    return {"cpu": cpu_model(), "cpu_features": cpu_features(), "last_level_cache": last_level_cache_bytes(),
            "threads": threads, "huge_pages": huge_pages.this_process(), "origin": cache_origin(artifact),
            "native_kernel": native_kernel()}


def native_kernel() -> str | None:
    """The native kernel's build key where it is built here (its source, flags and this CPU),
    else None: a record made with the kernel, or without it, or with another version of it,
    chose among other paths than a session here would run."""
    from moedeploy.plugins import native

    return native.build_key() if native.available() else None


def _read(path: Path) -> dict[str, Any] | None:
    """The record at `path`, None where there is none; ValueError naming what is wrong with one
    that is not a record `tune` wrote."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable ({e})") from None
    if not isinstance(record, dict) or record.get("format") != TUNED_FORMAT or not isinstance(record.get("entries"), list):
        raise ValueError(f"{path} is not a record `moedeploy tune` wrote (format {TUNED_FORMAT})")
    return record


def tuned_path(artifact: Artifact, threads: int) -> str | None:
    """The path `moedeploy tune` chose for this artifact on this machine at `threads`, or None
    (no record, or none that still describes this machine: said as a warning)."""
    from moedeploy.runtime.ort import MOE_PATHS, cache_link_problem

    path = tuned_file(artifact)
    if not path.exists():
        return None
    try:
        if problem := cache_link_problem(path.parent):
            raise ValueError(problem)
        record = _read(path)
    except ValueError as e:
        _warn_once(path, threads, f"{e}; the default MoE path is used")
        return None
    key = machine_key(artifact, threads)
    entries = [e for e in (record["entries"] if record else []) if isinstance(e, dict) and e.get("path") in MOE_PATHS]
    for entry in entries:
        if all(entry.get(k) == v for k, v in key.items()):
            return entry["path"]
    nearest = min(reversed(entries), key=lambda e: sum(e.get(k) != v for k, v in key.items()), default=None)  # ties: the newest
    _warn_once(path, threads, f"{path} holds no MoE path tuned for this session: {_why_not(nearest, key)}; the "
               f"default is used (`moedeploy tune {artifact.path} --threads {threads}` measures it)")
    return None


def _why_not(entry: dict[str, Any] | None, key: dict[str, Any]) -> str:
    """Why the nearest record does not describe this session, in words a user can act on."""
    if entry is None:
        return "it has no entry"
    if any(entry.get(k) != key[k] for k in ("cpu", "cpu_features", "last_level_cache")):
        return "its entries were measured on other CPUs"
    if entry.get("origin") != key["origin"]:
        return "its entries were measured on other model files or library versions"
    if entry.get("threads") != key["threads"]:
        return f"it was measured at {entry.get('threads')} threads, this session runs {key['threads']}"
    if entry.get("native_kernel") != key["native_kernel"]:
        if entry.get("native_kernel") is None:
            return "it was measured without the native kernel, which is built here now"
        if key["native_kernel"] is None:
            return "it was measured with the native kernel, which is off or not built here"
        return "it was measured with another build of the native kernel (its source changed)"
    return (f"it was measured with huge pages {entry.get('huge_pages')}, this process has {key['huge_pages']} (the "
            "moedeploy command turns them on; a Python process gets them with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 "
            "set before it starts)")


_warned: set[tuple[str, int]] = set()


def _warn_once(path: Path, threads: int, message: str) -> None:
    """A record that does not apply is said once a process, not at every session (serve's instances)."""
    if (str(path), threads) not in _warned:
        _warned.add((str(path), threads))
        log.warning("%s", message)


def write_problem(artifact: Artifact) -> str | None:
    """Why `tune` could not write its record into this artifact, found before any timing."""
    from moedeploy.runtime.ort import cache_link_problem
    from moedeploy.utils.io import new_folder_problem

    path = tuned_file(artifact)
    folder = path.parent
    if problem := cache_link_problem(folder):
        return problem
    if folder.exists() and not folder.is_dir():
        return f"{folder} is not a folder, and moedeploy keeps its caches there; move it away"
    if path.is_symlink() or (path.exists() and not path.is_file()):
        return f"{path} is not a file moedeploy wrote; move it away"
    if path.exists():
        try:
            _read(path)
        except ValueError as e:
            return f"{e}, so tune will not overwrite it; move it away"
    if problem := new_folder_problem(folder if folder.is_dir() else artifact.path):
        return f"cannot write {path}: {problem}"
    return None


#: what Linux says a process can still allocate without swapping (/proc/meminfo, kB)
MEMINFO = "/proc/meminfo"


def available_bytes(meminfo: str | None = None) -> int | None:
    """MemAvailable, in bytes; None where it cannot be read (not Linux)."""
    try:
        with open(meminfo or MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_problem(artifact: Artifact, meminfo: str | None = None) -> str | None:
    """Why tune would run out of memory here, or None: every path's session is open at once (the
    rounds alternate between them), each with its own copy of the weights (the If per expert's
    prepacked, the split's re-laid experts and prepacked rest, the native kernel's experts in
    panels), so it needs about twice the weights, three times where the native kernel is built;
    a large checkpoint would be killed by the kernel minutes in, not refused."""
    from moedeploy.utils.progress import size_text

    sessions = 3 if native_kernel() else 2
    needed, available = sessions * artifact.stored_weight_bytes(), available_bytes(meminfo)
    if available is None or needed <= available:
        return None
    return (f"tune holds {sessions} sessions at once, about {size_text(needed)} for these weights, and this "
            f"machine has {size_text(available)} available; free memory, or choose the path without measuring: "
            "MOEDEPLOY_MOE_PATH=native|split|experts")


def record(artifact: Artifact, threads: int, tuning: Tuning) -> Path:
    """Write `tuning` as this machine's entry, replacing the one with the same key (other machines'
    entries, and ones made with other library versions, which another machine may still run,
    are kept). Atomic: a reader sees the old record or the new one; and locked: of two runs
    recording at once (say for 2 and 4 threads), neither loses the other's entry."""
    from moedeploy.utils.io import atomic_write_json, folder_locked

    if problem := write_problem(artifact):
        raise ValueError(problem)
    path = tuned_file(artifact)
    key = machine_key(artifact, threads)
    entry = {**key, **asdict(tuning), "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path.parent.mkdir(exist_ok=True)
    with folder_locked(path.parent):
        old = _read(path) or {"entries": []}
        kept = [e for e in old["entries"] if isinstance(e, dict) and any(e.get(k) != v for k, v in key.items())]
        atomic_write_json(path, {"format": TUNED_FORMAT, "entries": [*kept, entry]})
    return path


def decode_step_ms(decoder: Any, prompt: Any, tokens: int) -> tuple[float, list[int]]:
    """Milliseconds a decode step over a greedy generation of `tokens` after `prompt` (the
    prefill not timed), and the tokens it decoded."""
    context = prompt.shape[1]
    decoder.reset(1, context + tokens)
    token = decoder.greedy_step(prompt, 0)
    decoded = [int(token[0])]
    start = time.perf_counter()
    for i in range(tokens - 1):
        token = decoder.greedy_step(token.view(1, 1), context + i)
        decoded.append(int(token[0]))
    return (time.perf_counter() - start) / (tokens - 1) * 1e3, decoded


def measure(artifact: Artifact, threads: int, rounds: int, prompt_len: int, new_tokens: int,
            progress: Any = None) -> Tuning:
    """Time the paths in this process (split, If per expert, and the native kernel where it is
    built): a greedy generation each per round, their order reversed every other round, after
    one untimed generation each. ValueError where there is nothing to choose (the experts are not
    cut into pieces at these threads: quantized, or too narrow)."""
    import numpy as np
    import torch

    from moedeploy.runtime.generation import OrtDecoder

    if artifact.kind != "decoder":
        raise ValueError(f"{artifact.path} is not a decoder artifact (it holds a {artifact.kind}); tune chooses "
                         "a decoder's MoE path")
    config = artifact.manifest["config"]
    if prompt_len + new_tokens > config["max_positions"]:
        raise ValueError(f"--prompt-len {prompt_len} and --new-tokens {new_tokens} exceed the model's "
                         f"{config['max_positions']} positions")
    say = progress or (lambda _: None)
    paths = [("split", "auto", threads), ("experts", "auto", 1)] + ([("native", "native", 1)] if native_kernel() else [])
    decoders = {}
    for path, lowering, pieces in paths:  # pieces given: the lowering as named, not the machine's path
        say(f"creating the {path} session")
        decoders[path] = OrtDecoder(artifact, threads=threads, attention_lowering="gqa", logits="greedy",
                                    kv_cache="inplace", moe_lowering=lowering, expert_pieces=pieces)
    if not decoders["split"].lowering.get("moe_split"):
        why = ("its experts are quantized (com.microsoft::QMoE)" if "quantization" in artifact.manifest
               else "sessions at one thread read no record (they take the native kernel where it is built, else "
                    "one If per expert)" if threads < 2
               else f"its experts are not cut into pieces at {threads} threads (plugins/moe_split)")
        raise ValueError(f"nothing to tune in {artifact.path}: {why}")
    prompt = torch.from_numpy(np.random.default_rng(0).integers(0, config["vocab_size"], (1, prompt_len)))
    decoded = {path: decode_step_ms(d, prompt, new_tokens)[1] for path, d in decoders.items()}  # warm-up
    times: dict[str, list[float]] = {path: [] for path in decoders}
    for round_ in range(rounds):
        say(f"round {round_ + 1} of {rounds}")
        for path in (list(decoders) if round_ % 2 == 0 else list(reversed(decoders))):
            times[path].append(decode_step_ms(decoders[path], prompt, new_tokens)[0])
    ms = {path: [round(t, 4) for t in values] for path, values in times.items()}
    # chosen from the times as recorded: anyone can recompute it
    path, verdict, ratio = choose(ms["split"], ms["experts"])
    identical = all(tokens == decoded["split"] for tokens in decoded.values())
    if "native" not in ms:
        return Tuning(path, verdict, ratio, ms["split"], ms["experts"], identical)
    faster = "experts" if ratio > 1 else "split"  # even within the tie that keeps the split as the default
    chosen, native_verdict, native_ratio = choose_native(faster, ms[faster], ms["native"])
    return Tuning(path if chosen != "native" else chosen, f"{verdict}; {native_verdict}", ratio, ms["split"],
                  ms["experts"], identical, ms["native"], native_ratio)
