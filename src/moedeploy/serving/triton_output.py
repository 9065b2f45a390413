"""Triton's console output without the lines that report nothing wrong.

PyTriton prints everything the tritonserver process writes (its log, stdout and stderr
merged) to this process's sys.stdout, in raw chunks from a reader thread. On a machine
without a GPU, and for every model PyTriton loads, Triton prints error- and warning-level
lines that are expected there and harmless; they were the first thing `moedeploy serve`
showed. While a server runs, sys.stdout is wrapped by TritonOutputFilter, which drops
exactly the lines listed here and passes every other line through whole. `--log-file`
(ServeOptions.log_file) keeps Triton's complete log, these lines included.

Hidden on a machine where no CUDA device is visible (moedeploy also turns Triton's GPU
metrics off there, which removes its NVML and DCGM start-up errors at the source):
- W pinned_memory_manager "Unable to allocate pinned system memory, pinned memory pool
  will not be available: CUDA driver version is insufficient for CUDA runtime version":
  no CUDA driver, so no pinned host buffers; CPU models never use them.
- I cuda_memory_manager "CUDA memory pool disabled": the same, at info level.
- E server.cc "CudaDriverHelper has not been initialized.": Triton probes the CUDA
  driver at start-up and finds none.
Hidden always:
- E model_repository_manager "Failed to set config modification time:
  model_config_content_name_ is empty": PyTriton loads each model with its configuration
  inside the load request, so there is no config file whose modification time Triton
  could record; the model loads normally.
With a GPU visible the first three pass through: there they would mean a broken driver.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO

HARMLESS_WITHOUT_GPU = (
    "Unable to allocate pinned system memory, pinned memory pool will not be available",
    '"CUDA memory pool disabled"',
    '"CudaDriverHelper has not been initialized."',
)
HARMLESS_ALWAYS = ('"Failed to set config modification time: model_config_content_name_ is empty"',)


def harmless_lines(gpu_visible: bool) -> tuple[str, ...]:
    """The message texts to hide: those of HARMLESS_ALWAYS, plus HARMLESS_WITHOUT_GPU without a GPU."""
    return HARMLESS_ALWAYS + (() if gpu_visible else HARMLESS_WITHOUT_GPU)


def cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


class TritonOutputFilter:
    """A text stream over another that drops lines containing any of `harmless` and passes the rest.

    Each thread's text is held until its newline, so a dropped line goes whole and a chunk
    of Triton's output never splices into a line this process prints at the same moment.
    Everything but write/flush (isatty, fileno, encoding, ...) is the wrapped stream's, so
    rich still sees the terminal it prints to.
    """

    def __init__(self, stream: TextIO, harmless: tuple[str, ...]) -> None:
        self.stream = stream
        self.harmless = harmless
        self._pending: dict[int, str] = {}
        self._lock = threading.Lock()

    def is_harmless(self, line: str) -> bool:
        return any(text in line for text in self.harmless)

    def _emit(self, lines: list[str]) -> None:
        kept = "".join(line for line in lines if not self.is_harmless(line))
        if kept:
            self.stream.write(kept)

    def write(self, text: str) -> int:
        thread = threading.get_ident()
        with self._lock:
            *complete, rest = (self._pending.pop(thread, "") + text).split("\n")
            if rest:
                self._pending[thread] = rest
        self._emit([line + "\n" for line in complete])
        return len(text)

    def flush(self) -> None:
        """Pass on this thread's unfinished line too (a flush means the writer wants it seen)."""
        with self._lock:
            rest = self._pending.pop(threading.get_ident(), "")
        self._emit([rest] if rest else [])
        self.stream.flush()

    def close_filter(self) -> None:
        """Emit every thread's unfinished text, then pass everything through from now on."""
        with self._lock:
            rests, self._pending = list(self._pending.values()), {}
        self._emit(rests)
        self.harmless = ()
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def install(harmless: tuple[str, ...]) -> TritonOutputFilter:
    """Wrap sys.stdout (where PyTriton prints Triton's output) until `uninstall`."""
    wrapper = TritonOutputFilter(sys.stdout, harmless)
    sys.stdout = wrapper  # type: ignore[assignment]
    return wrapper


def uninstall(wrapper: TritonOutputFilter) -> None:
    """Restore sys.stdout unless someone replaced it meanwhile (then the wrapper only passes text on)."""
    wrapper.close_filter()
    if sys.stdout is wrapper:
        sys.stdout = wrapper.stream
