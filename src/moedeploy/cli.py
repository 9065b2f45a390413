"""The `moedeploy` command: a thin layer over the Python API, one function per subcommand.

Errors a user can cause (bad names, unreadable checkpoints, unwritable paths) print one
line naming the problem and the fix and exit 1; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(
    name="moedeploy",
    help=(
        "Export PyTorch transformer blocks and MoE decoders to ONNX Runtime and TensorRT, "
        "and prove every step matches eager PyTorch."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
err = Console(stderr=True)
out = Console()
_state = {"debug": False}

F = TypeVar("F", bound=Callable[..., Any])


class UserError(Exception):
    """An error whose message is the whole story for the user."""


def _user_errors() -> tuple[type[BaseException], ...]:
    from moedeploy.export import ArtifactError, ExportError
    from moedeploy.models import CheckpointError
    from moedeploy.runtime.lowering import LoweringError
    from moedeploy.runtime.ort import SessionError
    from moedeploy.runtime.tensorrt import TensorRTUnavailable

    return (
        UserError, ValueError, OSError, CheckpointError, ArtifactError, ExportError, SessionError,
        LoweringError, TensorRTUnavailable,
    )


def handle_errors(fn: F) -> F:
    """One clear line and exit code 1 for expected failures; a traceback only with --debug."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except BrokenPipeError:  # `moedeploy export --list | head`: the reader left, not an error
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (keep Python's exit flush quiet)
            raise typer.Exit(0) from None
        except KeyboardInterrupt:
            err.print("[red]interrupted[/red]")
            raise typer.Exit(130) from None
        except Exception as e:
            if _state["debug"] or not isinstance(e, _user_errors()):
                raise
            message = str(e) if not isinstance(e, OSError) else f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")
            err.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
) -> None:
    """[bold]moedeploy[/bold]: model -> ONNX artifact -> ONNX Runtime / TensorRT -> compare, serve, bench.

    Start with [cyan]moedeploy export --list[/cyan], then
    [cyan]moedeploy export moe --out artifacts/moe[/cyan].
    """
    _state["debug"] = debug


def check_writable(path: Path) -> None:
    """Fail before any work if `path` cannot become a folder we write."""
    if path.exists() and not path.is_dir():
        raise UserError(f"output path {path} exists and is not a folder; choose another --out")
    ancestor = next(p for p in path.parents if p.exists())
    problem = None
    if not ancestor.is_dir():
        problem = f"{ancestor} is not a folder"
    else:
        try:  # os.access says yes to root everywhere; a real probe does not lie
            os.rmdir(tempfile.mkdtemp(prefix=".moedeploy-probe-", dir=ancestor))
        except OSError as e:
            problem = f"{ancestor} is not writable ({e.strerror})"
    if problem:
        raise UserError(f"cannot write to {path}: {problem}; choose another --out")


@app.command()
@handle_errors
def version() -> None:
    """Print the versions of moedeploy and the libraries it uses."""
    from moedeploy.export.exporter import library_versions

    for name, v in library_versions().items():
        out.print(f"{name} {v}", highlight=False)


