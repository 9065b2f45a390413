"""The `moedeploy` console script, run as a user runs it (a subprocess): one clear error line
and nothing left on disk for every user error, a traceback only with --debug."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from moedeploy.export import BLOCKS

SCRIPT = Path(sys.executable).with_name("moedeploy")  # the installed entry point
BULLET = "  •"  # progress lines the CLI prints to stderr while it works


def moedeploy_cmd() -> list[str]:
    return [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "moedeploy.cli"]


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run(
        moedeploy_cmd() + args, cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )


def snapshot(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith(BULLET)]


# --- user errors: each case sets up its folder, runs in parallel with the others --------------


def _bad_json(d: Path) -> None:
    (d / "bad").mkdir()
    (d / "bad" / "config.json").write_text("{not json")


def _not_mixtral(d: Path) -> None:
    (d / "llama").mkdir()
    (d / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))


def _hf_config(model_type: str, **changes) -> Callable[[Path], None]:
    """A checkpoint folder whose config.json is of a supported family but asks for something the
    decoder does not implement (it is refused from config.json alone: no weights needed)."""

    def setup(d: Path) -> None:
        config = {"model_type": model_type, "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts_per_tok": 2, "num_experts": 4,
                  "num_local_experts": 4, "n_routed_experts": 4, "moe_intermediate_size": 8, "intermediate_size": 8,
                  **changes}
        (d / "ckpt").mkdir()
        (d / "ckpt" / "config.json").write_text(json.dumps(config))

    return setup


def _a_file(d: Path) -> None:
    (d / "file").write_text("not a folder")


def _nothing(d: Path) -> None:
    pass


def _user_folder(d: Path) -> None:
    """A folder of the user's that an --out typo points at."""
    (d / "mine").mkdir()
    (d / "mine" / "important.txt").write_text("the user's work")


def _user_file(d: Path) -> None:
    (d / "important.txt").write_text("the user's work")


@dataclass
class Case:
    args: list[str]
    setup: Callable[[Path], None]
    message: str  # a phrase the one error line must contain
    out: str = "out"
    in_process: bool = False  # run through typer's CliRunner: same code, no interpreter start-up


