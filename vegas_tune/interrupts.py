"""Ctrl-C that stops a tune between storage writes, never inside one.

Python raises KeyboardInterrupt wherever the main thread happens to be. Inside optuna's
bookkeeping (``study.tell`` writing a finished trial, ``enqueue_trial``, a journal append)
that leaves a half-recorded trial, and optuna's own ``_run_trial`` then fails with an
UnboundLocalError instead of the interrupt. While a ``DeferredInterrupts`` is entered, a
Ctrl-C outside its ``interruptible()`` regions is held until the next one starts (the
tuner marks its measurements, where the time goes, as interruptible); a second Ctrl-C
stops at once.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


class DeferredInterrupts:
    """Hold Ctrl-C outside ``interruptible()`` regions while entered.

    Installs its SIGINT handler only in the main thread and only over Python's default
    one; elsewhere (a worker thread, an application with its own handler) it changes
    nothing, and Ctrl-C behaves as it would without it.
    """

    def __init__(self) -> None:
        self.pending = False
        self._open = 0
        self._previous = None

    def __enter__(self) -> "DeferredInterrupts":
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_sigint(self, signum, frame) -> None:
        if self._open or self.pending:
            self.pending = False
            raise KeyboardInterrupt
        self.pending = True

    def check(self) -> None:
        """Raise KeyboardInterrupt if a Ctrl-C is being held."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """A region Ctrl-C may stop at once; a held Ctrl-C stops it as it starts."""
        self.check()
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1