@app.command("export")
@handle_errors
def export_cmd(
    target: str = typer.Argument(None, help="A block name (see --list) or 'decoder'.", show_default=False),
    out_dir: Path = typer.Option(None, "--out", "-o", help="Artifact folder to write (replaced atomically)."),
    list_blocks: bool = typer.Option(False, "--list", help="List the exportable blocks, one per line, name first."),
    preset_name: str = typer.Option("tiny", "--preset", help="Decoder preset when no --checkpoint: tiny or small."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="Hugging Face Mixtral or moedeploy checkpoint folder (decoder only)."),
    dtype: str = typer.Option("fp32", "--dtype", help="Graph precision: fp32, fp16 or bf16."),
    fold_bn: bool = typer.Option(True, "--fold-bn/--no-fold-bn", help="Fold BatchNorm (frozen EMA stats) into Linear / scale+shift."),
    calibration_batches: int = typer.Option(8, "--calibration-batches", help="Train-mode batches that update BatchNorm EMA stats before freezing."),
    seed: int = typer.Option(0, "--seed", help="Seed for random weights and golden inputs."),
) -> None:
    """Export a block or the MoE decoder to an artifact folder.

    The folder holds [bold]model.onnx[/bold] (opset 23, custom moe::RMSNorm / moe::MoE nodes with
    standard-op function bodies), [bold]manifest.json[/bold] and [bold]golden/[/bold] eager-PyTorch I/O.

    Examples:
      moedeploy export --list
      moedeploy export rmsnorm --out artifacts/rmsnorm --dtype fp16
      moedeploy export decoder --preset small --out artifacts/decoder
      moedeploy export decoder --checkpoint ./mixtral-tiny --out artifacts/mixtral
    """
    from moedeploy.export import BLOCKS, DECODER, export, parse_dtype
    from moedeploy.models import PRESETS

    if list_blocks:  # plain lines for scripts: name, a tab, what it is
        for name, spec in BLOCKS.items():
            typer.echo(f"{name}\t{spec.summary}")
        typer.echo(f"{DECODER}\tMoE decoder LM with KV cache (--preset or --checkpoint)")
        return
    if target is None:
        raise UserError("name a block or 'decoder' to export (see `moedeploy export --list`)")
    if target != DECODER and target not in BLOCKS:
        raise UserError(f"unknown block {target!r}; run `moedeploy export --list` to see the exportable blocks")
    if out_dir is None:
        raise UserError("missing --out DIR: the artifact folder to write")
    parse_dtype(dtype)
    if preset_name not in PRESETS:
        raise UserError(f"unknown preset {preset_name!r}; choose one of: {', '.join(PRESETS)}")
    check_writable(out_dir)

    with err.status(f"exporting {target}", spinner="dots") as status:
        def progress(stage: str) -> None:
            status.update(f"{target}: {stage}")
            if err.is_terminal:  # a log or a pipe gets only the outcome (and errors, one line)
                err.print(f"  [dim]•[/dim] {escape(stage)}", highlight=False, soft_wrap=True)

        artifact = export(
            target, out_dir, preset_name=preset_name, checkpoint=checkpoint, dtype=dtype,
            fold_bn=fold_bn, calibration_batches=calibration_batches, seed=seed, progress=progress,
        )
    ops = ", ".join(f"{o['domain']}::{o['op_type']} x{o['count']}" for o in artifact.manifest["custom_ops"]) or "none"
    size = artifact.model_path.stat().st_size / 1e6
    out.print(f"[green]exported[/green] {target} ({dtype}) -> {artifact.path}  [{size:.1f} MB, custom ops: {ops}]", highlight=False)


def _split_backends(value: str) -> list[str]:
    backends = [b.strip() for b in value.split(",") if b.strip()]
    if not backends:
        raise UserError("--backend needs at least one of: ort, trt")
    for b in backends:
        if b not in ("ort", "trt"):
            raise UserError(f"unknown backend {b!r} in --backend; choose from: ort, trt")
    return backends


def _print_report(report: dict) -> None:
    from rich.table import Table

    for c in report["comparisons"]:
        table = Table(title=f"{c['backend']} vs {c['reference']}", title_justify="left")
        for col in ("output", "max abs", "p99 abs", "max rel", "cosine", "atol", "rtol", "result"):
            table.add_column(col, justify="left" if col == "output" else "right")
        for name, st in c["outputs"].items():
            if st.get("shape_mismatch"):
                table.add_row(name, "shape mismatch", "", "", "", "", "", "[red]FAIL[/red]")
                continue
            table.add_row(
                name, f"{st['max_abs']:.2e}", f"{st['p99_abs']:.2e}", f"{st['max_rel']:.2e}", f"{st['cosine']:.8f}",
                f"{st['atol']:.0e}", f"{st['rtol']:.0e}", "[green]pass[/green]" if st["passed"] else "[red]FAIL[/red]",
            )
        out.print(table)
    if report.get("first_divergent_layer"):
        from moedeploy.compare.report import divergence_note, plain, routing_note

        if report["passed"]:  # outputs pass: the module named is inside the network (see divergence_note)
            out.print(f"[yellow]note:[/yellow] {escape(divergence_note(report, plain) or '')}", highlight=False)
        else:
            out.print(f"[red]first divergent layer:[/red] {report['first_divergent_layer']} "
                      f"(module {report['first_divergent_module']})", highlight=False)
        if note := routing_note(report, plain):
            out.print(escape(note), highlight=False)


