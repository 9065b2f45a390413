"""The `moedeploy` command: a thin layer over the Python API, one function per subcommand.

Errors a user can cause (bad names, unreadable checkpoints, unwritable paths) print one
line naming the problem and the fix and exit 1; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup


class _OneLineUsageErrors(TyperGroup):
    """Usage mistakes (an unknown option, a missing value) as one line, like every other error.

    Click prints a usage block and a boxed message and exits 2; moedeploy prints
    `error: <what> (see `moedeploy <command> --help`)` and exits 2, the code every
    command-line tool uses for a command line it does not understand. A bare `moedeploy`
    prints the help and exits 0: asking for help is not an error.
    """

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        exceptions = _click_exceptions()
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except exceptions.NoArgsIsHelpError as e:
            typer.echo(e.ctx.get_help() if e.ctx else self.get_help(self.make_context(prog_name or "moedeploy", [])))
            rv = 0
        except exceptions.UsageError as e:
            where = e.ctx.command_path if e.ctx else "moedeploy"
            err.print(f"[bold red]error:[/bold red] {escape(e.format_message())} (see `{where} --help`)",
                      highlight=False, soft_wrap=True)
            rv = e.exit_code
        except exceptions.ClickException as e:
            err.print(f"[bold red]error:[/bold red] {escape(e.format_message())}", highlight=False, soft_wrap=True)
            rv = e.exit_code
        except typer.Abort:  # typer's own (click's vendored copy has none since typer 0.29)
            rv = 1
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


def _click_exceptions() -> Any:
    """The click exceptions typer raises: its vendored copy where it has one (typer >= 0.17)."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    return exceptions


#: NumPy's legacy seeds are 32-bit, and a seed's job needs no more
MAX_SEED = 2**32 - 1
#: compare keeps every iteration's outputs of every backend in memory
MAX_ITERATIONS = 1000
#: bench's sizes: torch and ONNX Runtime take a thread count as a C int; a batch past a few
#: thousand rows of a KV cache is an allocation error, not a benchmark
MAX_THREADS = 1024
MAX_BENCH_BATCH = 4096
#: `moedeploy version`'s last line starts so: whether sessions take the native MoE kernel here
NATIVE_KERNEL_LINE = "native-moe-kernel"
#: build's --workspace in MB: 16 TB, far past any GPU, whose bytes still fit TensorRT's int64
MAX_WORKSPACE_MB = 2**24


def number_in(low: float, high: float = math.inf, what: str = "a finite number") -> Callable[[float | None], float | None]:
    """A typer callback that refuses, as the options are parsed (exit 2, like typer's own range
    checks), a float outside [low, high] or NaN: click's ranges let NaN through (no comparison with
    it is true), and a NaN tolerance fails every output while an infinite one passes any."""

    def check(value: float | None) -> float | None:
        if value is not None and not (low <= value <= high and math.isfinite(value)):
            bound = f"from {low:g} to {high:g}" if math.isfinite(high) else f">= {low:g}"
            raise typer.BadParameter(f"{value} is not {what} {bound}")
        return None if value is None else value + 0.0  # -0.0 reads as 0

    return check

app = typer.Typer(
    name="moedeploy",
    cls=_OneLineUsageErrors,
    help=(
        "Export PyTorch transformer blocks and MoE decoders to ONNX Runtime and TensorRT, "
        "and prove every step matches eager PyTorch.\n\n"
        "Start with `moedeploy all --out out` (every block and the decoder, compared with eager "
        "PyTorch, reports in out/index.html), or `moedeploy export --list` and then "
        "`moedeploy export moe --out artifacts/moe`. Every command has --help."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: wrapped to the terminal, no boxes, \b blocks kept
)
err = Console(stderr=True)
out = Console()
_state: dict[str, Any] = {"debug": False, "signal": None}

F = TypeVar("F", bound=Callable[..., Any])


class UserError(Exception):
    """An error whose message is the whole story for the user."""


#: The exceptions whose message is the whole story for the user, by module: (module, class name).
_USER_ERROR_CLASSES = (
    ("moedeploy.export.artifact", "ArtifactError"),
    ("moedeploy.export.onnx_export", "ExportError"),
    ("moedeploy.models.checkpoint_config", "CheckpointError"),
    ("moedeploy.plugins.native", "NativeUnavailable"),
    ("moedeploy.runtime.lowering", "LoweringError"),
    ("moedeploy.runtime.ort", "SessionError"),
    ("moedeploy.runtime.tensorrt_import", "TensorRTUnavailable"),
)


def _user_errors() -> tuple[type[BaseException], ...]:
    """UserError, ValueError and OSError, and moedeploy's own error classes from the modules this
    process has imported: an exception of a module never imported cannot have been raised, and
    importing them all (torch, ONNX Runtime) to say so took seconds on an error found before any
    work, such as an unknown --target."""
    loaded = (getattr(sys.modules.get(module), name, None) for module, name in _USER_ERROR_CLASSES)
    return (UserError, ValueError, OSError, *(cls for cls in loaded if isinstance(cls, type)))


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
        except SystemExit:
            if _state["signal"] == signal.SIGTERM:  # exit_on_sigterm's: said, as Ctrl-C's "interrupted" is
                err.print("[red]terminated[/red]")
            raise
        except Exception as e:
            if _state["signal"]:  # the SIGTERM exit or Ctrl-C, turned into another exception by a library
                # on its way out (an ImportError, when it arrived while a C extension initialised): not a bug
                err.print("[red]interrupted[/red]" if _state["signal"] == signal.SIGINT else "[red]terminated[/red]")
                raise typer.Exit(128 + _state["signal"]) from None
            if _state["debug"]:
                raise
            if not isinstance(e, _user_errors()):  # a bug of ours: one line that says so, the traceback on request
                first = (str(e).strip().splitlines() or [""])[0][:300]
                err.print(f"[bold red]error:[/bold red] internal error, {type(e).__name__}: {escape(first)} (a bug in "
                          "moedeploy: rerun with --debug for the traceback and report it)", highlight=False,
                          soft_wrap=True)
                raise typer.Exit(1) from None
            message = str(e) if not isinstance(e, OSError) else f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")
            err.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
) -> None:
    _state["debug"] = debug
    _state["signal"] = None  # this invocation's own (main's handler records it)


