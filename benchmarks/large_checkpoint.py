#!/usr/bin/env python
"""Peak memory and wall time of export, compare and plain ONNX Runtime on multi-GB checkpoints.

Why: every real MoE checkpoint is far past 2 GB, and a user's machine usually has less memory
than the model several times over (issue 13). This harness produces the figures that issue's
acceptance asks for, the same way before and after the streaming-export rewrite, so the two
can be compared:

1. It generates a Mixtral-shaped Hugging Face checkpoint with transformers (MixtralConfig,
   nothing downloaded): vocab 32000, hidden 1024, intermediate 3072, 8 experts top-2, 16 heads,
   4 KV heads, and the smallest number of layers whose weights reach --size-gb (GB = 1e9
   bytes), in --dtype, as sharded safetensors written by `save_pretrained(...,
   max_shard_size="1GB")` (so model.safetensors.index.json exists). The tensors are made one at
   a time (seeded per name) into the per-expert layout save_pretrained writes by default, so
   generating holds the weights once (no fused-expert copy). Checkpoints are cached under
   --work-dir by a stamp of their parameters and reused when the stamp and config.json match.
2. It runs, each in its own process under `/usr/bin/time -v` (peak RSS) with wall time:
   export with golden outputs, export --no-golden, `compare --backend ort`, and a plain
   onnxruntime.InferenceSession load + one run. Peak RSS is reported in GB and as a ratio to
   max(checkpoint weight bytes, artifact weight bytes). After compare it lists every file in
   the artifact (cache/ and report/ included) other than the weights file that is larger than
   10% of the weight bytes: a second copy of the weights.
3. It prints a Markdown table and writes JSON (--json).

Files it creates live under --work-dir; it removes only folders it created (artifacts unless
--keep; checkpoints only with --remove-checkpoints). A watchdog kills a step whose process tree
passes --max-rss-gb, so a runaway export cannot take the machine down (recorded as killed).

    python benchmarks/large_checkpoint.py --sizes 1,3 --dtype fp32 --work-dir /work/bigckpt \\
        --json large_checkpoint.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 1e9
TIME = "/usr/bin/time"
FORMAT = 1  # bump when the generated checkpoint's contents change for the same parameters
STAMP_FILE = ".large_checkpoint.json"  # written last: a folder without it was not finished
PARTIAL_MARKER = ".large_checkpoint.partial"  # written first into a folder being generated
CREATOR = "moedeploy benchmarks/large_checkpoint.py"
SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
DTYPES = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2), "fp16": ("float16", 2)}
EXTRA_COPY_FRACTION = 0.10
# issue 13's acceptance, shown beside the figures
TARGETS = {
    "export": ("ratio", 1.25, "≤ 1.25×"),
    "export --no-golden": ("gb", 1.5, "< 1.5 GB"),
    "compare --backend ort": ("ratio", 1.5, "≤ 1.5×"),
}


class Fail(Exception):
    """A one-line error for the user."""


# ---------------------------------------------------------------------------- checkpoint shape


def params_per_layer() -> int:
    h, i, e = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_local_experts"]
    head_dim = h // SHAPE["num_attention_heads"]
    q_o = 2 * h * SHAPE["num_attention_heads"] * head_dim
    k_v = 2 * h * SHAPE["num_key_value_heads"] * head_dim
    return q_o + k_v + e * h + e * 3 * h * i + 2 * h  # attention, router, experts, two norms


def params_outside_layers() -> int:
    return 2 * SHAPE["vocab_size"] * SHAPE["hidden_size"] + SHAPE["hidden_size"]  # embed, head, norm


def n_params(layers: int) -> int:
    return params_outside_layers() + layers * params_per_layer()


def layers_for(size_gb: float, dtype: str) -> int:
    """The fewest layers whose weights reach size_gb (at least one)."""
    itemsize = DTYPES[dtype][1]
    need = size_gb * GB / itemsize - params_outside_layers()
    return max(1, math.ceil(need / params_per_layer()))


def checkpoint_params(layers: int, dtype: str, seed: int) -> dict:
    return {**SHAPE, "num_hidden_layers": layers, "dtype": DTYPES[dtype][0], "seed": seed,
            "format": FORMAT}


def stamp_of(params: dict) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------- generation


def generate(folder: Path, layers: int, dtype: str, seed: int) -> None:
    """Runs in its own process (under /usr/bin/time): write the checkpoint into `folder`.

    The model is built on the meta device (no memory); transformers' own reverse conversion of
    that meta model gives the names and shapes save_pretrained writes by default (per-expert
    w1/w2/w3). Each tensor is then allocated and filled alone, seeded by its name, and the
    state dict is handed to save_pretrained, which writes 1 GB shards and the index. Reverting
    a real model instead would copy the fused expert weights (about 1.5x the checkpoint)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    torch_dtype = getattr(torch, DTYPES[dtype][0])
    config = MixtralConfig(**SHAPE, num_hidden_layers=layers, dtype=torch_dtype)
    with torch.device("meta"):
        model = MixtralForCausalLM(config).to(torch_dtype)
    layout = {k: (tuple(v.shape), v.dtype) for k, v in
              revert_weight_conversion(model, model.state_dict()).items()}
    total = sum(math.prod(shape) * DTYPES[dtype][1] for shape, _ in layout.values())
    if total != n_params(layers) * DTYPES[dtype][1]:
        raise Fail(f"transformers' Mixtral layout has {total} bytes, this script expected "
                   f"{n_params(layers) * DTYPES[dtype][1]}: update params_per_layer()")
    std = config.initializer_range
    state: dict[str, torch.Tensor] = {}
    for i, (name, (shape, tensor_dtype)) in enumerate(sorted(layout.items())):
        tensor = torch.empty(shape, dtype=tensor_dtype)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            key = int(hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()[:15], 16)
            tensor.normal_(0.0, std, generator=torch.Generator().manual_seed(key))
        state[name] = tensor
        if i % 50 == 0:
            print(f"generating: {i}/{len(layout)} tensors", flush=True)
    # 1 GB shards; a checkpoint smaller than that is still split in two, so an index exists
    shard = "1GB" if total > GB else total // 2 + 1
    model.save_pretrained(folder, state_dict=state, max_shard_size=shard,
                          save_original_format=False)  # the state is already in that format