@app.command("compare")
@handle_errors
def compare_cmd(
    artifact: Path = typer.Argument(..., help="Artifact folder made by `moedeploy export`."),
    backend: str = typer.Option("ort", "--backend", help="Comma-separated backends to check against eager PyTorch: ort, trt."),
    atol: float = typer.Option(None, "--atol", help="Absolute tolerance for every output (default: the manifest's, by dtype)."),
    rtol: float = typer.Option(None, "--rtol", help="Relative tolerance for every output (default: the manifest's, by dtype)."),
    iterations: int = typer.Option(4, "--iterations", help="Seeded random inputs; the first uses each dynamic dim's opt size."),
    seed: int = typer.Option(0, "--seed", help="Seed for the input data."),
    layerwise: bool = typer.Option(False, "--layerwise", help="Localise the first divergent layer even when outputs pass."),
    checkpoint: Path = typer.Option(
        None, "--checkpoint",
        help="Decoder exported from a checkpoint: the checkpoint's folder, if it moved since export "
        "(refused unless its weights match the manifest's fingerprint).",
    ),
) -> None:
    """Compare an artifact's backends with eager PyTorch (Polygraphy), write <artifact>/report/.

    Exit code 1 when any output is out of tolerance, so it can gate CI. The report folder holds
    report.json / report.md / report.html and Polygraphy's run_results.json and accuracy.json.
    """
    from moedeploy.compare.api import compare

    backends = _split_backends(backend)
    with err.status("comparing", spinner="dots") as status:
        report = compare(
            artifact, backends, atol=atol, rtol=rtol, iterations=iterations, seed=seed,
            layerwise=layerwise, progress=lambda stage: status.update(stage), checkpoint=checkpoint,
        )
    _print_report(report)
    verdict = "[green]PASS[/green]" if report["passed"] else "[red]FAIL[/red]"
    out.print(f"{verdict} report: {Path(artifact) / 'report' / 'report.html'}", highlight=False)
    if not report["passed"]:
        raise typer.Exit(1)


@app.command("all")
@handle_errors
def all_cmd(
    out_dir: Path = typer.Option(Path("out"), "--out", "-o", help="Folder for every artifact, its report and index.html."),
    backend: str = typer.Option(None, "--backend", help="Backends to compare (default: ort, plus trt when TensorRT is installed)."),
    dtype: str = typer.Option("fp32", "--dtype", help="Graph precision: fp32, fp16 or bf16."),
    preset_name: str = typer.Option("tiny", "--preset", help="Decoder preset: tiny or small."),
    iterations: int = typer.Option(3, "--iterations", help="Seeded random inputs per comparison."),
    seed: int = typer.Option(0, "--seed", help="Seed for weights and inputs."),
) -> None:
    """Export every block and the decoder, compare each on every backend, write <out>/index.html.

    The README's main job: proves, end to end, that every exported graph matches eager PyTorch.
    Exit code 1 when anything fails.
    """
    from rich.table import Table

    from moedeploy.compare.suite import run_all
    from moedeploy.export import parse_dtype
    from moedeploy.models import PRESETS

    parse_dtype(dtype)
    if preset_name not in PRESETS:
        raise UserError(f"unknown preset {preset_name!r}; choose one of: {', '.join(PRESETS)}")
    backends = _split_backends(backend) if backend else None
    check_writable(out_dir)
    with err.status("moedeploy all", spinner="dots") as status:
        summary = run_all(out_dir, backends, dtype, preset_name, iterations, seed, progress=lambda s: status.update(s))
    table = Table(title=f"moedeploy all ({', '.join(summary['backends'])}, {dtype})", title_justify="left")
    for col in ("artifact", "result", "max abs error", "first divergent layer", "s"):
        table.add_column(col, justify="right" if col in ("max abs error", "s") else "left")
    for r in summary["results"]:
        result = "[green]pass[/green]" if r["passed"] else "[red]FAIL[/red]"
        error = f"{r['max_abs']:.2e}" if r.get("max_abs") is not None else (r.get("error") or "").split("\n")[0][:60]
        table.add_row(r["name"], result, error, r.get("first_divergent_layer") or "", f"{r['seconds']:.1f}")
    out.print(table)
    for r in summary["results"]:
        if r.get("note"):
            out.print(f"[yellow]note:[/yellow] {r['name']}: {escape(r['note'])} See {out_dir / r['report']}.", highlight=False)
    passed = sum(r["passed"] for r in summary["results"])
    verdict = "[green]PASS[/green]" if summary["passed"] else "[red]FAIL[/red]"
    out.print(f"{verdict} {passed}/{len(summary['results'])} match eager PyTorch; index: {out_dir / 'index.html'}", highlight=False)
    if not summary["passed"]:
        raise typer.Exit(1)