def check_writable(path: Path, option: str = "--out") -> None:
    """Fail before any work if `path` cannot become a folder we write (`option`: what the message
    tells the user to change)."""
    path = Path(os.path.abspath(path))  # `--out .` has no parents to walk
    if path.exists() and not path.is_dir():
        raise UserError(f"output path {path} exists and is not a folder; choose another {option}")
    ancestor = next(p for p in (path, *path.parents) if p.exists())
    problem = None
    if not ancestor.is_dir():
        problem = f"{ancestor} is not a folder"
    else:
        from moedeploy.utils.io import new_folder_problem

        problem = new_folder_problem(ancestor)
    if problem:
        raise UserError(f"cannot write to {path}: {problem}; choose another {option}")


def check_artifact_folder(path: Path) -> None:
    """An artifact path with no folder or no manifest there, refused before the command imports
    torch (Artifact.load makes the same check, and the rest)."""
    from moedeploy.names import artifact_folder_problem

    if problem := artifact_folder_problem(path):
        raise UserError(problem)


def check_cache_writable(target: str, backends: list[str], peers: bool) -> None:
    """bench exports a preset or checkpoint into its cache, and llama.cpp's GGUF of any target: a
    cache that cannot become a folder (MOEDEPLOY_CACHE naming a file, or under /proc) fails here,
    not after the trace and the golden outputs. An artifact folder timed on other backends is read
    where it is; a cache folder that exists is left to the write itself (it may hold every export
    this run needs, and be read-only)."""
    from moedeploy.bench.api import cache_dir

    artifact = (Path(target) / "manifest.json").is_file()
    if (artifact and not peers and "llama.cpp" not in backends) or (cache_dir() / "bench").is_dir():
        return
    check_writable(cache_dir() / "bench", "MOEDEPLOY_CACHE")


def check_json_target(path: Path) -> None:
    """bench's --json, before any work (moedeploy.bench.report_file: the rule the scripts under
    benchmarks/ share): a new file, or a benchmark report bench wrote before."""
    from moedeploy.bench.report_file import report_target_problem

    if problem := report_target_problem(path, _is_bench_report, "bench"):
        raise UserError(problem)


def _is_bench_report(report: dict[str, Any]) -> bool:
    """Whether a JSON object is what bench's --json writes: its machine and results."""
    return isinstance(report.get("machine"), dict) and isinstance(report.get("results"), list)


def make_table(title: str | None, columns: list[str], text: tuple[str, ...] | None = None) -> Any:
    """A rich Table that fits 80 columns (a CI log, a pipe) without cutting anything off.

    No vertical rules, so the figures fit; the `text` columns (names; default the first
    column) wrap inside their cells when space runs out, and figures never wrap or get an
    ellipsis.
    """
    from rich import box
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  collapse_padding=True, header_style="bold")
    text = text or (columns[0],)
    for column in columns:
        wraps = column in text
        table.add_column(column, justify="left" if wraps else "right", overflow="fold", no_wrap=not wraps)
    return table


@contextlib.contextmanager
def progress_steps(title: str, echo_on_terminal: bool = False) -> Iterator[Callable[[str], None]]:
    """Report the stages of a long command and, at the end, its total time.

    On a terminal a spinner shows the current stage (and, with `echo_on_terminal`, each stage
    stays as a line). Anywhere else (a CI log, a pipe) a spinner would print nothing for a
    minute, so every stage is a plain line with the seconds elapsed.
    """
    start = time.perf_counter()

    def elapsed() -> float:
        return time.perf_counter() - start

    if err.is_terminal:
        with err.status(title, spinner="dots") as status:
            def update(stage: str) -> None:
                status.update(f"{title}: {stage}")
                if echo_on_terminal:
                    err.print(f"  [dim]•[/dim] {escape(stage)}", highlight=False, soft_wrap=True)

            yield update
    else:
        def line(stage: str) -> None:
            err.print(f"  • {elapsed():6.1f} s  {escape(title)}: {escape(stage)}", highlight=False, soft_wrap=True)

        yield line
    err.print(f"  [dim]• {escape(title)}: done in {elapsed():.1f} s[/dim]", highlight=False, soft_wrap=True)


@app.command()
@handle_errors
def version() -> None:
    """Print the versions of moedeploy and its libraries, and whether its native MoE kernel is here.

    Optional ones that are missing say "not installed", with the command that installs them.
    The last line says whether the project's native MoE kernel is here for CPU sessions (built
    for this CPU, built by the next session, or why not: it needs ONNX Runtime's C headers,
    which the pip wheel lacks; MOEDEPLOY_ORT_INCLUDE names a folder holding them).
    MOEDEPLOY_MOE_PATH or a `moedeploy tune` record can still send sessions to another path.
    """
    # from package metadata: no torch imported for a list of numbers
    import importlib.metadata

    from moedeploy.plugins import native
    from moedeploy.utils.versions import core_versions, supporting_versions

    providers = importlib.metadata.packages_distributions()  # one scan of the installed packages
    for name, v in {**core_versions(providers), **supporting_versions(providers)}.items():
        out.print(escape(f"{name} {v}"), highlight=False, soft_wrap=True)
    out.print(escape(f"{NATIVE_KERNEL_LINE} {native.status()}"), highlight=False, soft_wrap=True)


@app.command("families")
@handle_errors
def families_cmd() -> None:
    """List the Hugging Face model families `export decoder --checkpoint` takes, and their options.

    A checkpoint folder's config.json says its family (model_type). Options not listed, or
    set to values the shared decoder does not implement (a scaled RoPE, say), are refused
    with a line that names them, before anything is written.
    """
    from moedeploy.models.families import FAMILIES

    width = max(len(f.model_type) for f in FAMILIES.values())
    for f in FAMILIES.values():  # one line each, name first (as export --list): easy to grep
        out.print(escape(f"{f.model_type:<{width}}  {f.title}: {f.options}"), highlight=False, soft_wrap=True)