# Through the installed console script (a fresh interpreter, as a user runs it).
CASES = {
    "unknown-block": Case(["export", "nosuch", "--out", "out"], _nothing, "unknown block 'nosuch'"),
    "missing-checkpoint": Case(
        ["export", "decoder", "--checkpoint", "missing", "--out", "out"], _nothing, "does not exist"
    ),
    "checkpoint-bad-json": Case(
        ["export", "decoder", "--checkpoint", "bad", "--out", "out"], _bad_json, "not readable JSON"
    ),
    "invalid-dtype": Case(
        ["export", "rmsnorm", "--dtype", "fp8", "--out", "out"], _nothing, "invalid dtype 'fp8'"
    ),
    "out-under-a-file": Case(
        ["export", "rmsnorm", "--out", "file/sub/art"], _a_file, "cannot write", out="file/sub/art"
    ),
    "out-in-proc": Case(
        ["export", "rmsnorm", "--out", "/proc/moedeploy-test-out"], _nothing, "cannot write",
        out="/proc/moedeploy-test-out",
    ),
}
# More of the same kind, in process (each console-script run costs seconds of torch import).
CASES |= {
    name: Case(args, setup, message, out, in_process=True)
    for name, (args, setup, message, out) in {
        "checkpoint-not-mixtral": (
            ["export", "decoder", "--checkpoint", "llama", "--out", "out"], _not_mixtral, "llama", "out"
        ),
        "checkpoint-unknown-family": (
            ["export", "decoder", "--checkpoint", "ckpt", "--out", "out"], _hf_config("dbrx"),
            "model_type 'dbrx' is not supported", "out",
        ),
        "checkpoint-scaled-rope": (
            ["export", "decoder", "--checkpoint", "ckpt", "--out", "out"],
            _hf_config("qwen3_moe", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
            "Qwen3-MoE: rope_type='yarn' is not supported", "out",
        ),
        "checkpoint-quantized": (
            ["export", "decoder", "--checkpoint", "ckpt", "--out", "out"],
            _hf_config("glm4_moe", quantization_config={"quant_method": "fp8"}),
            "quant_method='fp8' is not supported", "out",
        ),
        "checkpoint-phimoe-top3": (
            ["export", "decoder", "--checkpoint", "ckpt", "--out", "out"],
            _hf_config("phimoe", num_experts_per_tok=3), "num_experts_per_tok=3 is not supported", "out",
        ),
        "checkpoint-is-a-file": (
            ["export", "decoder", "--checkpoint", "file", "--out", "out"], _a_file, "not a folder", "out"
        ),
        "out-is-a-file": (["export", "rmsnorm", "--out", "file"], _a_file, "not a folder", "file"),
        "missing-out": (["export", "rmsnorm"], _nothing, "--out", "out"),
        "unknown-preset": (
            ["export", "decoder", "--preset", "huge", "--out", "out"], _nothing, "unknown preset", "out"
        ),
        "checkpoint-for-a-block": (
            ["export", "rmsnorm", "--checkpoint", "missing", "--out", "out"], _nothing, "decoder only", "out"
        ),
        "out-is-a-user-folder": (
            ["export", "rmsnorm", "--out", "mine"], _user_folder, "not written by moedeploy", "mine"
        ),
        "out-is-the-current-folder": (["export", "rmsnorm", "--out", "."], _user_file, "current folder", "."),
        "all-into-a-user-folder": (["all", "--out", "mine"], _user_folder, "did not write", "mine"),
        "preset-for-a-block": (["export", "moe", "--preset", "small", "--out", "out"], _nothing, "decoder only", "out"),
        "preset-and-checkpoint": (
            ["export", "decoder", "--preset", "small", "--checkpoint", "llama", "--out", "out"], _not_mixtral,
            "drop --preset", "out",
        ),
        "calibration-without-batchnorm": (
            ["export", "moe", "--calibration-batches", "2", "--out", "out"], _nothing, "BatchNorm only", "out"
        ),
        "negative-calibration": (
            ["export", "batchnorm", "--calibration-batches", "-1", "--out", "out"], _nothing,
            "calibration", "out",
        ),
    }.items()
}


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def run_in_process(args: list[str], cwd: Path) -> Run:
    from typer.testing import CliRunner

    from moedeploy.cli import app

    old = Path.cwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, args)
    finally:
        os.chdir(old)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception  # not a crash
    return Run(result.exit_code, result.stdout, result.stderr)