@app.command("build")
@handle_errors
def build_cmd(
    artifact: Path = typer.Argument(..., help="Artifact folder made by `moedeploy export`."),
    aot: bool = typer.Option(True, "--aot/--jit", help="AOT plugins (engine runs without Python) or JIT plugins (Python at run time)."),
    workspace: int = typer.Option(None, "--workspace", help="Builder workspace limit in MB (default: TensorRT's)."),
    timing_cache: Path = typer.Option(None, "--timing-cache", help="Timing cache file to read and update (speeds up rebuilds)."),
) -> None:
    """Build a TensorRT engine from an artifact, with the moe::RMSNorm / moe::MoE plugins.

    One optimisation profile from the manifest's min/opt/max dynamic ranges; a strongly typed
    network, so the precision is the graph's (export with --dtype fp16/bf16 for half precision).
    Writes <artifact>/engines/<gpu>_trt<version>_<dtype>_<aot|jit>.plan with its build log and metadata.
    Needs TensorRT and an NVIDIA GPU.
    """
    from moedeploy.export import Artifact
    from moedeploy.runtime.tensorrt import build_engine, require_gpu, require_tensorrt

    loaded = Artifact.load(artifact)
    require_tensorrt()
    require_gpu()
    if workspace is not None and workspace <= 0:
        raise UserError("--workspace must be a positive number of MB")
    with err.status(f"building a TensorRT engine for {loaded.name}", spinner="dots"):
        result = build_engine(loaded, aot=aot, workspace_mb=workspace, timing_cache=timing_cache)
    out.print(f"[green]built[/green] {result.plan} (log: {result.log.name})", highlight=False)


@app.command("check")
@handle_errors
def check_cmd(
    artifact: Path = typer.Argument(..., help="Artifact folder made by `moedeploy export`."),
    target: str = typer.Option("trt", "--target", help="Deployment target to check against (trt)."),
) -> None:
    """Pre-flight check, no GPU needed: will TensorRT's ONNX parser take this graph?

    Lists every node the parser will not take (from its published operator support matrix,
    kept as data in moedeploy) and, for each custom node, the plugin that implements it.
    Exit code 1 when something cannot build.
    """
    from rich.table import Table

    from moedeploy.export.preflight import check_tensorrt

    if target != "trt":
        raise UserError(f"unknown --target {target!r}; the pre-flight check knows: trt")
    report = check_tensorrt(artifact)
    out.print(f"TensorRT {report.tensorrt_version} ONNX parser ({report.source})", highlight=False)
    ops = ", ".join(f"{op} x{n}" for op, n in sorted(report.op_counts.items()))
    out.print(f"[dim]{sum(report.op_counts.values())} nodes: {ops}[/dim]", highlight=False)
    if report.plugins:
        table = Table(title="custom nodes -> plugins", title_justify="left")
        table.add_column("node")
        table.add_column("op")
        table.add_column("implemented by")
        for f in report.plugins:
            table.add_row(f.node, f.op, f.detail)
        out.print(table)
    for f in report.blocking:
        out.print(f"[red]{f.verdict}[/red] {f.node} ({f.op}): {escape(f.detail)}", highlight=False)
    if report.ok:
        out.print("[green]OK[/green] every node is supported by the parser or a moedeploy plugin", highlight=False)
    else:
        out.print(f"[red]FAIL[/red] {len(report.blocking)} node(s) cannot build", highlight=False)
        raise typer.Exit(1)