@app.command("export")
@handle_errors
def export_cmd(
    ctx: typer.Context,
    target: str = typer.Argument(None, help="A block name (see --list) or 'decoder'.", show_default=False),
    out_dir: Path = typer.Option(None, "--out", "-o", help="Artifact folder to write: new, empty, or an artifact to replace.", show_default=False),
    list_blocks: bool = typer.Option(False, "--list", help="List the exportable blocks, one per line, name first."),
    preset_name: str = typer.Option(None, "--preset", help="Decoder shape with random weights: tiny (default) or small.", show_default=False),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="Hugging Face checkpoint folder of a supported family (see `moedeploy families`), or a moedeploy one (decoder only).", show_default=False),
    dtype: str = typer.Option("fp32", "--dtype", help="Graph precision: fp32, fp16 or bf16."),
    fold_bn: bool = typer.Option(True, "--fold-bn/--no-fold-bn", help="BatchNorm blocks: fold the frozen EMA stats into Linear / scale+shift."),
    calibration_batches: int = typer.Option(8, "--calibration-batches", help="BatchNorm blocks: train-mode batches that update the EMA stats first."),
    seed: int = typer.Option(0, "--seed", min=0, max=MAX_SEED, help="Seed for random weights and golden inputs."),
    max_seq_len: int = typer.Option(None, "--max-seq-len", help="Decoder: positions (cache + new tokens) the TensorRT profile covers; default min(max_positions, 4096).", show_default=False),
    force: bool = typer.Option(False, "--force", help="Replace --out even when it is a folder moedeploy did not write."),
    golden: bool = typer.Option(True, "--golden/--no-golden", help="Decoder: run eager PyTorch on the golden inputs and store its outputs (--no-golden skips that pass over the weights; `compare` still runs eager)."),
    quantize_as: str = typer.Option(None, "--quantize", help="Decoder: int8 or int4 weight-only for the Linear and expert weights (router, norms, embeddings stay in --dtype), as ONNX DequantizeLinear.", show_default=False),
    block_size: int = typer.Option(32, "--block-size", help="With --quantize: weights per scale along the input dimension (a power of two, at least 16, dividing it); the LM head's: --head-block-size."),
    symmetric: bool = typer.Option(True, "--symmetric/--asymmetric", help="With --quantize: signed codes and no zero point (int8 is llama.cpp's q8_0; what TensorRT reads), or unsigned codes and a zero point per block (ONNX Runtime only)."),
    mixed: bool = typer.Option(True, "--mixed/--uniform", help="With --quantize int4: keep the LM head and attention K/V at int8, as llama.cpp's q4_0 does (--uniform: all int4)."),
    head_block_size: int = typer.Option(None, "--head-block-size", help="With --quantize: the LM head's block size. Default: an int8 head (int8, mixed int4) in blocks of the largest power of two up to 256 dividing the hidden size (never below --block-size), which decoded the small preset 6-21% faster on ONNX Runtime than blocks of 32 at the same KL divergence from fp32; an int4 head in --block-size.", show_default=False),
) -> None:
    """Export a block or the MoE decoder to an artifact folder.

    The folder holds model.onnx (opset 23, custom moe::RMSNorm / moe::MoE nodes with
    standard-op function bodies), manifest.json and golden/ eager-PyTorch I/O.
    A decoder keeps its weights in model.onnx.data, streamed from the checkpoint one tensor
    at a time: memory does not grow with the model, so any size exports (the disk must
    hold the weights in the chosen --dtype; that is checked before any work).
    --quantize int8|int4 stores the Linear and expert weights as blocked signed codes, one
    scale per --block-size values (an int8 LM head's: up to 256, see --head-block-size;
    --asymmetric: unsigned codes with a zero point), read
    through ONNX DequantizeLinear (`moedeploy check --target trt` says what TensorRT takes); the golden
    outputs are then eager PyTorch's on the dequantized weights, what the artifact computes.
    An existing --out is replaced only when it is empty or an artifact; anything else needs --force.

    \b
    Examples:
      moedeploy export --list
      moedeploy export rmsnorm --out artifacts/rmsnorm --dtype fp16
      moedeploy export decoder --preset small --out artifacts/decoder
      moedeploy export decoder --checkpoint ./mixtral-tiny --out artifacts/mixtral
      moedeploy export decoder --preset small --quantize int4 --out artifacts/q4
    """
    # everything a user can get wrong on the command line is checked from moedeploy.names, before
    # the exporter (and torch) is imported: a typo is refused in half a second, not five
    from moedeploy.names import (
        BATCHNORM_BLOCKS,
        BLOCKS,
        DECODER,
        dtype_problem,
        export_options_problem,
        preset_problem,
    )

    if list_blocks:  # plain lines for scripts: name, a tab, what it is
        for name, summary in BLOCKS.items():
            typer.echo(f"{name}\t{summary}")
        typer.echo(f"{DECODER}\tMoE decoder LM with KV cache (--preset or --checkpoint)")
        return
    if target is None:
        raise UserError("name a block or 'decoder' to export (see `moedeploy export --list`)")
    if target != DECODER and target not in BLOCKS:
        raise UserError(f"unknown block {target!r}; run `moedeploy export --list` to see the exportable blocks")
    if out_dir is None:
        raise UserError("missing --out DIR: the artifact folder to write")
    if problem := dtype_problem(dtype):
        raise UserError(problem)
    if preset_name is not None and (problem := preset_problem(preset_name)):
        raise UserError(problem)
    if target != DECODER and given(ctx, "golden"):
        raise UserError("--golden/--no-golden applies to the decoder only; a block's golden outputs cost nothing")
    if problem := export_options_problem(target, preset=preset_name, checkpoint=checkpoint is not None,
                                         max_seq_len=max_seq_len is not None, quantize=quantize_as is not None):
        raise UserError(problem)
    if target == DECODER and checkpoint is not None:
        from moedeploy.models.checkpoint_config import read_config

        # its folder, config.json, family and options, as the exporter will read them (a CheckpointError)
        read_config(checkpoint)
    uses_batchnorm = target in BATCHNORM_BLOCKS
    for option in ("fold_bn", "calibration_batches"):
        if not uses_batchnorm and given(ctx, option):
            flag = "--calibration-batches" if option == "calibration_batches" else "--fold-bn/--no-fold-bn"
            raise UserError(f"{flag} applies to blocks with BatchNorm only; {target!r} has none, so drop it")
    for option, flag in (("block_size", "--block-size"), ("symmetric", "--symmetric/--asymmetric"),
                         ("mixed", "--mixed/--uniform"), ("head_block_size", "--head-block-size")):
        if quantize_as is None and given(ctx, option):
            raise UserError(f"{flag} applies with --quantize int8|int4 only")
    if quantize_as == "int8" and given(ctx, "mixed"):
        raise UserError("--mixed/--uniform applies with --quantize int4 only (int8 is uniform)")
    check_writable(out_dir)

    from moedeploy.export import export
    from moedeploy.export.quantize import LM_HEAD, parse_scheme

    quantization = parse_scheme(quantize_as, block_size, symmetric) if quantize_as is not None else None
    if quantization is not None and not symmetric and dtype == "bf16":
        # ONNX Runtime's CUDA provider may run it (not verified: no GPU here), so a warning, not a refusal
        err.print("[yellow]warning:[/yellow] --asymmetric with --dtype bf16: ONNX Runtime's CPU provider has no bf16 "
                  "kernels and TensorRT takes symmetric codes only, so neither runs this artifact; drop --asymmetric, "
                  "or export with --dtype fp32 or fp16", highlight=False, soft_wrap=True)

    with progress_steps(f"exporting {target}", echo_on_terminal=True) as progress:
        artifact = export(
            target, out_dir, preset_name=preset_name, checkpoint=checkpoint, dtype=dtype,
            fold_bn=fold_bn, calibration_batches=calibration_batches, seed=seed, force=force, progress=progress,
            max_seq_len=max_seq_len, golden=golden, quantization=quantization, mixed=mixed,
            head_block_size=head_block_size,
        )
    ops = ", ".join(f"{o['domain']}::{o['op_type']} x{o['count']}" for o in artifact.manifest["custom_ops"]) or "none"
    size = (artifact.model_path.stat().st_size + artifact.stored_weight_bytes()) / 1e6  # not the data file's gaps
    q = artifact.manifest.get("quantization")
    head = q["block_sizes"].get(LM_HEAD) if q is not None else None
    precision = dtype if q is None else f"{dtype}, {quantize_as} {'' if q['symmetric'] else 'asymmetric '}" \
        f"weights in blocks of {block_size}" + (
        " (LM head and attention K/V int8)" if quantize_as == "int4" and mixed else "") + (
        f", LM head in blocks of {head}" if head else "")
    out.print(f"[green]exported[/green] {target} ({precision}) -> {artifact.path}  [{size:.1f} MB, custom ops: {ops}]",
              highlight=False)


