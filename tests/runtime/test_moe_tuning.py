"""`moedeploy tune`: the faster fp32 MoE path measured on an artifact, kept, and used only where
the record still describes the machine, the model files and the libraries."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moedeploy.cli import app
from moedeploy.export.artifact import DERIVED_FILES, Artifact
from moedeploy.runtime import moe_tuning
from moedeploy.runtime.moe_tuning import TUNED_FILE, Tuning, choose, choose_native, record
from moedeploy.runtime.ort import CACHE_DIR, CPU, create_session


def test_the_choice_is_the_median_of_the_paired_ratios() -> None:
    # split / experts by round: 10/9 = 1.111, 12/10 = 1.2, 9/10 = 0.9 -> median 1.111
    path, verdict, ratio = choose([10.0, 12.0, 9.0], [9.0, 10.0, 10.0])
    assert (path, round(ratio, 3)) == ("experts", 1.111) and verdict == "the If per expert decoded x1.11 the split's speed"
    # 9/10 = 0.9, 9.9/10 = 0.99 -> 0.945: the split, 1/0.945 = 1.058 its speed
    path, verdict, ratio = choose([9.0, 9.9], [10.0, 10.0])
    assert (path, round(ratio, 3)) == ("split", 0.945) and verdict == "the split decoded x1.06 the If per expert's speed"
    # 10.2/10 = 1.02, 9.9/10 = 0.99 -> 1.005: within 3%, the default stays
    path, verdict, _ = choose([10.2, 9.9], [10.0, 10.0])
    assert path == "split" and verdict.startswith("no clear difference (x1.00)")
    # medians alone would say experts (10.5 against 10.0); paired, each round says split
    assert choose([9.0, 10.0, 10.5, 11.0, 12.0], [9.5, 10.5, 10.0, 11.5, 12.5])[0] == "split"


def test_the_native_kernel_stays_unless_it_decodes_clearly_slower() -> None:
    # native / split by round: 9/10 = 0.9, 10/10 = 1.0, 9.5/10 = 0.95 -> median 0.95, 1/0.95 = 1.053
    path, verdict, ratio = choose_native("split", [10.0, 10.0, 10.0], [9.0, 10.0, 9.5])
    assert (path, round(ratio, 3)) == ("native", 0.95) and verdict == "the native kernel decoded x1.05 the split's speed"
    # 10.2/10 twice -> 1.02: within 3%, the kernel (the default where it is built) stays
    path, verdict, _ = choose_native("experts", [10.0, 10.0], [10.2, 10.2])
    assert path == "native" and verdict == "no clear difference to the If per expert (x1.02): the native kernel stays"
    # 11/10, 12/10, 10/10 -> median 1.1: the other path
    path, verdict, ratio = choose_native("experts", [10.0, 10.0, 10.0], [11.0, 12.0, 10.0])
    assert (path, round(ratio, 3)) == ("experts", 1.1)
    assert verdict == "the If per expert decoded x1.10 the native kernel's speed"


@pytest.fixture()
def own_decoder(store, tmp_path: Path) -> Artifact:
    """A private copy of the tiny fp32 decoder (tune writes into its cache/)."""
    folder = tmp_path / "decoder"
    shutil.copytree(store.decoder("fp32").path, folder, ignore=shutil.ignore_patterns(CACHE_DIR, "report"))
    return Artifact.load(folder)


def moe_path_of(artifact: Artifact, threads: int, **kwargs) -> str:
    lowered = create_session(artifact, [CPU], threads=threads, **kwargs).lowering
    assert lowered["moe_split"] + lowered["moe_experts"] == 2  # the tiny decoder's two MoE layers, one way or the other
    return "split" if lowered["moe_split"] else "experts"


def _edit_entry(artifact: Artifact, **changes) -> None:
    path = artifact.path / CACHE_DIR / TUNED_FILE
    saved = json.loads(path.read_text())
    saved["entries"][0].update(changes)
    path.write_text(json.dumps(saved))


def test_a_session_takes_the_tuned_path_only_where_the_record_describes_it(own_decoder, monkeypatch, caplog) -> None:
    artifact = own_decoder
    monkeypatch.setattr(moe_tuning, "_warned", set())
    assert moe_path_of(artifact, 2) == "split"  # no record: the default
    record(artifact, 2, Tuning("experts", "measured", 1.1, [1.1], [1.0], True))
    assert moe_path_of(artifact, 2) == "experts"
    assert moe_path_of(artifact, 2, moe_lowering="contrib") == "split"  # asked for com.microsoft::MoE: still cut
    monkeypatch.setenv("MOEDEPLOY_MOE_PATH", "split")  # the variable overrides the record
    assert moe_path_of(artifact, 2) == "split"
    monkeypatch.delenv("MOEDEPLOY_MOE_PATH")
    with caplog.at_level(logging.WARNING, logger="moedeploy.runtime.moe_tuning"):
        assert moe_path_of(artifact, 3) == "split"  # tuned at 2 threads, not 3 (96 = 3 x 32: cut into three)
    assert "it was measured at 2 threads, this session runs 3" in caplog.text and "--threads 3" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moedeploy.runtime.moe_tuning"):
        assert moe_path_of(artifact, 3) == "split"
    assert caplog.text == ""  # said once a process, not at every session (serve's instances)
    for changes, why in (({"cpu_features": ["no such feature"]}, "measured on other CPUs"),  # a VM's "AMD EPYC"
                         ({"huge_pages": "malloc: elsewhere"}, "measured with huge pages malloc: elsewhere, this "
                                                               "process has malloc: "),
                         ({"origin": {"other": "model files"}}, "measured on other model files or library versions"),
                         ({"path": "fastest"}, "it has no entry")):
        (artifact.path / CACHE_DIR / TUNED_FILE).unlink()
        record(artifact, 2, Tuning("experts", "measured", 1.1, [1.1], [1.0], True))
        _edit_entry(artifact, **changes)
        caplog.clear()
        moe_tuning._warned.clear()  # said once a process: this test asks again
        with caplog.at_level(logging.WARNING, logger="moedeploy.runtime.moe_tuning"):
            assert moe_path_of(artifact, 2) == "split", changes
        assert "holds no MoE path tuned for this session" in caplog.text and why in caplog.text, caplog.text
    (artifact.path / CACHE_DIR / TUNED_FILE).write_text("{")
    caplog.clear()
    moe_tuning._warned.clear()
    with caplog.at_level(logging.WARNING, logger="moedeploy.runtime.moe_tuning"):
        assert moe_path_of(artifact, 2) == "split"
    assert f"{TUNED_FILE} is not readable" in caplog.text


def test_sessions_at_the_default_threads_take_a_record_made_at_the_default_threads(own_decoder) -> None:
    """tune without --threads records default_threads(); a session without threads runs with as many."""
    from moedeploy.runtime.generation import OrtDecoder
    from moedeploy.runtime.ort import default_threads

    if default_threads() < 2 or 96 % default_threads():
        pytest.skip("one core, or a core count that does not divide the tiny experts: no split to choose against")
    record(own_decoder, default_threads(), Tuning("experts", "measured", 1.1, [1.1], [1.0], True))
    assert OrtDecoder(own_decoder).lowering["moe_split"] == 0
    (own_decoder.path / CACHE_DIR / TUNED_FILE).unlink()
    assert OrtDecoder(own_decoder).lowering["moe_split"] == 2


def test_a_new_record_replaces_this_machines_entry_and_keeps_the_others(own_decoder) -> None:
    artifact = own_decoder
    path = record(artifact, 2, Tuning("experts", "measured", 1.1, [1.1], [1.0], True))
    _edit_entry(artifact, cpu="another CPU")  # another machine's entry (or one of other library versions): kept
    record(artifact, 2, Tuning("split", "measured", 0.9, [0.9], [1.0], True))
    assert [(e["cpu"] == "another CPU", e["path"]) for e in json.loads(path.read_text())["entries"]] == [
        (True, "experts"), (False, "split")]
    assert moe_path_of(artifact, 2) == "split"
    record(artifact, 2, Tuning("experts", "measured", 1.2, [1.2], [1.0], True))  # this machine's again: replaced
    assert [e["path"] for e in json.loads(path.read_text())["entries"]] == ["experts", "experts"]
    assert moe_path_of(artifact, 2) == "experts"
    assert DERIVED_FILES["cache"].fullmatch(TUNED_FILE)  # a re-export replaces it as moedeploy's own


def test_two_runs_recording_at_once_keep_both_entries(own_decoder, monkeypatch) -> None:
    """Two tunes of one artifact (2 and 3 threads) record at once. Each write is slowed so that
    both would read the record before either wrote it: without the lock the second drops the
    first's entry."""
    import threading
    import time

    from moedeploy.utils import io

    real_write = io.atomic_write_json

    def slow_write(path, obj) -> None:
        time.sleep(0.3)
        real_write(path, obj)

    monkeypatch.setattr(io, "atomic_write_json", slow_write)
    runs = [threading.Thread(target=record, args=(own_decoder, threads, Tuning("experts", "measured", 1.1, [1.1], [1.0], True)))
            for threads in (2, 3)]
    for run in runs:
        run.start()
    for run in runs:
        run.join(30)
    entries = json.loads((own_decoder.path / CACHE_DIR / TUNED_FILE).read_text())["entries"]
    assert sorted(e["threads"] for e in entries) == [2, 3]
    assert [p.name for p in (own_decoder.path / CACHE_DIR).iterdir()] == [TUNED_FILE]  # no lock file left


