"""A function run in a spawned process, its outcome read back whatever happens to the process.

A peer runtime that crashes (llama.cpp's AMX kernels segfault on some CPUs) takes the process
it runs in with it; run there, it costs a benchmark row, not the benchmark. This module
imports nothing heavy, so a child that only needs it starts in a fraction of a second.
"""

from __future__ import annotations

from collections.abc import Callable


def crash_text(returncode: int) -> str | None:
    """'killed by SIGSEGV (signal 11)' for a process a signal ended (a negative return code), else None."""
    import signal

    if returncode >= 0:
        return None
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "a signal"
    return f"killed by {name} (signal {-returncode})"


def in_child(compute: Callable, args: tuple, timeout: float) -> tuple[str, object]:
    """`compute(*args)` in a spawned process: ("ok", its value), ("error", its exception in one
    line), ("signal", the number of the signal that ended it) or ("timeout", None) after
    `timeout` seconds (the child is killed)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_send_result, args=(send, compute, args), daemon=True)
    child.start()
    send.close()  # the child's end only: EOF here when it dies without a word
    try:
        if not receive.poll(timeout):
            child.kill()
            child.join()
            return "timeout", None
        try:
            return receive.recv()
        except EOFError:
            child.join()
            return ("signal", -child.exitcode) if child.exitcode is not None and child.exitcode < 0 else \
                ("error", f"exited with code {child.exitcode} before answering")
    finally:
        receive.close()
        if child.is_alive():
            child.join(timeout=10)


def _send_result(send, compute: Callable, args: tuple) -> None:
    try:
        result = ("ok", compute(*args))
    except Exception as e:  # reported to the parent in one line
        result = ("error", f"{type(e).__name__}: {e}")
    send.send(result)
    send.close()