def given(ctx: typer.Context, param: str) -> bool:
    """Whether the user typed this option (an option that would be ignored is refused, not dropped)."""
    source = ctx.get_parameter_source(param)  # typer vendors its own click: compare by name
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def _split_backends(value: str) -> list[str]:
    from moedeploy.names import COMPARE_BACKENDS  # checked before torch is imported

    choices = ", ".join(COMPARE_BACKENDS[1:])  # not torch: the reference every backend is compared with
    backends = [b.strip() for b in value.split(",") if b.strip()]
    if not backends:
        raise UserError(f"--backend needs at least one of: {choices}")
    for i, b in enumerate(backends):
        if b not in COMPARE_BACKENDS[1:]:
            raise UserError(f"unknown backend {b!r} in --backend; choose from: {choices}")
        if b in backends[:i]:  # it ran twice, and the report listed it twice
            raise UserError(f"backend {b!r} is listed twice in --backend; name each once")
    return backends


def _print_report(report: dict) -> None:
    for c in report["comparisons"]:
        table = make_table(f"{c['backend']} vs {c['reference']}",
                           ["output", "max abs", "p99 abs", "max rel", "cosine", "atol", "rtol", "result"])
        for name, st in c["outputs"].items():
            if st.get("shape_mismatch"):
                table.add_row(name, "shape mismatch", "", "", "", "", "", "[red]FAIL[/red]")
                continue
            table.add_row(
                name, f"{st['max_abs']:.2e}", f"{st['p99_abs']:.2e}", f"{st['max_rel']:.2e}", f"{st['cosine']:.8f}",
                f"{st['atol']:.0e}", f"{st['rtol']:.0e}", "[green]pass[/green]" if st["passed"] else "[red]FAIL[/red]",
            )
        out.print(table)
    if q := report.get("quantization"):
        from moedeploy.compare.report import (
            QUANTIZATION_COLUMNS,
            quantization_cells,
            quantization_intro,
        )

        table = make_table("quantization accuracy", ["backend", *QUANTIZATION_COLUMNS, "result"])
        for backend, m in q["backends"].items():
            table.add_row(backend, *quantization_cells(m), "[green]pass[/green]" if m["passed"] else "[red]FAIL[/red]")
        out.print(table)
        out.print(escape(quantization_intro(q)), highlight=False)
    if f := report.get("inflight"):
        from moedeploy.compare.report import inflight_text

        verdict = "[green]pass[/green]" if f["passed"] else "[red]FAIL[/red]"
        out.print(f"in-flight batching ({f['backend']}): {verdict}  {escape(inflight_text(f))}", highlight=False)
    if report.get("first_divergent_layer"):
        from moedeploy.compare.report import divergence_note, plain, routing_note

        if report["passed"]:  # outputs pass: the module named is inside the network (see divergence_note)
            out.print(f"[yellow]note:[/yellow] {escape(divergence_note(report, plain) or '')}", highlight=False)
        else:
            out.print(f"[red]first divergent layer:[/red] {report['first_divergent_layer']} "
                      f"(module {report['first_divergent_module']})", highlight=False)
        if note := routing_note(report, plain):
            out.print(escape(note), highlight=False)


def _quantization_thresholds(max_kl_mean: float | None, min_top1: float | None) -> dict[str, float]:
    """compare's --max-kl-mean / --min-top1 (checked as parsed): overrides of the defaults by bit width."""
    given = {"kl_mean": max_kl_mean, "top1": min_top1}
    return {k: v for k, v in given.items() if v is not None}


