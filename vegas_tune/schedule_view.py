"""A profile's schedule over batch size and context, as `vegas-tune show` prints it: one
row per batch range, one column per band of contexts, each cell the K (gamma) chosen
there, or ``vanilla``, with the speedup over vanilla decoding and its interval.

A profile tuned at one context prints its schedule range by range instead (``show``);
this table is for one tuned at several (``workload.contexts``), where the ranges of the
bands can differ: a size that ran out of memory at a long context has no entry there,
and the range below it reaches further in that band.
"""

from __future__ import annotations

from itertools import pairwise

from vegas_core.schedule import range_words
from vegas_tune.profile import VANILLA, Profile, ScheduleEntry

# Between the columns of the table.
COLUMN_GAP = "  "
# Where a figure was not measured (a run cut short).
NOT_MEASURED = "n/a"


def speedup_words(entry: ScheduleEntry) -> str:
    """``2.12x [2.05, 2.19]``: the entry's speedup over vanilla with its interval (of the
    configuration it runs; for a vanilla entry, of the best one measured, which lost)."""
    r = entry.results
    if r.speedup is None:
        return NOT_MEASURED
    if r.speedup_interval is None:
        return f"{r.speedup:.2f}x"
    low, high = r.speedup_interval
    return f"{r.speedup:.2f}x [{low:.2f}, {high:.2f}]"


def cell_words(entry: ScheduleEntry, untuned: bool) -> str:
    """One cell: ``K 6: 2.12x [2.05, 2.19]``, or ``vanilla (K 4: 0.97x [0.93, 1.01])``
    naming the best K measured; `` (at 8)`` after it where the row holds a size that was
    not tuned at this context (``untuned``), which runs the entry measured at 8."""
    if entry.config == VANILLA:
        words = f"vanilla (K {entry.speculative.gamma}: {speedup_words(entry)})"
    else:
        words = f"K {entry.config.gamma}: {speedup_words(entry)}"
    return f"{words} (at {entry.batch_size})" if untuned else words


def batch_rows(profile: Profile) -> list[tuple[int, int | None]]:
    """The table's rows: (first, last) batch size of each range, None for the last
    range's open end; every band's range boundaries, so each cell is one entry."""
    starts = sorted({e.batch_min for e in profile.schedule})
    return [(low, following - 1) for low, following in pairwise(starts)] + [
        (starts[-1], None)]


def context_words(entry: ScheduleEntry, last: bool) -> str:
    """A band's column heading: ``ctx 1-5792 (tuned 4096)``, the last ``ctx 5793 and
    above (tuned 8192)``: longer contexts run it too."""
    return f"ctx {range_words(entry.ctx_min, entry.ctx_max, last)} (tuned {entry.ctx})"


def schedule_table_lines(profile: Profile) -> list[str]:
    """The schedule of a profile tuned at several contexts as text lines: a heading, the
    column titles, one line per batch range (``batch_rows``); columns padded to their
    widest cell."""
    contexts = profile.contexts
    bands = [profile.entries_at(ctx) for ctx in contexts]
    rows = batch_rows(profile)
    header = ["batch"] + [context_words(band[0], index == len(bands) - 1)
                          for index, band in enumerate(bands)]
    not_tuned = [(item.batch_size, item.ctx) for item in profile.not_tuned]
    lines, any_untuned = [header], False
    for low, high in rows:
        label = range_words(low, high if high is not None else low, high is None)
        cells = [label]
        for ctx in contexts:
            untuned = any(size >= low and (high is None or size <= high) and at == ctx
                          for size, at in not_tuned)
            any_untuned |= untuned
            cells.append(cell_words(profile.entry_for(low, ctx), untuned))
        lines.append(cells)
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    confidence = f"{profile.results.confidence:.0%}"
    heading = (f"schedule by batch size and context: K (gamma) and the speedup over vanilla "
               f"[{confidence} interval]; vanilla cells name the best K measured, which did "
               "not beat vanilla")
    text = [heading]
    text += [COLUMN_GAP.join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
             for line in lines]
    if any_untuned:
        text.append("(at N): a size of the row was not tuned at that context (see not "
                    "tuned); it runs the entry measured at batch N")
    return text