def checkpoint_problem(folder: Path, params: dict, nbytes: int) -> str | None:
    """Why `folder` is not the finished checkpoint for `params` (None when it is)."""
    try:
        stamp = json.loads((folder / STAMP_FILE).read_text())
        config = json.loads((folder / "config.json").read_text())
        index = json.loads((folder / "model.safetensors.index.json").read_text())
    except (OSError, ValueError) as e:
        return f"unreadable ({e.__class__.__name__}: {e})"
    if stamp.get("params") != params:
        return "its stamp records other parameters"
    for key, want in params.items():
        if key not in ("seed", "format") and config.get(key) != want:
            return f"config.json has {key}={config.get(key)!r}, expected {want!r}"
    if index.get("metadata", {}).get("total_size") != nbytes:
        return f"index total_size {index.get('metadata', {}).get('total_size')} != {nbytes}"
    for shard in sorted(set(index["weight_map"].values())):
        if not (folder / shard).is_file():
            return f"shard {shard} is missing"
        if (folder / shard).stat().st_size != stamp.get("shards", {}).get(shard):
            return f"shard {shard} has another size than when it was written"
    return None


def ensure_checkpoint(work: Path, size_gb: float, dtype: str, seed: int, args) -> dict:
    """The cached checkpoint for these parameters, generated (and measured) when absent."""
    layers = layers_for(size_gb, dtype)
    params = checkpoint_params(layers, dtype, seed)
    nbytes = n_params(layers) * DTYPES[dtype][1]
    folder = work / "checkpoints" / f"mixtral-{layers}L-{dtype}-seed{seed}-{stamp_of(params)}"
    info = {"path": str(folder), "layers": layers, "dtype": dtype, "bytes": nbytes,
            "params": n_params(layers), "generated": False}
    print(f"checkpoint for --size-gb {size_gb:g} {dtype}: {layers} layers, {nbytes} bytes "
          f"({nbytes / GB:.3f} GB, {n_params(layers)} parameters)", flush=True)
    if folder.exists():
        if not (folder / STAMP_FILE).is_file():
            raise Fail(f"{folder} exists but was not made by this script; remove it yourself "
                       f"or use another --work-dir")
        problem = checkpoint_problem(folder, params, nbytes)
        if problem is None:
            print(f"  reusing {folder}", flush=True)
            return info
        print(f"  {folder} (made by this script) does not match: {problem}; regenerating",
              flush=True)
        shutil.rmtree(folder)
    partial = folder.with_name(folder.name + ".partial")
    if partial.exists():
        if not (partial / PARTIAL_MARKER).is_file():
            raise Fail(f"{partial} exists but was not made by this script; remove it yourself")
        shutil.rmtree(partial)  # left by an interrupted run of this script
    need = nbytes + plan_artifact_bytes(nbytes, dtype, args) + int(GB)
    check_disk(work, need, f"the {nbytes / GB:.2f} GB checkpoint and its artifacts")
    partial.mkdir(parents=True)
    (work / "logs").mkdir(exist_ok=True)
    (partial / PARTIAL_MARKER).write_text(CREATOR + "\n")
    argv = [sys.executable, str(Path(__file__).resolve()), "--generate-into", str(partial),
            "--generate-layers", str(layers), "--dtype", dtype, "--seed", str(seed)]
    step = measure("generate checkpoint", argv, work / "logs" / f"generate-{folder.name}.log", args)
    if step["exit_code"] != 0:
        shutil.rmtree(partial)
        raise Fail(f"generating the checkpoint failed ({step['status']}); log: {step['log']}")
    index = json.loads((partial / "model.safetensors.index.json").read_text())
    shards = {s: (partial / s).stat().st_size for s in sorted(set(index["weight_map"].values()))}
    stamp = {"created_by": CREATOR, "params": params, "bytes": nbytes, "shards": shards,
             "created": datetime.datetime.now().isoformat(timespec="seconds")}
    (partial / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
    (partial / PARTIAL_MARKER).unlink()
    partial.rename(folder)
    problem = checkpoint_problem(folder, params, nbytes)
    if problem:
        raise Fail(f"the checkpoint just written does not check out: {problem}")
    step["ratio"] = step["peak_rss_gb"] * GB / nbytes if step["peak_rss_gb"] else None
    info.update(generated=True, generation=step, shards=shards)
    print(f"  generated {folder}: {len(shards)} shards, peak RSS {step['peak_rss_gb']:.2f} GB "
          f"({step['ratio']:.2f}x), {step['wall_s']:.0f} s", flush=True)
    return info


# ---------------------------------------------------------------------------- measuring


def plan_artifact_bytes(ckpt_bytes: int, ckpt_dtype: str, args) -> int:
    """Disk the artifacts of one size may take: each export, plus a copy compare may cache."""
    art = ckpt_bytes // DTYPES[ckpt_dtype][1] * DTYPES[args.export_dtype or ckpt_dtype][1]
    return int(3.1 * art)


def check_disk(where: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(where).free
    if free < need:
        raise Fail(f"not enough disk under {where}: {what} need about {need / GB:.1f} GB, "
                   f"{free / GB:.1f} GB free")


def session_rss_kb(sid: int) -> int:
    """Resident memory of every process in session `sid` (the step's tree), in KiB."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) != sid:  # state ppid pgrp session ...
                continue
            total += int(Path(entry.path, "statm").read_text().split()[1]) * os.sysconf(
                "SC_PAGE_SIZE") // 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


def measure(name: str, argv: list[str], log: Path, args, shown: str | None = None) -> dict:
    """Run argv under /usr/bin/time -v in its own session; peak RSS, wall time, exit code.
    `shown` stands for argv in what is printed and recorded (for a long python -c script)."""
    time_report = log.with_suffix(".time")
    shown = shown or shlex.join(argv)
    print(f"[{name}] {shown}", flush=True)
    start = time.perf_counter()
    limit_kb = args.max_rss_gb * GB / 1024
    killed = None
    sampled_peak = 0
    with open(log, "wb") as out:
        proc = subprocess.Popen([TIME, "-v", "-o", str(time_report), *argv], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            rss = session_rss_kb(proc.pid)
            sampled_peak = max(sampled_peak, rss)
            elapsed = time.perf_counter() - start
            if rss > limit_kb or elapsed > args.timeout_s:
                killed = (f"killed by this harness: process tree at {rss * 1024 / GB:.1f} GB > "
                          f"--max-rss-gb {args.max_rss_gb:g}" if rss > limit_kb else
                          f"killed by this harness after --timeout-s {args.timeout_s}")
                os.killpg(proc.pid, signal.SIGKILL)  # the session this call started
                proc.wait()
                break
            time.sleep(0.25)
    wall = time.perf_counter() - start
    report = time_report.read_text() if time_report.is_file() else ""
    peak_kb = exit_code = None
    for line in report.splitlines():
        line = line.strip()
        if line.startswith("Maximum resident set size (kbytes):"):
            peak_kb = int(line.rsplit(":", 1)[1])
        elif line.startswith("Exit status:"):
            exit_code = int(line.rsplit(":", 1)[1])
        elif line.startswith("Command terminated by signal"):
            exit_code = -int(line.rsplit(" ", 1)[1])
    if exit_code is None:
        exit_code = proc.returncode
    if peak_kb is None:  # killed with time itself: what the watchdog saw is all there is
        peak_kb = sampled_peak
    tail = [t for t in log.read_text(errors="replace").splitlines() if t.strip()]
    errors = [t for t in tail if t.lstrip().lower().startswith("error")]
    last = (errors or tail or [""])[-1].strip()
    status = killed or ("ok" if exit_code == 0 else f"exit {exit_code}: {last[:300]}")
    step = {"command": shown, "exit_code": exit_code, "wall_s": round(wall, 1),
            "peak_rss_gb": round(peak_kb * 1024 / GB, 3),
            "sampled_tree_peak_rss_gb": round(sampled_peak * 1024 / GB, 3),
            "status": status, "last_line": last[:1000], "log": str(log)}
    print(f"[{name}] exit {exit_code}, peak RSS {step['peak_rss_gb']:.2f} GB, {wall:.0f} s"
          + ("" if status == "ok" else f" -- {status}"), flush=True)
    return step


ORT_RUN = r"""
import json, sys, time
import numpy as np
import onnxruntime as ort
path, vocab = sys.argv[1], int(sys.argv[2])
dims = {"batch": 1, "seq": 8, "past_seq": 8}
start = time.perf_counter()
session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
load_s = time.perf_counter() - start
rng = np.random.default_rng(0)
kinds = {"tensor(int64)": np.int64, "tensor(float)": np.float32, "tensor(float16)": np.float16}
feeds = {}
for i in session.get_inputs():
    shape = [d if isinstance(d, int) else dims.get(d, 1) for d in i.shape]
    if i.type not in kinds:
        raise SystemExit(f"error: input {i.name} is {i.type}, which this probe cannot feed")
    if i.type == "tensor(int64)":
        feeds[i.name] = rng.integers(0, vocab, size=shape, dtype=np.int64)
    else:
        feeds[i.name] = (rng.standard_normal(shape) * 0.1).astype(kinds[i.type])
start = time.perf_counter()
outputs = session.run(None, feeds)
run_s = time.perf_counter() - start
print(json.dumps({"load_s": round(load_s, 2), "run_s": round(run_s, 3),
                  "output0_shape": list(outputs[0].shape),
                  "output0_finite": bool(np.isfinite(outputs[0].astype(np.float32)).all())}))
"""


def artifact_files(out: Path, weight_bytes: int) -> dict:
    """Sizes under the artifact, and any file besides the weights file that could be a second
    copy of the weights (> EXTRA_COPY_FRACTION of them). The weights file is model.onnx.data
    when there is one, otherwise model.onnx (weights inline, as under 2 GB today)."""
    files = {p.relative_to(out).as_posix(): p.stat().st_size for p in out.rglob("*")
             if p.is_file()}
    primary = "model.onnx.data" if "model.onnx.data" in files else "model.onnx"
    threshold = EXTRA_COPY_FRACTION * weight_bytes
    extra = {f: n for f, n in sorted(files.items()) if f != primary and n > threshold}
    return {"total_bytes": sum(files.values()), "weights_file": primary,
            "weights_file_bytes": files.get(primary), "extra_copies": extra,
            "second_copy_of_weights": bool(extra), "files": len(files)}


def run_size(size_gb: float, args, work: Path) -> dict:
    ckpt = ensure_checkpoint(work, size_gb, args.dtype, args.seed, args)
    export_dtype = args.export_dtype or args.dtype
    art_bytes = ckpt["params"] * DTYPES[export_dtype][1]
    denominator = max(ckpt["bytes"], art_bytes)
    result = {"size_gb": size_gb, "checkpoint": ckpt, "export_dtype": export_dtype,
              "artifact_weight_bytes": art_bytes, "ratio_denominator_bytes": denominator,
              "steps": {}}
    check_disk(work, plan_artifact_bytes(ckpt["bytes"], args.dtype, args) + int(GB),
               "the artifacts")
    runs = work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{Path(ckpt['path']).name}-{export_dtype}-",
                                    dir=runs))
    result["run_dir"] = str(run_dir)
    logs = work / "logs" / run_dir.name  # small; they outlive the artifacts
    logs.mkdir(parents=True)
    md = shlex.split(args.moedeploy) if args.moedeploy else [sys.executable, "-m", "moedeploy.cli"]
    steps = result["steps"]

    def record(name: str, step: dict) -> dict:
        if step.get("peak_rss_gb") is not None:
            step["ratio"] = round(step["peak_rss_gb"] * GB / denominator, 3)
        steps[name] = step
        return step

    try:
        outs = {}
        for name, extra in (("export", []), ("export --no-golden", ["--no-golden"])):
            out = run_dir / ("artifact" if not extra else "artifact-no-golden")
            argv = [*md, "export", "decoder", "--checkpoint", ckpt["path"], "--out", str(out),
                    "--dtype", export_dtype, *extra]
            step = measure(name, argv, logs / f"{name.replace(' --', '-')}.log", args)
            if extra and step["exit_code"] == 2 and "no-golden" in step["last_line"] + \
                    Path(step["log"]).read_text(errors="replace")[-2000:]:
                step["status"] = "not supported by this moedeploy"
            if step["exit_code"] == 0 and (out / "model.onnx").is_file():
                step["artifact"] = artifact_files(out, art_bytes)
                outs[name] = out
            record(name, step)
        target = outs.get("export") or outs.get("export --no-golden")
        if target is None:
            for name in ("compare --backend ort", "onnxruntime session"):
                steps[name] = {"status": "skipped: no export succeeded", "exit_code": None,
                               "peak_rss_gb": None, "wall_s": None}
        else:
            result["measured_artifact"] = str(target)
            step = record("compare --backend ort", measure(
                "compare --backend ort", [*md, "compare", str(target), "--backend", "ort"],
                logs / "compare.log", args))
            step["artifact_after"] = artifact_files(target, art_bytes)
            step = record("onnxruntime session", measure(
                "onnxruntime session", [sys.executable, "-c", ORT_RUN, str(target / "model.onnx"),
                                        str(SHAPE["vocab_size"])], logs / "ort.log", args,
                shown=f"python -c <ORT_RUN: InferenceSession + one run> {target / 'model.onnx'}"))
            try:
                step["result"] = json.loads(step["last_line"]) if step["exit_code"] == 0 else None
            except ValueError:
                step["result"] = None
    finally:
        if args.keep:
            print(f"kept {run_dir}", flush=True)
        else:
            shutil.rmtree(run_dir)  # made by mkdtemp above
            result["run_dir_removed"] = True
        if args.remove_checkpoints and ckpt["generated"]:
            shutil.rmtree(ckpt["path"])
            ckpt["removed"] = True
    return result


# ---------------------------------------------------------------------------- reporting


def environment(args) -> dict:
    md_root = None
    probe = subprocess.run(
        [sys.executable, "-c", "import moedeploy, onnxruntime, torch, transformers; "
         "print(moedeploy.__file__, moedeploy.__version__, onnxruntime.__version__, "
         "torch.__version__, transformers.__version__)"],
        capture_output=True, text=True)
    versions = {}
    if probe.returncode == 0:
        path, *v = probe.stdout.split()
        versions = dict(zip(["moedeploy", "onnxruntime", "torch", "transformers"], v, strict=True))
        md_root = Path(path).parent
        commit = subprocess.run(["git", "-C", str(md_root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(md_root), "status", "--porcelain", "."],
                               capture_output=True, text=True)
        if commit.returncode == 0:
            versions["moedeploy_commit"] = commit.stdout.strip() + (
                "+dirty" if dirty.stdout.strip() else "")
    mem = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        if key in ("MemTotal", "MemAvailable"):
            mem[key] = round(int(value.split()[0]) * 1024 / GB, 1)
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    return {"date": datetime.date.today().isoformat(), "cpu": cpu, "cores": os.cpu_count(),
            "memory_gb": mem, "python": platform.python_version(),
            "moedeploy_source": str(md_root), **versions,
            "moedeploy_command": args.moedeploy or f"{sys.executable} -m moedeploy.cli"}


def target_note(name: str, step: dict) -> str:
    if name not in TARGETS or step.get("exit_code") != 0:
        return ""
    kind, bound, label = TARGETS[name]
    value = step["ratio"] if kind == "ratio" else step["peak_rss_gb"]
    return f"{label}: {'met' if value <= bound else 'not met'}"


def markdown(results: list[dict]) -> str:
    rows = ["| checkpoint | step | exit | peak RSS GB | × weights | wall s | note |",
            "|---|---|---:|---:|---:|---:|---|"]
    for r in results:
        c = r["checkpoint"]
        label = f"{c['bytes'] / GB:.2f} GB {c['dtype']} ({c['layers']} layers) → {r['export_dtype']}"
        gen = c.get("generation")
        if gen:
            rows.append(f"| {label} | generate checkpoint | {gen['exit_code']} | "
                        f"{gen['peak_rss_gb']:.2f} | {gen['ratio']:.2f} | {gen['wall_s']:.0f} | |")
        for name, s in r["steps"].items():
            peak = "" if s.get("peak_rss_gb") is None else f"{s['peak_rss_gb']:.2f}"
            ratio = "" if s.get("ratio") is None else f"{s['ratio']:.2f}"
            wall = "" if s.get("wall_s") is None else f"{s['wall_s']:.0f}"
            exit_code = "" if s.get("exit_code") is None else s["exit_code"]
            note = s["status"] if s["status"] != "ok" else target_note(name, s)
            if name == "compare --backend ort" and "artifact_after" in s:
                a = s["artifact_after"]
                copies = ", ".join(f"{f} ({n / GB:.2f} GB)" for f, n in a["extra_copies"].items())
                note = "; ".join(x for x in (note, f"artifact {a['total_bytes'] / GB:.2f} GB, "
                                 f"second copy of the weights: {copies or 'none'}") if x)
            if name == "onnxruntime session" and s.get("result"):
                note = "; ".join(x for x in (note, f"load {s['result']['load_s']} s, run "
                                 f"{s['result']['run_s']} s") if x)
            rows.append(f"| {label} | {name} | {exit_code} | {peak} | {ratio} | {wall} | "
                        f"{note.replace('|', '/')} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Ratios are peak RSS / max(checkpoint weight bytes, artifact weight bytes). "
               "GB = 1e9 bytes.")
    parser.add_argument("--size-gb", type=float, default=None,
                        help="One checkpoint size in GB (e.g. 1 or 3); same as --sizes N.")
    parser.add_argument("--sizes", default=None,
                        help="Comma-separated sizes in GB, run in turn (default: 1).")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16",
                        help="The checkpoint's torch_dtype (default bf16, as real ones are).")
    parser.add_argument("--export-dtype", choices=["fp32", "fp16", "bf16"], default=None,
                        help="moedeploy export --dtype (default: the checkpoint's dtype).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the generated weights.")
    parser.add_argument("--work-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "moedeploy-large-checkpoint",
                        help="Where checkpoints (cached) and artifacts go.")
    parser.add_argument("--moedeploy", default=None,
                        help="The moedeploy command (default: this Python's -m moedeploy.cli).")
    parser.add_argument("--json", default=None, help="Write the results here.")
    parser.add_argument("--keep", action="store_true",
                        help="Keep the artifacts (default: remove them after measuring).")
    parser.add_argument("--remove-checkpoints", action="store_true",
                        help="Also remove checkpoints this run generated (default: cache them).")
    parser.add_argument("--max-rss-gb", type=float, default=None,
                        help="Kill a step whose process tree passes this (default: 90%% of the "
                             "memory available at start).")
    parser.add_argument("--timeout-s", type=int, default=3 * 3600, help="Per step.")
    parser.add_argument("--generate-into", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--generate-layers", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    try:
        if args.generate_into:  # the child process that writes a checkpoint
            generate(args.generate_into, args.generate_layers, args.dtype, args.seed)
            return
        run(args)
    except Fail as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("error: interrupted")


def run(args) -> None:
    if args.size_gb is not None and args.sizes is not None:
        raise Fail("give --size-gb or --sizes, not both")
    try:
        raw = args.sizes if args.sizes is not None else str(args.size_gb or 1)
        sizes = [float(s) for s in raw.split(",") if s.strip()]
    except ValueError:
        raise Fail(f"--sizes must be comma-separated numbers, got {args.sizes!r}") from None
    if not sizes or min(sizes) <= 0:
        raise Fail("sizes must be positive")
    if not (os.access(TIME, os.X_OK) and "Maximum resident set size" in subprocess.run(
            [TIME, "-v", "true"], capture_output=True, text=True).stderr):
        raise Fail(f"GNU time is needed at {TIME} for peak RSS (apt-get install time)")
    if args.max_rss_gb is None:
        available = next(int(line.split()[1]) for line in
                         Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemAvailable:"))
        args.max_rss_gb = round(0.9 * available * 1024 / GB, 1)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    env = environment(args)
    if "moedeploy" not in env:
        raise Fail(f"{sys.executable} cannot import moedeploy, onnxruntime, torch and "
                   f"transformers (set PYTHONPATH or use the project's venv)")
    print(f"moedeploy {env.get('moedeploy')} ({env.get('moedeploy_commit', '?')}) from "
          f"{env['moedeploy_source']}; watchdog at {args.max_rss_gb:g} GB", flush=True)
    results = []
    for size in sizes:
        results.append(run_size(size, args, args.work_dir))
        if args.json:  # after every size, so a later failure keeps what was measured
            Path(args.json).write_text(json.dumps(
                {"environment": env, "command": shlex.join(sys.argv), "results": results},
                indent=2) + "\n")
    print()
    print(markdown(results))
    if args.json:
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