@app.command("compare")
@handle_errors
def compare_cmd(
    artifact: Path = typer.Argument(..., help="Artifact folder made by `moedeploy export`."),
    backend: str = typer.Option("ort", "--backend", help="Comma-separated backends to check against eager PyTorch: ort "
                                "(the default lowering), ort-contrib (every MoE on com.microsoft::MoE), ort-experts (every fp32 MoE on "
                                "one If per expert), ort-gqa (a "
                                "decoder's attention on GroupQueryAttention), ort-skipnorm (residual + RMSNorm on "
                                "SkipSimplifiedLayerNormalization), trt, ort-inflight (a decoder's sequences of different lengths decoded "
                                "together on the in-flight batching row cache, each against eager PyTorch run whole)."),
    atol: float = typer.Option(None, "--atol", callback=number_in(0), help="Absolute tolerance for every output (default: the manifest's, by dtype)."),
    rtol: float = typer.Option(None, "--rtol", callback=number_in(0), help="Relative tolerance for every output (default: the manifest's, by dtype)."),
    iterations: int = typer.Option(4, "--iterations", min=1, max=MAX_ITERATIONS, help="Seeded random inputs; the first uses each dynamic dim's opt size."),
    seed: int = typer.Option(0, "--seed", min=0, max=MAX_SEED, help="Seed for the input data."),
    layerwise: bool = typer.Option(False, "--layerwise", help="Localise the first divergent layer even when outputs pass."),
    checkpoint: Path = typer.Option(
        None, "--checkpoint",
        help="Decoder exported from a checkpoint: the checkpoint's folder, if it moved since export "
        "(refused unless its weights match the manifest's fingerprint).",
    ),
    max_kl_mean: float = typer.Option(None, "--max-kl-mean", callback=number_in(0), help="Quantized decoder: the most mean KL divergence "
                                      "from the unquantized model that passes (default 0.01 for int8, 0.15 for int4)."),
    min_top1: float = typer.Option(None, "--min-top1", callback=number_in(0, 1, "a fraction of positions"), help="Quantized decoder: the least top-1 agreement with the "
                                   "unquantized model that passes (default 0.8 for int8, 0.25 for int4)."),
) -> None:
    """Compare an artifact's backends with eager PyTorch.

    Writes <artifact>/report/.
    Exit code 1 when any output is out of tolerance, so it can gate CI. The report folder holds
    report.json / report.md / report.html and Polygraphy's run_results.json and accuracy.json.

    A quantized decoder (export --quantize) is checked twice: each backend against eager
    PyTorch on the dequantized weights (the usual tolerances: does the backend compute what the
    artifact says?), and against the unquantized model on a fixed stream of 1,024 tokens (fewer
    when the model has fewer positions) (KL
    divergence, top-1 and greedy agreement, judged by --max-kl-mean and --min-top1: what did
    quantization cost?).
    """
    check_artifact_folder(artifact)
    backends = _split_backends(backend)
    if checkpoint is not None:  # a checkpoint the decoder cannot take, before torch is imported
        from moedeploy.models.checkpoint_config import read_config

        read_config(checkpoint)
    if "trt" in backends:  # before torch is imported; compare() also asks for a GPU and this artifact's engine
        from moedeploy.runtime.tensorrt_import import require_installed

        require_installed()
    from moedeploy.compare.api import compare

    with progress_steps(f"comparing {artifact}") as progress:
        report = compare(
            artifact, backends, atol=atol, rtol=rtol, iterations=iterations, seed=seed,
            layerwise=layerwise, progress=progress, checkpoint=checkpoint,
            quantization_thresholds=_quantization_thresholds(max_kl_mean, min_top1),
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
    iterations: int = typer.Option(3, "--iterations", min=1, max=MAX_ITERATIONS, help="Seeded random inputs per comparison."),
    seed: int = typer.Option(0, "--seed", min=0, max=MAX_SEED, help="Seed for weights and inputs."),
    force: bool = typer.Option(False, "--force", help="Write into --out even when it holds files moedeploy did not write."),
) -> None:
    """Export and compare every block and the decoder.

    Writes an artifact per target and <out>/index.html.
    The README's main job: proves, end to end, that every exported graph matches eager PyTorch.
    Exit code 1 when anything fails.
    """
    from moedeploy.names import dtype_problem, preset_problem

    if problem := dtype_problem(dtype) or preset_problem(preset_name):
        raise UserError(problem)
    backends = _split_backends(backend) if backend else None
    # run_all checks these again, and asks for a GPU; these, before torch is imported
    from moedeploy.compare.all_checks import all_backends_problem, not_runnable_here

    if reason := not_runnable_here(dtype, backends or ["ort"]):  # ONNX Runtime is among the default backends
        raise UserError(f"moedeploy all --dtype {dtype} stops before exporting: {reason}")
    if backends is not None:
        from moedeploy.names import BLOCKS, DECODER

        if problem := all_backends_problem(backends, [*BLOCKS, DECODER]):
            raise UserError(problem)
    from moedeploy.compare.suite import check_run_folder, run_all

    check_writable(out_dir)
    check_run_folder(out_dir, force)
    with progress_steps("moedeploy all") as progress:
        summary = run_all(out_dir, backends, dtype, preset_name, iterations, seed, progress=progress, force=force)
    table = make_table(f"moedeploy all ({', '.join(summary['backends'])}, {dtype})",
                       ["artifact", "result", "max abs error", "first divergent layer", "s"],
                       text=("artifact", "max abs error", "first divergent layer"))
    for r in summary["results"]:
        result = "[green]pass[/green]" if r["passed"] else "[red]FAIL[/red]"
        error = f"{r['max_abs']:.2e}" if r.get("max_abs") is not None else (r.get("error") or "").split("\n")[0]
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
    ctx: typer.Context,
    artifact: Path = typer.Argument(..., help="Artifact folder made by `moedeploy export`."),
    aot: bool = typer.Option(True, "--aot/--jit", help="AOT plugins (engine runs without Python) or JIT plugins (Python at run time)."),
    workspace: int = typer.Option(None, "--workspace", min=1, max=MAX_WORKSPACE_MB,
                                  help="Builder workspace limit in MB (default: TensorRT's)."),
    timing_cache: Path = typer.Option(None, "--timing-cache", help="Timing cache file to read and update (speeds up rebuilds)."),
    experts_on_codes: bool = typer.Option(
        True, "--experts-on-codes/--experts-dequantized",
        help="A quantized artifact's experts: on their int8/int4 codes through moe::MoENBits (the default), or "
             "dequantized by TensorRT into the moe::MoE plugin (engine holds float experts; a fallback should "
             "a TensorRT version refuse INT8 plugin inputs).",
    ),
) -> None:
    """Build a TensorRT engine (needs TensorRT and a GPU).

    The moe::RMSNorm / moe::MoE nodes run as moedeploy's plugins. A quantized artifact's
    experts reach their plugin as the int8/int4 codes (moe::MoENBits, dequantized in the
    kernel), its other weights as Q/DQ (`moedeploy check` prints what the graph becomes). One
    optimisation profile from the manifest's min/opt/max dynamic ranges; a strongly typed
    network, so the precision is the graph's (export with --dtype fp16/bf16 for half precision).
    Writes
    <artifact>/engines/<gpu>_trt<version>_<dtype>_<aot|jit>.plan with its build log and metadata.
    """
    check_artifact_folder(artifact)
    from moedeploy.runtime.tensorrt_import import require_installed

    require_installed()  # before torch is imported
    from moedeploy.export import Artifact
    from moedeploy.export.preflight import aot_moe_note
    from moedeploy.runtime.tensorrt import build_engine, require_gpu, require_tensorrt

    loaded = Artifact.load(artifact)
    refuse_experts_option_unquantized(ctx, loaded)
    require_tensorrt()
    require_gpu()
    if aot and (note := aot_moe_note(loaded)):
        err.print(f"[yellow]note:[/yellow] {escape(note)}", highlight=False)
    with progress_steps(f"building a TensorRT engine for {loaded.name}"):
        result = build_engine(loaded, aot=aot, workspace_mb=workspace, timing_cache=timing_cache,
                              experts_on_codes=experts_on_codes)
    out.print(f"[green]built[/green] {result.plan} (log: {result.log.name})", highlight=False)


