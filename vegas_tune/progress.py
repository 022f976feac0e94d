"""Progress of a tuning run: what the tuner reports, and how the CLI shows it.

The tuner calls a ``ProgressCallback`` with a ``ProgressEvent``; ``ProgressReporter`` is
the one the CLI passes. On a terminal it draws a bar per step. When stderr is not a
terminal (CI logs, ``nohup``), bars would print nothing useful, so it writes plain lines:
one when a step starts, one per finished trial, and between trials at most one every
``PLAIN_INTERVAL_SECONDS`` (a heartbeat, so a long trial does not look like a hang).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)


@dataclass(frozen=True)
class ProgressEvent:
    """One update from the tuner.

    step: ``sweep``, ``extend``, ``race`` (``race @ batch 64`` when several sizes are tuned);
    done / total: finished trials of that step (earlier runs' included on resume);
    best: the step's best so far in words, e.g. ``1.42x [1.38, 1.46] over vanilla, 3
    racing``, or None;
    unit: what done / total count: ``trials``, or ``rounds`` (the race measures its
    configurations in repeated rounds).
    """

    step: str
    done: int
    total: int
    best: str | None = None
    unit: str = "trials"


ProgressCallback = Callable[[ProgressEvent], None]


# Plain lines: between finished trials, at most one line per this many seconds.
PLAIN_INTERVAL_SECONDS = 60
LINE_PREFIX = "vegas-tune: "
SECONDS_PER_MINUTE = 60
SECONDS_PER_HOUR = 3600
MINUTES_PER_HOUR = 60


def format_duration(seconds: float) -> str:
    """``45s``, ``2m10s``, ``1h05m``: short enough for a log line."""
    seconds = max(0, int(round(seconds)))
    if seconds < SECONDS_PER_MINUTE:
        return f"{seconds}s"
    if seconds < SECONDS_PER_HOUR:
        return f"{seconds // SECONDS_PER_MINUTE}m{seconds % SECONDS_PER_MINUTE:02d}s"
    hours, rest = divmod(seconds, SECONDS_PER_HOUR)
    return f"{hours}h{rest // SECONDS_PER_MINUTE:02d}m"


def format_estimate(seconds: float) -> str:
    """An estimate, rounded to what it is worth: ``40s``, ``3m``, ``1h20m``."""
    if seconds < SECONDS_PER_MINUTE:
        return format_duration(seconds)
    minutes = int(round(seconds / SECONDS_PER_MINUTE))
    if minutes < MINUTES_PER_HOUR:
        return f"{minutes}m"
    return f"{minutes // MINUTES_PER_HOUR}h{minutes % MINUTES_PER_HOUR:02d}m"


@dataclass
class _Step:
    """What the reporter knows of one step."""

    started: float  # when this process first heard of the step
    done_at_start: int  # finished before that (earlier runs' trials, on resume)
    event: ProgressEvent
    last_finish: float  # when ``done`` last went up (or the start)

    def seconds_left(self) -> float | None:
        """Time per trial finished in this process x trials left in the step; None
        until this process has finished one."""
        finished_here = self.event.done - self.done_at_start
        if finished_here < 1:
            return None
        per_trial = (self.last_finish - self.started) / finished_here
        return per_trial * max(0, self.event.total - self.event.done)


class ProgressReporter:
    """A ``ProgressCallback`` that shows the run: rich bars per step on a terminal,
    plain lines otherwise (see the module docstring). Use it as a context manager
    around the run, and pass the instance itself as the callback.

    ``plain``: force one mode (None: plain when ``console`` is not a terminal).
    ``stream``: where plain lines go (None: ``sys.stderr`` at the time of writing).
    ``interval``: seconds between plain lines when no trial finishes.
    ``clock``: the time source (tests pass a fake one).
    """

    def __init__(self, console=None, *, plain: bool | None = None,
                 stream: TextIO | None = None, interval: float = PLAIN_INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if plain is None:
            plain = console is None or not console.is_terminal
        self.plain, self.console, self.stream = plain, console, stream
        self.interval, self.clock = interval, clock
        self.started = clock()
        self.steps: dict[str, _Step] = {}
        self.current: str | None = None
        self.last_line = self.started
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._bars = None
        self._tasks: dict[str, int] = {}

    # ---- context ---------------------------------------------------------------------

    def __enter__(self) -> "ProgressReporter":
        if self.plain:
            # Between events the tuner is busy in a trial; only a thread can speak then.
            self._heartbeat = threading.Thread(target=self._beat, name="vegas-tune-progress",
                                               daemon=True)
            self._heartbeat.start()
        else:
            self._bars = _bars(self.console)
            self._bars.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if self._bars is not None:
            self._bars.__exit__(*exc)

    # ---- events ----------------------------------------------------------------------

    def __call__(self, event: ProgressEvent) -> None:
        """Record one event from the tuner and show it."""
        with self._lock:
            now = self.clock()
            step = self.steps.get(event.step)
            new_step = step is None
            finished = False
            if step is None:
                step = self.steps[event.step] = _Step(now, event.done, event, now)
            else:
                finished = event.done > step.event.done
                if finished:
                    step.last_finish = now
                step.event = event
            self.current = event.step
            if self._bars is not None:
                self._update_bar(event)
            elif new_step or finished or now - self.last_line >= self.interval:
                self._write(self.status_line(event.step, now))

    def status_line(self, name: str, now: float | None = None, running: bool = False) -> str:
        """``vegas-tune: step sweep: 3/10 trials, best ..., elapsed 2m10s, about 3m left
        in this step``; ``running``: the heartbeat's form, saying how long the trial in
        progress has taken so far."""
        now = self.clock() if now is None else now
        step = self.steps[name]
        e = step.event
        parts = [f"{LINE_PREFIX}step {e.step}: {e.done}/{e.total} {e.unit}"]
        if e.best:
            parts.append(f"best {e.best}")
        parts.append(f"elapsed {format_duration(now - self.started)}")
        if e.done >= e.total:
            parts.append("step done")
        else:
            if running:
                parts.append(f"current {e.unit.rstrip('s')} running for "
                             f"{format_duration(now - step.last_finish)}")
            left = step.seconds_left()
            if left is not None:
                parts.append(f"about {format_estimate(left)} left in this step")
        return ", ".join(parts)

    def _write(self, line: str) -> None:
        # One write per line: print's separate newline could land after a log line
        # written by the other thread (the heartbeat), joining the two.
        stream = self.stream or sys.stderr
        stream.write(line + "\n")
        stream.flush()
        self.last_line = self.clock()

    def _beat(self) -> None:
        tick = min(self.interval, 1.0)
        while not self._stop.wait(tick):
            self.heartbeat()

    def heartbeat(self) -> None:
        """Write the running line when nothing was written for ``interval`` seconds."""
        with self._lock:
            now = self.clock()
            if self.current is None or now - self.last_line < self.interval:
                return
            event = self.steps[self.current].event
            if event.done < event.total:
                self._write(self.status_line(self.current, now, running=True))

    # ---- terminal --------------------------------------------------------------------

    def _update_bar(self, event: ProgressEvent) -> None:
        fields = dict(best=f"best {event.best}" if event.best else "", unit=event.unit)
        if event.step not in self._tasks:
            self._tasks[event.step] = self._bars.add_task(f"step {event.step}",
                                                          total=event.total, **fields)
        self._bars.update(self._tasks[event.step], completed=event.done, total=event.total,
                          **fields)


def _bars(console):
    # markup=False: "[1.38, 1.46]" in the best text is data, not rich markup.
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[unit]}"), TimeElapsedColumn(),
                    TimeRemainingColumn(), TextColumn("{task.fields[best]}", markup=False),
                    console=console, transient=True)