def tune(*args: str):
    return CliRunner().invoke(app, ["tune", *args])


def test_tune_times_both_paths_records_the_faster_and_sessions_follow_it(own_decoder) -> None:
    artifact = own_decoder
    result = tune(str(artifact.path), "--threads", "2", "--rounds", "3", "--prompt-len", "8", "--new-tokens", "4")
    assert result.exit_code == 0, result.output
    entry, = json.loads((artifact.path / CACHE_DIR / TUNED_FILE).read_text())["entries"]
    assert entry["threads"] == 2 and len(entry["split_ms"]) == len(entry["experts_ms"]) == 3
    assert entry["tokens_identical"] is True  # both paths compute the same function
    # the choice, recomputed here from the recorded times: the median of the paired ratios, 3% either side
    ratios = sorted(s / e for s, e in zip(entry["split_ms"], entry["experts_ms"], strict=True))
    assert entry["ratio"] == pytest.approx(ratios[1], rel=1e-12)
    assert entry["path"] == ("experts" if ratios[1] > 1.03 else "split")
    assert f"sessions of this artifact here take {entry['path']}" in " ".join(result.stdout.split())
    assert moe_path_of(artifact, 2) == entry["path"]
    artifact.verify()  # the artifact itself untouched


@pytest.mark.parametrize("args,setup,message", [
    (["--threads", "1"], None, "sessions at one thread read no tune record"),
    ([], "foreign", "is not a record `moedeploy tune` wrote (format 1), so tune will not overwrite it"),
    ([], "link", "is a link (to "),
    ([], "file", "is not a folder, and moedeploy keeps its caches there"),
])
def test_tune_refuses_in_one_line_and_writes_nothing(own_decoder, args, setup, message) -> None:
    artifact = own_decoder
    cache = artifact.path / CACHE_DIR
    if setup == "foreign":
        cache.mkdir()
        (cache / TUNED_FILE).write_text('{"mine": true}')
    if setup == "link":  # writing through it would write outside the artifact
        (artifact.path.parent / "elsewhere").mkdir()
        cache.symlink_to(artifact.path.parent / "elsewhere")
    if setup == "file":
        cache.write_text("not moedeploy's")
    before = sorted(p.relative_to(artifact.path) for p in artifact.path.rglob("*"))
    result = tune(str(artifact.path), "--rounds", "1", "--new-tokens", "2", "--prompt-len", "2", *args)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert message in " ".join(result.stderr.split()) and lines[-1].startswith("error:"), result.stderr
    assert sorted(p.relative_to(artifact.path) for p in artifact.path.rglob("*")) == before
    if setup == "foreign":
        assert (cache / TUNED_FILE).read_text() == '{"mine": true}'
    assert not any((artifact.path.parent / "elsewhere").glob("*"))