def refuse_experts_option_unquantized(ctx: typer.Context, artifact: Any) -> None:
    """--experts-on-codes/--experts-dequantized picks how a quantized artifact's experts reach
    TensorRT; on a float artifact it would be ignored, so it is refused."""
    if given(ctx, "experts_on_codes") and "quantization" not in artifact.manifest:
        raise UserError(f"--experts-on-codes/--experts-dequantized applies to quantized artifacts; {artifact.path} "
                        "holds float weights, so drop it")


@app.command("check")
@handle_errors
def check_cmd(
    ctx: typer.Context,
    artifact: Path = typer.Argument(..., help="Artifact folder made by `moedeploy export`."),
    target: str = typer.Option("trt", "--target", help="Deployment target to check against (trt)."),
    experts_on_codes: bool = typer.Option(
        True, "--experts-on-codes/--experts-dequantized",
        help="Check the graph `build` makes with the same option.",
    ),
) -> None:
    """Will TensorRT's ONNX parser take this graph? No GPU needed.

    Checks the graph `moedeploy build` hands the parser, after moedeploy's TensorRT lowering
    (say, a quantized artifact's experts on their codes). Lists every node the parser will not
    take (from its published operator support matrix, kept as data in moedeploy) and, for each
    custom node, the plugin that implements it. Exit code 1 when something cannot build.
    """
    if target != "trt":
        raise UserError(f"unknown --target {target!r}; the pre-flight check knows: trt")
    check_artifact_folder(artifact)
    from moedeploy.export import Artifact
    from moedeploy.export.preflight import check_tensorrt

    loaded = Artifact.load(artifact)
    refuse_experts_option_unquantized(ctx, loaded)
    report = check_tensorrt(loaded, experts_on_codes=experts_on_codes)
    out.print(f"TensorRT {report.tensorrt_version} ONNX parser ({report.source})", highlight=False)
    ops = ", ".join(f"{op} x{n}" for op, n in sorted(report.op_counts.items()))
    out.print(f"[dim]{sum(report.op_counts.values())} nodes: {ops}[/dim]", highlight=False)
    if rewritten := {k: n for k, n in report.lowering.items() if n}:
        what = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in rewritten.items())
        out.print(f"[dim]as build_engine parses it, through moedeploy's TensorRT lowering: {what} "
                  "(the same weight bytes, re-typed or reshaped, none copied)[/dim]", highlight=False)
    if report.plugins:
        table = make_table("custom nodes -> plugins", columns := ["node", "op", "implemented by"], text=tuple(columns))
        for f in report.plugins:
            table.add_row(f.node, f.op, f.detail)
        out.print(table)
    for f in report.blocking:
        out.print(f"[red]{f.verdict}[/red] {f.node} ({f.op}): {escape(f.detail)}", highlight=False)
    for note in report.notes:
        out.print(f"[yellow]note:[/yellow] {escape(note)}", highlight=False)
    if report.ok:
        out.print("[green]OK[/green] every node is supported by the parser or a moedeploy plugin", highlight=False)
    else:
        out.print(f"[red]FAIL[/red] {len(report.blocking)} node(s) cannot build", highlight=False)
        raise typer.Exit(1)


