"""The `moedeploy` command: a thin layer over the Python API, one function per subcommand."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="moedeploy",
    help="Export PyTorch transformer blocks and MoE decoders to ONNX / TensorRT and prove them right.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
) -> None:
    """moedeploy: model -> ONNX artifact -> ONNX Runtime / TensorRT -> comparison, serving, benchmarks."""
    global _DEBUG
    _DEBUG = debug


_DEBUG = False


@app.command()
def version() -> None:
    """Print the versions of moedeploy and the libraries it depends on."""
    import onnx
    import onnxruntime
    import torch

    import moedeploy

    typer.echo(f"moedeploy {moedeploy.__version__}")
    typer.echo(f"torch {torch.__version__}, onnx {onnx.__version__}, onnxruntime {onnxruntime.__version__}")


def main() -> None:
    app()