@pytest.fixture(scope="module")
def error_runs(tmp_path_factory) -> dict[str, tuple[Path, set[str], Run]]:
    """Every case's folder, its contents before, and the run; the console-script runs go in
    parallel (each spends most of its time importing torch)."""
    prepared = {}
    for name, case in CASES.items():
        folder = tmp_path_factory.mktemp(f"cli-{name}")
        case.setup(folder)
        prepared[name] = (folder, snapshot(folder))
    runs: dict[str, Run] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(run_cli, case.args, prepared[name][0])
            for name, case in CASES.items() if not case.in_process
        }
        for name, case in CASES.items():
            if case.in_process:
                runs[name] = run_in_process(case.args, prepared[name][0])
        for name, future in futures.items():
            r = future.result()
            runs[name] = Run(r.returncode, r.stdout, r.stderr)
    return {name: (*prepared[name], runs[name]) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_user_error_is_one_line_and_leaves_nothing(error_runs, name: str) -> None:
    folder, before, result = error_runs[name]
    case = CASES[name]
    assert result.returncode == 1
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stdout == ""
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert case.message in lines[0]
    # nothing left behind: no out folder, no temp or probe folder, nothing else changed
    assert snapshot(folder) == before
    out = Path(case.out) if Path(case.out).is_absolute() else folder / case.out
    if case.out not in before and case.out != ".":  # an --out that was there stays as it was (above)
        assert not os.path.lexists(out)


@pytest.mark.parametrize(("args", "message"), [
    (["export", "rmsnorm", "--seed", "99999999999999999999", "--out", "out"], "'--seed': Input should be less than or equal to 4294967295"),
    (["all", "--seed", "-1", "--out", "out"], "'--seed': Input should be greater than or equal to 0"),
    (["compare", "art", "--iterations", "1000000000000"], "'--iterations': Input should be less than or equal to 1000"),
    # click's float ranges let NaN through: a NaN tolerance failed every output, an infinite one passed any
    (["compare", "art", "--atol", "nan"], "'--atol': nan is not a finite number >= 0"),
    (["compare", "art", "--rtol", "inf"], "'--rtol': inf is not a finite number >= 0"),
    (["compare", "art", "--atol", "-1e-3"], "'--atol': -0.001 is not a finite number >= 0"),
    (["compare", "art", "--min-top1", "nan"], "'--min-top1': nan is not a fraction of positions from 0 to 1"),
    # one new token is the prefill's: no decode step was timed, and bench reported 0.0 tokens/s as measured
    (["bench", "tiny", "--new-tokens", "1"], "'--new-tokens': Input should be greater than or equal to 2"),
    (["bench", "tiny", "--threads", "2147483648"], "'--threads': Input should be less than or equal to 1024"),
    (["bench", "tiny", "--repeat", "0"], "'--repeat': Input should be greater than or equal to 1"),
    # checked after TensorRT was found: here, without it, "TensorRT is not installed" hid the bad value
    (["build", "art", "--workspace", "-1"], "'--workspace': Input should be greater than or equal to 1"),
])
def test_option_values_out_of_range_are_usage_errors(args: list[str], message: str, tmp_path: Path) -> None:
    """A seed past 32 bits overflowed deep inside, a trillion iterations ran out of memory: both
    are refused as they are parsed, one line and exit 2 (a usage error), nothing written."""
    result = run_in_process(args, tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert len(error_lines(result.stderr)) == 1 and message in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_empty_bench_target_is_refused_not_taken_for_the_working_folder(tmp_path: Path) -> None:
    """Path("") is ".": `bench ""` benched the working folder and named it as ''."""
    result = run_in_process(["bench", ""], tmp_path)
    assert result.returncode == 1 and result.stdout == ""
    assert error_lines(result.stderr) == [
        "error: no target given; pass an artifact folder, a checkpoint folder or a preset (tiny, small)"]
    assert list(tmp_path.iterdir()) == []


def test_errors_that_need_no_work_print_only_the_error_line(error_runs) -> None:
    """Argument errors fail before any work starts, so not even a progress line is printed."""
    for name in ("unknown-block", "invalid-dtype", "out-under-a-file", "out-is-a-file", "out-in-proc"):
        _, _, result = error_runs[name]
        assert len(result.stderr.splitlines()) == 1, (name, result.stderr)


def test_long_paths_do_not_wrap_progress_lines(tmp_path: Path) -> None:
    missing = tmp_path / ("a-long-folder-name-" * 4) / "checkpoint"
    result = run_cli(["export", "decoder", "--checkpoint", str(missing), "--out", "out"], tmp_path)
    assert result.returncode == 1
    assert "does not exist" in result.stderr
    assert len(error_lines(result.stderr)) == 1, result.stderr


def test_a_bug_of_ours_is_one_line_without_debug(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import moedeploy.export as export_module
    from moedeploy.cli import app

    def broken(*args, **kwargs):
        raise KeyError("nosuch")

    monkeypatch.setattr(export_module, "export", broken)
    result = CliRunner().invoke(app, ["export", "rmsnorm", "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "internal error, KeyError: 'nosuch' (a bug in moedeploy: rerun with --debug" in " ".join(result.output.split())


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = run_cli(["--debug", "export", "nosuch", "--out", "out"], tmp_path)
    assert result.returncode != 0
    assert "Traceback (most recent call last)" in result.stderr
    assert "UserError: unknown block 'nosuch'" in result.stderr
    # the user's error is the last thing shown, not a failure of the error handling after it
    assert result.stderr.strip().splitlines()[-1].startswith("moedeploy.cli.UserError: unknown block"), result.stderr
    assert "During handling of the above exception" not in result.stderr
    assert snapshot(tmp_path) == set()


# --- success paths ---------------------------------------------------------------------------------


def test_list_prints_one_block_per_line_name_first(tmp_path: Path) -> None:
    result = run_cli(["export", "--list"], tmp_path)
    assert result.returncode == 0
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert [line.split("\t")[0] for line in lines] == [*BLOCKS, "decoder"]
    assert all(len(line.split("\t")) == 2 and line.split("\t")[1].strip() for line in lines)
    assert snapshot(tmp_path) == set()


@pytest.fixture(scope="module")
def exported_rmsnorm(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One real `moedeploy export rmsnorm --out X`, stderr a pipe: its folder and its output are only read."""
    folder = tmp_path_factory.mktemp("export-rmsnorm")
    return folder, run_cli(["export", "rmsnorm", "--out", "X"], folder)


def test_export_rmsnorm_creates_the_artifact(exported_rmsnorm) -> None:
    tmp_path, result = exported_rmsnorm
    assert result.returncode == 0, result.stderr
    assert "exported rmsnorm" in result.stdout
    assert all(line.startswith(BULLET) for line in result.stderr.splitlines())
    assert "Traceback" not in result.stderr
    files = snapshot(tmp_path)
    assert {"X", "X/model.onnx", "X/manifest.json", "X/golden", "X/golden/inputs.json", "X/golden/outputs.json"} <= files
    assert all(f == "X" or f.startswith("X/") for f in files)  # no temp folder left beside it
    manifest = json.loads((tmp_path / "X" / "manifest.json").read_text())
    listed = {f"X/{rel}" for rel in manifest["files"]} | {"X/manifest.json"}
    assert {f for f in files if (tmp_path / f).is_file()} == listed
    assert (manifest["name"], manifest["kind"], manifest["dtype"]) == ("rmsnorm", "block", "fp32")


# --- usage mistakes and help -----------------------------------------------------------------------


@pytest.mark.parametrize(("args", "phrase"), [
    (["export", "--bogus"], "No such option: --bogus"),
    (["export", "rmsnorm", "--out"], "requires an argument"),
    (["compare"], "Missing argument"),
    (["nosuch"], "No such command"),
])
def test_usage_mistakes_are_one_line_and_exit_2(tmp_path: Path, args: list[str], phrase: str) -> None:
    """Like every command-line tool, a command line it cannot parse exits 2 (README says so),
    with the same one error line as any other error and where to look."""
    result = run_in_process(args, tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0], result.stderr
    assert "--help" in lines[0]
    assert snapshot(tmp_path) == set()


def test_bare_moedeploy_prints_help_with_where_to_start(tmp_path: Path) -> None:
    result = run_in_process([], tmp_path)
    assert result.returncode == 0
    assert "Start with `moedeploy all --out out`" in " ".join(result.stdout.split())
    assert "Commands:" in result.stdout and "export" in result.stdout


def test_help_has_no_placeholders_on_flags_and_keeps_examples(tmp_path: Path) -> None:
    result = run_in_process(["export", "--help"], tmp_path)
    assert result.returncode == 0
    assert "<bool>" not in result.stdout and "╭" not in result.stdout  # no boxes, no metavar on flags
    assert "\n    moedeploy export decoder --preset small --out artifacts/decoder\n" in result.stdout
    assert all(len(line) <= 80 for line in result.stdout.splitlines())


def test_compare_help_states_the_quantization_bars_compare_applies(tmp_path: Path) -> None:
    """The defaults --help names are the thresholds compare judges by (compare/quantization.py)."""
    from moedeploy.compare.quantization import THRESHOLDS

    result = run_in_process(["compare", "--help"], tmp_path)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert f"(default {THRESHOLDS[8]['kl_mean']} for int8, {THRESHOLDS[4]['kl_mean']} for int4)" in text
    assert f"(default {THRESHOLDS[8]['top1']} for int8, {THRESHOLDS[4]['top1']} for int4)" in text


# --- output in a CI log or a pipe: 80 columns, no spinner ----------------------------------------


def _render_at_80_columns(monkeypatch, print_fn) -> str:
    import io

    from rich.console import Console

    from moedeploy import cli

    buffer = io.StringIO()
    monkeypatch.setattr(cli, "out", Console(file=buffer, width=80, color_system=None))
    print_fn()
    return buffer.getvalue()


def test_tables_at_80_columns_keep_every_name_and_figure(monkeypatch) -> None:
    from moedeploy import cli

    names = ["logits", "present.0.key", "present.11.value", "batchnorm1d_transpose_mlp_y"]
    stats = {"max_abs": 1.234e-6, "p99_abs": 4.5e-7, "max_rel": 7.8e-5, "cosine": 0.99999999,
             "atol": 1e-5, "rtol": 1e-5, "passed": True}
    report = {"passed": True, "first_divergent_layer": None,
              "comparisons": [{"backend": "onnxrt", "reference": "torch-eager", "outputs": dict.fromkeys(names, stats)}]}
    text = _render_at_80_columns(monkeypatch, lambda: cli._print_report(report))
    assert "…" not in text
    assert all(len(line) <= 80 for line in text.splitlines())
    squeezed = "".join(text.split())  # a long name may fold onto a second line of its cell
    for name in names[:3]:
        assert any(line.split()[:1] == [name] for line in text.splitlines()), (name, text)  # short names whole
    assert "batchnorm1d" in squeezed and "1.23e-06" in text and "0.99999999" in text


def test_progress_in_a_pipe_is_lines_with_elapsed_time_and_a_total(exported_rmsnorm) -> None:
    _, result = exported_rmsnorm  # the same export run as above: its stderr was a pipe
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) >= 3 and all(line.startswith(BULLET) for line in lines)
    assert " s  exporting rmsnorm: tracing to ONNX" in result.stderr
    assert lines[-1].startswith(f"{BULLET} exporting rmsnorm: done in ") and lines[-1].endswith(" s")


CTRL_C_WHILE_IMPORTING = textwrap.dedent("""
    import sys

    class CtrlC:  # a Ctrl-C that lands while the CLI's modules load (which takes seconds)
        def find_spec(self, name, path=None, target=None):
            if name == "moedeploy.cli":
                raise KeyboardInterrupt
            return None

    sys.meta_path.insert(0, CtrlC())
    from moedeploy.__main__ import main
    main()
""")


def test_ctrl_c_while_the_cli_loads_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """The console script imported the CLI before any of moedeploy's code could catch a Ctrl-C."""
    result = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_IMPORTING], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (130, "", "interrupted\n")


SIGNAL_AT_EXIT = """
import atexit, os, signal, sys, time
sys.argv = ["moedeploy", *sys.argv[1:]]
from moedeploy.cli import main

def signal_while_shutting_down():  # as a Ctrl-C that lands while torch's own atexit hooks run
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)

atexit.register(signal_while_shutting_down)
main()
"""


@pytest.mark.parametrize(("argv", "status"), [(["version"], 0), (["check", "no-such-artifact"], 1)])
def test_ctrl_c_after_the_command_finished_keeps_its_exit_status_without_a_traceback(argv, status, tmp_path) -> None:
    """A Ctrl-C during the interpreter's shutdown, the command's work done, printed 'Exception
    ignored in atexit callback' with a KeyboardInterrupt traceback, and the exit status said 0."""
    result = subprocess.run([sys.executable, "-c", SIGNAL_AT_EXIT, *argv], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr
    assert ("moedeploy" in result.stdout) if status == 0 else ("no-such-artifact" in result.stderr)


def test_the_cli_loads_without_torch_or_onnx() -> None:
    """`moedeploy --help` and option errors took 3.6 s: moedeploy.serving imported its server, and
    with it torch and ONNX, as the CLI registered the serving commands. The commands import them
    when they run."""
    done = subprocess.run([sys.executable, "-c", "import sys, moedeploy.cli; "
                           "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'onnx_ir') if m in sys.modules))"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_mistakes_seen_on_the_command_line_are_refused_without_loading_torch(tmp_path: Path) -> None:
    """A mistyped block, dtype, preset, --target, backend, artifact or checkpoint path, and `export --list`,
    took 5-6 s each: the command imported the exporter (torch, ONNX) before looking at its
    arguments. They are answered from moedeploy.names now; each still exits 1 with its line. So
    are options that do not go together, a checkpoint's unreadable config.json, and a backend
    whose package is missing (TensorRT: 5-7 s each before), a checkpoint of a family moedeploy
    does not take or with a field of the wrong type, `families`, and `all --dtype bf16` where ONNX
    Runtime has only its CPU provider (5-7 s before)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "config.json").write_text("{not json")
    (tmp_path / "art").mkdir()  # an artifact at a glance: its manifest is read only once torch is loaded
    (tmp_path / "llama").mkdir()  # a family moedeploy does not take
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (tmp_path / "mixtral").mkdir()  # a head count written as a string
    (tmp_path / "mixtral" / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": "4", "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "intermediate_size": 96, "max_position_embeddings": 128}))
    (tmp_path / "art" / "manifest.json").write_text("{}")
    script = textwrap.dedent("""
        import contextlib, io, json, sys
        from moedeploy.cli import app
        runs = []
        for args in json.loads(sys.argv[1]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    app(args, prog_name="moedeploy")
                    code = 0
                except SystemExit as e:
                    code = e.code
            runs.append([code, err.getvalue()])
        print(json.dumps({"runs": runs, "torch": "torch" in sys.modules}))
    """)
    cases = [
        (["export", "nosuch", "--out", "out"], 1, "unknown block 'nosuch'"),
        (["export", "rmsnorm", "--dtype", "fp8", "--out", "out"], 1, "invalid dtype 'fp8'; choose one of: fp32, fp16, bf16"),
        (["export", "decoder", "--preset", "huge", "--out", "out"], 1, "unknown preset 'huge'; choose one of: tiny, small"),
        (["export", "mlp", "--fold-bn", "--out", "out"], 1, "applies to blocks with BatchNorm only"),
        (["export", "decoder", "--checkpoint", "nowhere", "--out", "out"], 1, "checkpoint folder nowhere does not exist"),
        (["export", "decoder", "--checkpoint", "empty", "--out", "out"], 1, "empty has no config.json"),
        (["all", "--dtype", "int8"], 1, "invalid dtype 'int8'"),
        (["check", "empty", "--target", "xla"], 1, "unknown --target 'xla'"),
        (["check", "nowhere"], 1, "artifact nowhere does not exist"),
        (["compare", "empty"], 1, "empty has no manifest.json"),
        (["build", "nowhere"], 1, "artifact nowhere does not exist"),
        (["bench", "tiny", "--backend", "tpu"], 1, "unknown backend 'tpu' in --backend"),
        (["compare", "empty", "--backend", "ort,tensorflow"], 1, "empty has no manifest.json"),
        (["all", "--backend", "ort,tensorflow"], 1, "unknown backend 'tensorflow' in --backend; choose from: ort,"),
        (["export", "--list"], 0, ""),
        (["version"], 0, ""),
        (["export", "decoder", "--checkpoint", "badjson", "--out", "out"], 1, "config.json is not readable JSON"),
        (["export", "rmsnorm", "--checkpoint", "empty", "--out", "out"], 1, "--checkpoint applies to the decoder only"),
        (["export", "decoder", "--preset", "small", "--checkpoint", "empty", "--out", "out"], 1, "drop --preset"),
        (["export", "moe", "--quantize", "int8", "--out", "out"], 1, "--quantize applies to the decoder only"),
        (["all", "--backend", "ort-gqa"], 1, "--backend ort-gqa runs the decoder only"),
        (["export", "decoder", "--checkpoint", "llama", "--out", "out"], 1,
         "llama/config.json: model_type 'llama' is not supported; supported: mixtral,"),
        (["export", "decoder", "--checkpoint", "mixtral", "--out", "out"], 1,
         "mixtral/config.json: Mixtral: num_attention_heads is '4', not an integer; fix it in config.json"),
        (["compare", "art", "--checkpoint", "llama"], 1, "model_type 'llama' is not supported"),
        (["families"], 0, ""),
    ]
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():  # bf16 has no kernels on the CPU provider
        cases.append((["all", "--dtype", "bf16"], 1, "--dtype bf16 stops before exporting: ONNX Runtime's CPU provider "
                      "has no bfloat16 kernels"))
    if importlib.util.find_spec("tensorrt") is None:
        cases += [(["all", "--backend", "ort,trt"], 1, "stops before exporting: TensorRT is not installed"),
                  (["build", "art"], 1, "TensorRT is not installed"),
                  (["compare", "art", "--backend", "ort,trt"], 1, "TensorRT is not installed"),
                  (["bench", "tiny", "--backend", "ort,trt"], 1, "backend 'trt': TensorRT is not installed")]
    done = subprocess.run([sys.executable, "-c", script, json.dumps([args for args, _, _ in cases])], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for (args, code, message), (got_code, stderr) in zip(cases, result["runs"], strict=True):
        assert got_code == code, (args, stderr)
        assert message in stderr and len(stderr.splitlines()) == (1 if code else 0), (args, stderr)
    assert result["torch"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "badjson", "empty", "llama", "mixtral"]
    assert [p.name for p in (tmp_path / "art").iterdir()] == ["manifest.json"]


def test_the_names_the_command_line_checks_are_the_ones_the_code_builds() -> None:
    """moedeploy.names holds what the CLI checks without torch; the builders check at import
    that they cover exactly those names, in order, so neither side can gain a name alone."""
    from moedeploy import names
    from moedeploy.compare.api import COMPARE_BACKENDS
    from moedeploy.export.artifact import DTYPES
    from moedeploy.models.config import PRESETS

    assert list(DTYPES) == list(names.DTYPES) and list(PRESETS) == list(names.PRESETS)
    assert COMPARE_BACKENDS == names.COMPARE_BACKENDS
    names.check_same_names("blocks", ["a", "b"], ["a", "b"])
    for built, named in ((["a", "b"], ["b", "a"]), (["a"], ["a", "b"]), (["a", "b"], ["a"])):
        with pytest.raises(RuntimeError, match="blocks are out of step"):
            names.check_same_names("blocks", built, named)
    # which blocks fold BatchNorm, from the modules themselves
    from moedeploy.export.blocks import build_block
    from moedeploy.export.fold import has_batchnorm

    assert {n for n, s in BLOCKS.items() if has_batchnorm(build_block(s, 0))} == names.BATCHNORM_BLOCKS


def test_every_user_error_class_the_cli_names_exists() -> None:
    """handle_errors takes moedeploy's error classes from the modules already loaded, by name: a
    renamed class or module would turn its one-line errors into "internal error" reports."""
    import importlib

    from moedeploy import cli
    from moedeploy.export import ArtifactError, ExportError
    from moedeploy.models import CheckpointError
    from moedeploy.plugins.native import NativeUnavailable
    from moedeploy.runtime.lowering import LoweringError
    from moedeploy.runtime.ort import SessionError
    from moedeploy.runtime.tensorrt import TensorRTUnavailable

    for module, name in cli._USER_ERROR_CLASSES:
        assert issubclass(getattr(importlib.import_module(module), name), Exception), (module, name)
    assert set(cli._user_errors()) == {cli.UserError, ValueError, OSError, ArtifactError, ExportError,
                                       CheckpointError, LoweringError, SessionError, TensorRTUnavailable,
                                       NativeUnavailable}