@app.command("bench")
@handle_errors
def bench_cmd(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="A decoder artifact folder; a checkpoint folder (config.json + safetensors: Mixtral, Qwen2/3-MoE, OLMoE, GraniteMoE, PhiMoE, GLM-4-MoE, MiniMax-M2, or moedeploy's own), exported once (fp32) into the cache and reused only while its weights fingerprint and config still match; or a preset (tiny, small), exported once into the cache. The cache: $MOEDEPLOY_CACHE, else $XDG_CACHE_HOME/moedeploy, else ~/.cache/moedeploy."),
    backend: str = typer.Option("torch,ort", "--backend", help="Comma-separated: torch, torch-compile, hf (transformers eager), ort, ort-gqa "
                                "(ort with attention on com.microsoft::GroupQueryAttention, appending to a preallocated KV cache in place), "
                                "ort-gqa-experts (ort-gqa with every fp32 MoE on one If per expert, the lowering "
                                "before each expert was cut into one piece per thread; which of the two decodes faster "
                                "depends on the machine: timed beside ort-gqa, the report says; `moedeploy tune` chooses it for an "
                                "artifact, and ort-gqa takes that choice on the folder it was made for, at its "
                                "--threads), ort-contrib (ort with "
                                "every MoE on com.microsoft::MoE), trt, llama.cpp (the same weights as an f32 GGUF, "
                                "written once into the cache), openvino (the graph ort runs, on OpenVINO's CPU plugin at "
                                "f32, its KV cache as state); the peers need `pip install 'moedeploy[peers]'`."),
    peers: bool = typer.Option(False, "--peers", help="Also time every peer engine installed here (llama.cpp, openvino) on the "
                               "same weights; the report says which were left out and how to install them."),
    rounds: int = typer.Option(1, "--rounds", min=1, max=100, help="Run every backend this many times, each in a fresh process, the "
                               "backends interleaved and their order rotated each round, so a busy spell of the machine hits them alike; with 2 or more, each ratio is also given paired by round (the median of the rounds' ratios), the figure to trust on a busy machine."),
    batch: int = typer.Option(1, "--batch", min=1, max=MAX_BENCH_BATCH, help="Sequences decoded together."),
    prompt_len: int = typer.Option(128, "--prompt-len", min=1, help="Prompt tokens (the prefill); with --new-tokens, at most the model's positions (tiny: 256, small: 2048)."),
    new_tokens: int = typer.Option(64, "--new-tokens", min=2, help="Greedy tokens generated after the prompt "
                                   "(the first comes from the prefill: at least 2, so a decode step is timed)."),
    threads: int = typer.Option(2, "--threads", min=1, max=MAX_THREADS, help="Intra-op threads for every backend."),
    repeat: int = typer.Option(3, "--repeat", min=1, max=100, help="Timed generations per backend (min / median / max reported; a spread over 10% is flagged)."),
    json_file: Path = typer.Option(None, "--json", help="Write {machine, results: [{backend, metric, value, unit}], spread, ...} here: a new file, or a report bench wrote before (anything else is refused, and so is a file inside an artifact)."),
    quantize: str = typer.Option(None, "--quantize", help="Comma-separated int8, int4: also export the preset or "
                                 "checkpoint weight-only quantized (cached beside its fp32 export) and time the "
                                 "ONNX Runtime backends on each, as rows '<backend> int8', each with its bytes on "
                                 "disk, bytes read per decode step and bandwidth bound. The exports are export's "
                                 "defaults (symmetric; int4 mixed, its LM head and K/V at int8); a quantized "
                                 "artifact of other options is benched by its folder."),
    block_size: int = typer.Option(32, "--block-size", help="With --quantize: weights per scale (a power of two, at least 16; an int8 LM head takes up to 256, as `export` does by default)."),
) -> None:
    """Benchmark prefill, decode and memory on each backend.

    Prefill latency, decode tokens/s, p50/p99 per-token latency and peak memory per backend. Each backend runs in its own process on the same seeded prompt, and every figure is set
    against the machine's measured limits: decode against bytes of weights per token / memory
    bandwidth, prefill against flops / GEMM rate. Every backend is checked (packages, GPU,
    engine) before any work; exit code 1 when one cannot run or fails. Every worker, peers
    included, starts with glibc's huge pages for malloc (MOEDEPLOY_HUGE_PAGES=0: off).
    """
    # the backends' names and packages now, before torch is imported; bench() checks again, and
    # that each can run here (a GPU for trt, a compiler for torch-compile)
    from moedeploy.bench.checks import require_installed

    if json_file is not None:
        check_json_target(json_file)
    backends = require_installed(b.strip() for b in backend.split(",") if b.strip())
    variants = [q.strip() for q in quantize.split(",") if q.strip()] if quantize is not None else None
    if quantize is not None and not variants:
        raise UserError("--quantize names int8, int4 or both, comma-separated")
    if not variants and given(ctx, "block_size"):
        raise UserError("--block-size applies with --quantize int8|int4 only")
    from moedeploy.bench.api import bench
    from moedeploy.bench.summary import cache_line, moe_path_line, paired_text, spread_lines
    from moedeploy.utils.progress import size_text

    check_cache_writable(target, backends, peers)
    with progress_steps("benchmarking") as progress:
        report = bench(target, backends, batch, prompt_len, new_tokens, threads, repeat, json_file,
                       progress=progress, peers=peers, rounds=rounds, quantize=variants, block_size=block_size)
    m, roof = report["machine"], report["roofline"]
    out.print(f"{m['cpu']}, {m['threads']} threads: {m['bandwidth_gbs']} GB/s read, {m['gemm_gflops']} GFLOP/s fp32 GEMM; "
              f"decode bound {roof['decode_bound_tokens_per_s']} tokens/s ({size_text(roof['decode_step_bytes'])}/step); "
              f"KV cache {roof['kv_cache_bytes_per_token']:,} bytes/token; workers' huge pages: {m['huge_pages']}", highlight=False)
    quantized = any(name.startswith("int") for name in report["variants"])  # an int8/int4 export among them
    if quantized:
        out.print("; ".join(f"{name}: {size_text(v['weight_bytes'])} of weights, {size_text(v['decode_step_bytes'])} "
                            f"read per step, bound {v['decode_bound_tokens_per_s']} tokens/s"
                            for name, v in report["variants"].items()), highlight=False)
    # p50 per-token latency is in the JSON (the decode rate is its reciprocal, near enough): the
    # table fits 80 columns
    table = make_table(None, ["backend", "prefill ms", "decode tok/s", "p99 ms", "peak RSS MB", "own MB", "of bound"])
    for r in report["raw"]:
        if "error" in r:
            continue
        table.add_row(r["backend"], f"{r['prefill_ms']:.1f}", f"{r['decode_tokens_per_s']:.1f}",
                      f"{r['token_latency_p99_ms']:.2f}", f"{r['peak_rss_mb']:.0f}",
                      f"{r['backend_rss_mb']:.0f} {r['backend_rss_vs_weights']:.2f}x",
                      f"{r['decode_tokens_per_s'] / r['decode_bound_tokens_per_s']:.0%}")
    out.print(table)
    if baselines := [r["baseline_rss_mb"] for r in report["raw"] if "error" not in r]:
        measured = ", ".join(f"{r['backend']} {r['bandwidth_gbs']:.1f}" for r in report["raw"] if "error" not in r)
        out.print(f"of bound: decode against bytes per step / the bandwidth each worker measured right after its "
                  f"timed runs (GB/s: {measured})", highlight=False)
        of_quantized = " (a quantized row: of its export's weights)" if quantized else ""
        out.print(f"own MB: a backend's peak RSS above its worker's baseline before loading (Python, torch: "
                  f"{min(baselines):.0f} MB), and that as a multiple of the weights' {size_text(roof['weight_bytes'])}"
                  f"{of_quantized}", highlight=False)
    for line in spread_lines(report):
        out.print(escape(line), highlight=False)
    for warning in report["warnings"]:
        err.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False, soft_wrap=True)
    for name, ratio in report["ratios"].items():
        paired = ratio.get("decode_speedup_paired")
        by_round = f" (paired by round: {paired_text(paired)})" if paired else ""
        out.print(f"{name}: decode x{ratio['decode_speedup']:.2f}{by_round}, prefill time "
                  f"x{ratio['prefill_time_ratio']:.2f}, peak memory x{ratio['peak_rss_ratio']:.2f}", highlight=False)
    if line := moe_path_line(report):
        out.print(escape(line), highlight=False)
    if chosen := report.get("moe_path"):  # the split's line says why the native kernel is not used
        out.print(escape(f"MoE path of ort and ort-gqa here: {chosen['path']} ({chosen['source']})"), highlight=False)
    if report["greedy_tokens_agree"] is False:  # None: the target is itself a quantized export (the note below)
        out.print("[yellow]warning:[/yellow] backends with the same weights generated different greedy tokens")
    if differ := [name for name, same in report.get("quantized_tokens_agree", {}).items() if not same]:
        whose = (f"this {differ[0]} export's backends'" if report["greedy_tokens_agree"] is None  # the target's own
                 else f"the {' and '.join(differ)} rows'")
        out.print(f"note: {whose} greedy tokens differ between backends: with int8 "
                  "activations each kernel rounds differently (`moedeploy compare` measures their accuracy)",
                  highlight=False)
    for peer, reason in report["peers_skipped"].items():
        err.print(f"[dim]--peers: {peer} left out: {escape(reason)}[/dim]", highlight=False, soft_wrap=True)
    if note := cache_line(report):
        err.print(f"[dim]{escape(note)}[/dim]", highlight=False, soft_wrap=True)
    failed = [r for r in report["raw"] if "error" in r]
    for r in failed:
        err.print(f"[bold red]error:[/bold red] {r['backend']}: {escape(r['error'])}", highlight=False, soft_wrap=True)
    if failed:
        raise typer.Exit(1)