def test_tune_refuses_what_has_no_fp32_moe_path(store) -> None:
    result = tune(str(store.decoder("fp16").path))
    assert result.exit_code == 1 and "holds fp16 weights; the MoE paths tune chooses between are fp32's" in result.stderr
    result = tune(str(store.block("moe").path))
    assert result.exit_code == 1 and "is not a decoder artifact (it holds a block)" in result.stderr


def test_tune_refuses_a_quantized_export_before_any_session(tmp_path: Path) -> None:
    from moedeploy.export.exporter import export_decoder
    from moedeploy.export.quantize import QuantScheme

    artifact = export_decoder(tmp_path / "q8", quantization=QuantScheme(8, 32), golden=False)
    result = tune(str(artifact.path))
    assert result.exit_code == 1 and "is a quantized export: its experts run on com.microsoft::QMoE" in result.stderr
    assert "tuning the MoE path" not in result.stderr  # refused before the sessions are made


def test_bench_is_told_which_path_its_sessions_take_and_why(own_decoder, monkeypatch) -> None:
    from moedeploy.runtime.ort import moe_path_and_source

    # the suite runs with MOEDEPLOY_NATIVE=off (tests/conftest.py)
    assert moe_path_and_source(own_decoder, 2) == ("split", "the default; the native kernel is not used here: MOEDEPLOY_NATIVE=off turns the native kernels off")
    path = record(own_decoder, 2, Tuning("experts", "measured", 1.1, [1.1], [1.0], True))
    assert moe_path_and_source(own_decoder, 2) == ("experts", f"as `moedeploy tune` recorded for this machine in {path}")
    monkeypatch.setenv("MOEDEPLOY_MOE_PATH", "split")
    assert moe_path_and_source(own_decoder, 2) == ("split", "MOEDEPLOY_MOE_PATH is set")


