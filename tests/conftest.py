"""Session-wide settings that must be in place before any test module imports a library."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

# Triton decorates its own standard library when it is first imported (torch's dynamo can
# import it during ONNX export), so its interpreter must be on before that happens for the
# kernel tests to run on CPU tensors. A machine with a GPU runs them compiled instead.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # pragma: no cover - torch is a core dependency
        pass


# The tests expect each session's default MoE path (experts cut into pieces with 2+ threads);
# a shell that chose the other one for its own sessions must not change what they check.
os.environ.pop("MOEDEPLOY_MOE_PATH", None)

# The native kernels (plugins/native) become every CPU session's MoE path wherever they build,
# so a machine with ONNX Runtime's headers would run the suite on another path than one
# without. Off for the suite; the tests of the native path turn them on (`native_kernels`), with
# headers from MOEDEPLOY_TEST_ORT_INCLUDE (.ci/run fetches them), MOEDEPLOY_ORT_INCLUDE or the system.
NATIVE_TEST_INCLUDE = os.environ.get("MOEDEPLOY_TEST_ORT_INCLUDE") or os.environ.get("MOEDEPLOY_ORT_INCLUDE")
os.environ.pop("MOEDEPLOY_ORT_INCLUDE", None)
os.environ["MOEDEPLOY_NATIVE"] = "off"


@pytest.fixture(scope="module")
def native_kernels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The native kernels on, built into a fresh cache for the module; skipped where no
    ONNX Runtime headers are to be had, except under CI, whose .ci/run fetches them."""
    from moedeploy.plugins import native

    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MOEDEPLOY_NATIVE", raising=False)
        if NATIVE_TEST_INCLUDE:
            patch.setenv("MOEDEPLOY_ORT_INCLUDE", NATIVE_TEST_INCLUDE)
        patch.setenv("MOEDEPLOY_CACHE", str(tmp_path_factory.mktemp("native-cache")))
        native.forget()
        include, why = native.headers()
        if include is None:
            if os.environ.get("CI"):
                pytest.fail(f"CI must test the native kernels: {why} (.ci/run fetches libonnxruntime-dev)")
            pytest.skip(f"native kernels not testable here: {why}")
        native.library_path()
        yield native
        native.forget()


@pytest.fixture(scope="session", autouse=True)
def traces_shared_by_workers(request: pytest.FixtureRequest,
                             tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each decoder configuration is traced once per test run, not once per xdist worker.

    torch.onnx.export is most of an export's time here (about 530 s of the suite's 1,850 worker
    seconds, 65 distinct configurations), and the process's own memo keeps only the last few
    traces: a worker re-traced configurations it had traced, and the two workers traced the
    families' shared exports each. The first worker to need a configuration traces it and
    stores the graph's bytes and weight recipes under the run's shared temporary folder (a
    file lock keeps the other waiting rather than tracing the same thing); every later export
    of that configuration reads them back, as `trace_decoder` reads its own memo. The key is
    `trace_key`, everything a trace depends on; the code is the same in every worker.
    Tests that count torch.onnx.export calls take the unshared `_trace` from `__wrapped__`."""
    import hashlib
    import pickle

    import onnx
    import onnx_ir as ir
    from filelock import FileLock

    from moedeploy.export import streaming

    root = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):  # an xdist worker, whose basetemp is the run's folder's child
        root = root.parent
    folder = root / "shared-traces"
    folder.mkdir(exist_ok=True)
    unshared = streaming._trace

    def shared_trace(config, dtype, weight_names):
        key = hashlib.sha256(streaming.trace_key(config, dtype, weight_names).encode()).hexdigest()
        stored = folder / f"{key}.pickle"
        with FileLock(str(stored) + ".lock"):
            if not stored.is_file():
                traced = unshared(config, dtype, weight_names)
                partial = stored.with_suffix(".partial")
                partial.write_bytes(pickle.dumps((ir.to_proto(traced.model).SerializeToString(), traced.recipes)))
                partial.replace(stored)
            # the tracing worker too reads the stored bytes back: every export of a configuration
            # starts from the same serialized graph, whichever worker traced it
            graph_bytes, recipes = pickle.loads(stored.read_bytes())
        return streaming.TracedDecoder(ir.from_proto(onnx.ModelProto.FromString(graph_bytes)), recipes)

    shared_trace.__wrapped__ = unshared
    patch = pytest.MonkeyPatch()
    patch.setattr(streaming, "_trace", shared_trace)
    yield
    patch.undo()


#: A worker allocates like an exporter all the time (torch.export, transformers models, graphs):
#: Python's default of a young-generation pass every 700 objects spent about 14% of a families
#: module's time in the collector (tests/families/test_onnx.py's mixtral and olmoe cases: 5.1 s of
#: 37.3, then 1.9 of 35.9). The exporter raises it the same way while it traces (fewer_collections).
gc.set_threshold(10_000, 10, 10)


@pytest.fixture(scope="module", autouse=True)
def heap_frozen_between_modules() -> None:
    """Each test module starts with the heap the earlier ones left frozen out of the collector.

    A test worker holds torch, transformers, onnxscript and the session's shared exports: some
    million objects, which every full collection walks (about 0.5 s each). Full collections come
    often here: Python's own, and PyTriton's TensorStore.close and pytest's unraisable-exception
    hook call gc.collect() themselves (tests/serving with test_divergence, two workers: 17.3 s
    in the collector before, 8.0 after). Collecting what the last module left and freezing the
    rest (gc.freeze) keeps later collections to what the current module makes; the frozen
    objects are the session's, which live until the worker exits anyway."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Hand the frozen objects back to the collector before the interpreter exits, so that
    extension modules' leak checks at exit (Triton's nanobind) see them freed as before."""
    gc.unfreeze()
    gc.collect()