@app.command("tune")
@handle_errors
def tune_cmd(
    artifact: Path = typer.Argument(..., help="fp32 decoder artifact folder made by `moedeploy export`."),
    threads: int = typer.Option(None, "--threads", min=1, max=MAX_THREADS, help="Intra-op threads of the sessions "
                                "that will use the choice (default: one per physical core, a session's default).",
                                show_default=False),
    rounds: int = typer.Option(8, "--rounds", min=1, max=100, help="Paired generations per path (their order "
                               "swapped every round); the choice is the median of the rounds' ratios."),
    prompt_len: int = typer.Option(128, "--prompt-len", min=1, help="Prompt tokens before each timed generation."),
    new_tokens: int = typer.Option(32, "--new-tokens", min=2, help="Greedy tokens per generation (all but the "
                                   "first are timed decode steps)."),
) -> None:
    """Choose this machine's fastest fp32 MoE path for a decoder, by timing each.

    A CPU session runs fp32 MoE layers with each expert cut into one piece per thread on
    com.microsoft::MoE (the default) or as one If per expert over prepacked Gemms. Which decodes
    faster depends on the machine (0.87-1.22x between CPUs, benchmarks/README.md). tune times
    both on this artifact in one process, in paired greedy generations, and records the faster
    in the artifact's cache/moe_path.json. Every later CPU session of this artifact on this CPU,
    at these threads, with huge pages as here (the moedeploy command's: on), with these model
    files and library versions, takes it: `bench` on this folder at the same --threads, serve,
    compare, OrtDecoder in Python. Anywhere else the record is ignored, with a warning.
    MOEDEPLOY_MOE_PATH (native, split or experts), when set, overrides it; deleting the file
    forgets it. Where the project's native MoE kernel is built (plugins/native; sessions take it
    by default there) it is timed too and kept unless it decodes more than 3% slower than the
    faster of the other two; such a record applies only while the same build of the kernel is
    here (and one made without the kernel only while it is off or not built).
    All paths compute the same result (`moedeploy compare --backend ort,ort-experts`). The
    ratio moves with context length too: tune at the --prompt-len you serve. The sessions are
    open at once, so tuning needs about twice the weights in memory (three times where the native
    kernel is built: its session holds the experts re-laid).
    """
    check_artifact_folder(artifact)
    from moedeploy.bench.spread import Spread
    from moedeploy.export import Artifact
    from moedeploy.runtime.moe_tuning import measure, memory_problem, record, write_problem
    from moedeploy.runtime.ort import MOE_PATH_ENV, default_threads, moe_path

    moe_path()  # a wrong MOEDEPLOY_MOE_PATH, which every session would refuse, refused now
    threads = threads or default_threads()
    if threads < 2:
        raise UserError("sessions at one thread read no tune record (nothing is cut into pieces: they take the native "
                        "kernel where it is built, else one If per expert); tune at the --threads your sessions run "
                        "with, 2 or more")
    loaded = Artifact.load(artifact)
    if loaded.kind == "decoder" and loaded.dtype != "fp32":
        raise UserError(f"{artifact} holds {loaded.dtype} weights; the MoE paths tune chooses between are fp32's")
    if "quantization" in loaded.manifest:
        raise UserError(f"{artifact} is a quantized export: its experts run on com.microsoft::QMoE, one path; "
                        "tune chooses between the fp32 ones")
    if problem := write_problem(loaded):
        raise UserError(f"{problem}; or choose the path without measuring: {MOE_PATH_ENV}=native|split|experts")
    if problem := memory_problem(loaded):
        raise UserError(problem)
    if os.environ.get(MOE_PATH_ENV, "").strip():
        err.print(f"[yellow]note:[/yellow] {MOE_PATH_ENV} is set in this shell and overrides the record for every "
                  "session started from it", highlight=False)
    with progress_steps("tuning the MoE path") as progress:
        tuning = measure(loaded, threads, rounds, prompt_len, new_tokens, progress)
        path = record(loaded, threads, tuning)
    table = make_table(None, ["path", "what", "step ms (median)", "min", "max"], text=("path", "what"))
    for name, what in (("split", "experts in pieces, com.microsoft::MoE"), ("experts", "one If per expert"),
                       ("native", "the project's kernel (plugins/native)")):
        if (times := getattr(tuning, f"{name}_ms")) is not None:
            ms = Spread.of(times)
            table.add_row(name, what, f"{ms.median:.3f}", f"{ms.low:.3f}", f"{ms.high:.3f}")
    out.print(table)
    ratios = f"split / experts step time x{tuning.ratio:.3f}"
    if tuning.native_ratio is not None:
        ratios += f", native / the faster of them x{tuning.native_ratio:.3f}"
    out.print(f"{threads} threads, {rounds} rounds paired: {escape(tuning.verdict)} ({ratios}): sessions of this "
              f"artifact here take [bold]{tuning.path}[/bold]", highlight=False)
    if not tuning.tokens_identical:
        err.print("[yellow]warning:[/yellow] the paths decoded different greedy tokens (a near tie rounded apart); "
                  "`moedeploy compare --backend ort,ort-experts` checks each against eager PyTorch", highlight=False)
    err.print(f"[dim]recorded in {escape(str(path))} (delete it to return to the default)[/dim]", highlight=False,
              soft_wrap=True)


from moedeploy.serving.cli import register as register_serving  # noqa: E402 (after the shared helpers it uses)

register_serving(app)


def main() -> None:
    exit_on_sigterm()
    try:
        app()  # standalone: always ends in SystemExit
    except SystemExit as e:
        quiet_after_the_command(e.code)
        raise


def quiet_after_the_command(code: Any) -> None:
    """Once the command has finished, Ctrl-C or SIGTERM during the interpreter's shutdown (torch's
    atexit hooks take a moment) ends the process with the command's own exit status, its work
    done: not with an 'Exception ignored in atexit callback' traceback and exit 0."""
    status = code if isinstance(code, int) else (0 if code is None else 1)

    def finished(_signum: int, _frame: Any) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)

    signal.signal(signal.SIGTERM, finished)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, finished)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit(143), so it unwinds like Ctrl-C: a write in progress removes
    its temp folder on the way out instead of leaving it beside the output (`kill`, a CI
    timeout or a container stop all send SIGTERM). Both it and Ctrl-C are recorded for
    handle_errors, which may see them as another exception (ImportError, from a C extension's
    initialisation they interrupted)."""

    def terminate(signum: int, _frame: Any) -> None:
        _state["signal"] = signum
        raise SystemExit(128 + signum)

    def interrupt(signum: int, frame: Any) -> None:
        _state["signal"] = signum
        signal.default_int_handler(signum, frame)  # KeyboardInterrupt, as Python's own handler

    signal.signal(signal.SIGTERM, terminate)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where Ctrl-C is ignored
        signal.signal(signal.SIGINT, interrupt)


if __name__ == "__main__":
    main()