def test_tune_refuses_where_two_sessions_of_the_weights_would_not_fit(own_decoder, tmp_path, monkeypatch) -> None:
    """Both paths' sessions are open at once (the native kernel off): about twice the weights,
    checked against MemAvailable."""
    from moedeploy.runtime.moe_tuning import available_bytes, memory_problem

    weights = own_decoder.stored_weight_bytes()
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {(2 * weights - 4096) // 1024} kB\n")
    assert available_bytes(str(meminfo)) == (2 * weights - 4096) // 1024 * 1024
    assert "tune holds 2 sessions at once" in memory_problem(own_decoder, str(meminfo))
    meminfo.write_text(f"MemAvailable:   {2 * weights // 1024 + 1} kB\n")
    assert memory_problem(own_decoder, str(meminfo)) is None
    meminfo.write_text("MemFree: 1 kB\n")  # no MemAvailable (an old kernel): not refused on a guess
    assert available_bytes(str(meminfo)) is None and memory_problem(own_decoder, str(meminfo)) is None
    monkeypatch.setattr(moe_tuning, "MEMINFO", str(tmp_path / "tight"))
    (tmp_path / "tight").write_text("MemAvailable:   1024 kB\n")
    result = tune(str(own_decoder.path))
    assert result.exit_code == 1 and "this machine has 1.0 MB available" in " ".join(result.stderr.split())
    assert not (own_decoder.path / CACHE_DIR).exists()