@app.command("bench")
@handle_errors
def bench_cmd(
    target: str = typer.Argument(..., help="A decoder artifact folder, or a preset (tiny, small) exported once into ~/.cache/moedeploy."),
    backend: str = typer.Option("torch,ort", "--backend", help="Comma-separated: torch, torch-compile, hf (transformers eager), ort, trt."),
    batch: int = typer.Option(1, "--batch", help="Sequences decoded together."),
    prompt_len: int = typer.Option(128, "--prompt-len", help="Prompt tokens (the prefill)."),
    new_tokens: int = typer.Option(64, "--new-tokens", help="Greedy tokens generated after the prompt."),
    threads: int = typer.Option(2, "--threads", help="Intra-op threads for every backend."),
    repeat: int = typer.Option(3, "--repeat", help="Timed generations per backend (median and spread reported)."),
    json_file: Path = typer.Option(None, "--json", help="Write {machine, results: [{backend, metric, value, unit}], ...} here."),
) -> None:
    """Prefill latency, decode tokens/s, p50/p99 per-token latency and peak memory per backend.

    Each backend runs in its own process on the same seeded prompt, and every figure is set
    against the machine's measured limits: decode against bytes of weights per token / memory
    bandwidth, prefill against flops / GEMM rate.
    """
    from rich.table import Table

    from moedeploy.bench.api import bench

    backends = [b.strip() for b in backend.split(",") if b.strip()]
    with err.status("benchmarking", spinner="dots") as status:
        report = bench(target, backends, batch, prompt_len, new_tokens, threads, repeat, json_file,
                       progress=lambda s: status.update(s))
    m, roof = report["machine"], report["roofline"]
    out.print(f"{m['cpu']}, {m['threads']} threads: {m['bandwidth_gbs']} GB/s read, {m['gemm_gflops']} GFLOP/s fp32 GEMM; "
              f"decode bound {roof['decode_bound_tokens_per_s']} tokens/s ({roof['decode_step_bytes'] / 1e6:.0f} MB/step)", highlight=False)
    table = Table(title_justify="left")
    for col in ("backend", "prefill ms", "decode tok/s", "p50 ms", "p99 ms", "peak RSS MB", "of bound"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for r in report["raw"]:
        if "error" in r:
            continue
        table.add_row(r["backend"], f"{r['prefill_ms']:.1f}", f"{r['decode_tokens_per_s']:.1f}",
                      f"{r['token_latency_p50_ms']:.2f}", f"{r['token_latency_p99_ms']:.2f}", f"{r['peak_rss_mb']:.0f}",
                      f"{r['decode_tokens_per_s'] / roof['decode_bound_tokens_per_s']:.0%}")
    out.print(table)
    for r in report["raw"]:
        if "error" in r:
            out.print(f"[red]{r['backend']}:[/red] {escape(r['error'])}", highlight=False)
    for name, ratio in report["ratios"].items():
        out.print(f"{name}: decode x{ratio['decode_speedup']:.2f}, prefill time x{ratio['prefill_time_ratio']:.2f}, "
                  f"peak memory x{ratio['peak_rss_ratio']:.2f}", highlight=False)
    if not report["greedy_tokens_agree"]:
        out.print("[yellow]warning:[/yellow] backends with the same weights generated different greedy tokens")


from moedeploy.serving.cli import register as register_serving  # noqa: E402 (after the shared helpers it uses)

register_serving(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
