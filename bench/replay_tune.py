"""Replay a finished tune's recorded measurements through the current cost model and race
rule: no GPU, no new measurement.

A tune's storage (an optuna journal) keeps every sweep, extend and focus run
(acceptance by position, step times, steady tokens) and every race round's throughput.
For each batch size this rebuilds the cost model (``steps.Landscape``) from those runs as
the code of today builds it, and prints

- what today's extend rule would try from the recorded sweep, beside what was extended;
- each raced configuration's prediction against what the race measured for it;
- ``steps.race_verdict`` replayed round by round on the recorded race: the round at
  which today's rule decides, the measurements it would have spent, and its pick,
  against what the recorded race spent and picked.

Only what the recorded run measured can be replayed: a configuration the recorded race
did not measure has no rounds. With ``--grid`` (a ``vegas-tune grid`` file of the same
workload and batch size) it also lists the configurations today's rule would race
(``Steps.candidates``) with each one's single grid run, beside the grid's best: how close
the race could get, as far as one run per point can tell; and the cost model against every
grid point it predicts (median and largest errors, the share within 10%).

    python bench/replay_tune.py tests/data/tune-h100-smollm2-8k-b64.journal
    python bench/replay_tune.py a.journal --grid grid.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vegas_tune.options import TuneOptions  # noqa: E402
from vegas_tune.space import Point, longest_prefix, selections  # noqa: E402
from vegas_tune.steps import (EXTEND, FOCUS, RACE, SWEEP, VANILLA, Landscape,  # noqa: E402
                              Search, Steps, race_verdict, spec_of, spec_of_series)
from vegas_tune.studies import open_storage  # noqa: E402
from vegas_tune.tuner import gamma_limit  # noqa: E402


def studies(storage) -> dict[tuple[str, int], object]:
    """(step, batch) -> study, for every study in the storage."""
    import optuna

    found = {}
    for summary in optuna.get_all_study_summaries(storage):
        step, _, batch = summary.study_name.partition(":")[2].partition("@")
        if batch:
            found[(step, int(batch))] = optuna.load_study(study_name=summary.study_name,
                                                          storage=storage)
    return found


def complete(study) -> list:
    from optuna.trial import TrialState

    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


def grid_rows(grid: dict) -> dict[tuple, dict]:
    """A grid file's measured points by (drafter, score, window, budget, gamma)."""
    return {(r["drafter"], r["score"], r["window"], r["budget"], r["gamma"]): r
            for r in grid["grid"]["rows"] if r.get("out_of_memory") is None}


def candidate_lines(landscape: Landscape, options: TuneOptions, grid: dict) -> list[str]:
    """Today's race candidates beside their one run in ``grid`` (a grid file's data)."""
    rows = grid_rows(grid)
    best = max(rows.values(), key=lambda r: r["speedup"])
    lines = ["", f"Today's race candidates (--candidates {options.candidates}) in the grid "
                 f"(batch {grid['workload']['batch_size']}, one run per point):", "",
             "| candidate | predicted tok/s | grid speedup |", "|---|---|---|"]
    found = []
    for point in Steps.candidates(SimpleNamespace(options=options), landscape):
        spec = landscape.search.spec(point)
        row = rows.get((spec.drafter, spec.score, spec.window, point.budget, point.gamma))
        found += [row["speedup"]] if row else []
        measured = f"{row['speedup']:.3f}x" if row else "not in the grid"
        lines.append(f"| {point.words()} | {landscape.predict(point):.1f} | {measured} |")
    lines += ["", f"Grid's best: {best['drafter']} {best['score']} window {best['window']}, "
                  f"{best['budget']} slots, gamma {best['gamma']}: {best['speedup']:.3f}x"
              + (f"; the best candidate's run is {100 * (1 - max(found) / best['speedup']):.1f}% "
                 "below it" if found else "")]
    return lines


# A prediction this close to a point's one grid run counts as right (issue 44's target).
MODEL_TOLERANCE = 0.10


def model_error_lines(landscape: Landscape, grid: dict) -> list[str]:
    """The cost model against every point of ``grid`` it predicts (its pairs, gammas up
    to each curve's top): per drafter and score, how far its predictions lie from the
    points' one run each."""
    rows = grid_rows(grid)
    errors: dict[str, list[float]] = {}
    for point in landscape.points():
        spec = landscape.search.spec(point)
        row = rows.get((spec.drafter, spec.score, spec.window, point.budget, point.gamma))
        if row is not None:
            family = spec.drafter + ("" if spec.drafter == "streaming" else f" {spec.score}")
            errors.setdefault(family, []).append(
                landscape.predict(point) / row["tokens_per_second"] - 1)
    lines = ["", "The cost model (this tune's runs) against the grid's points it predicts:", "",
             "| rules | points | median error | largest under | largest over | within "
             f"{MODEL_TOLERANCE:.0%} |", "|---|---|---|---|---|---|"]
    for family, errs in [*sorted(errors.items()), ("all", sum(errors.values(), []))]:
        if not errs:
            continue
        within = sum(abs(e) <= MODEL_TOLERANCE for e in errs) / len(errs)
        lines.append(f"| {family} | {len(errs)} | {100 * statistics.median(errs):+.1f}% | "
                     f"{100 * min(min(errs), 0):+.1f}% | {100 * max(max(errs), 0):+.1f}% | "
                     f"{within:.0%} |")
    return lines


def extend_lines(batch: int, by_step: dict, search: Search) -> list[str]:
    """What today's extend rule would try from the recorded sweep, beside what the recorded
    tune's extend step measured."""
    def recorded(step: str) -> list:
        return complete(by_step[(step, batch)]) if (step, batch) in by_step else []

    _, today = Steps.extension(Landscape(recorded(SWEEP), batch, search), search)
    measured = [Point.of(spec_of(t)).words() for t in recorded(EXTEND)]
    return [f"Extend, today's rule from the recorded sweep: {'; '.join(today) or 'nothing'}.",
            f"Extend, recorded: {'; '.join(measured) or 'nothing'}.", ""]


def replay_size(batch: int, by_step: dict, fingerprint: dict,
                grid: dict | None = None) -> list[str]:
    ctx, new = fingerprint["ctx"], fingerprint["max_new_tokens"]
    options = TuneOptions(target=fingerprint["target"], budgets=tuple(fingerprint["budgets"]),
                          probe_gamma=fingerprint["probe_gamma"],
                          precision=fingerprint["precision"])
    limit = gamma_limit(new)
    runs = [t for step in (SWEEP, EXTEND, FOCUS) if (step, batch) in by_step
            for t in complete(by_step[(step, batch)])]
    search = Search(batch, recorded_selections(options.target, runs), options.budgets,
                    min(options.probe_gamma, limit), longest_prefix(ctx, new), limit, ctx)
    landscape = Landscape(runs, batch, search)
    race_trials = complete(by_step[(RACE, batch)]) if (RACE, batch) in by_step else []
    lines = [f"## batch {batch}", "", *extend_lines(batch, by_step, search)]
    if grid is not None and grid["workload"]["batch_size"] == batch:
        lines += candidate_lines(landscape, options, grid)[1:]
        lines += model_error_lines(landscape, grid) + [""]
    if not race_trials:
        return lines + ["No finished race to replay."]
    series = race_trials[-1].user_attrs["series"]
    recorded_pick = race_trials[-1].user_attrs["chosen"]
    lines += ["| raced configuration | predicted tok/s | measured tok/s | error | rounds |",
              "|---|---|---|---|---|"]
    names = [n for n in series if n != VANILLA]
    for name in names:
        s = series[name]
        point = Point.of(spec_of_series(s))
        predicted = landscape.predict(point) if point.curve in landscape.curves else None
        error = ("n/a" if predicted is None
                 else f"{100 * (predicted / s['tokens_per_second'] - 1):+.1f}%")
        lines.append(f"| {point.words()} | "
                     f"{'n/a' if predicted is None else f'{predicted:.1f}'} | "
                     f"{s['tokens_per_second']:.1f} | {error} | {s['rounds']} |")
    recorded = {n: series[n]["round_tokens_per_second"] for n in names}
    spent = sum(len(r) for r in recorded.values()) + len(series[VANILLA]["round_tokens_per_second"])
    live, measured, decided = list(names), 0, False
    for done in range(1, max(len(r) for r in recorded.values()) + 1):
        if any(len(recorded[n]) < done for n in live):
            # The recorded race dropped one that today's rule keeps: its rounds end here.
            return lines + ["", "Today's rule would keep measuring a configuration the "
                                f"recorded race dropped after round {done - 1}: not "
                                "replayable further."]
        measured += 1 + len(live)  # vanilla and every configuration still racing
        live, decided = race_verdict({n: recorded[n][:done] for n in live},
                                     options.precision)
        if decided:
            break
    pick = live[0]
    lines += ["", f"Recorded race: {spent} measurements, pick {recorded_pick} "
                  f"({Point.of(spec_of_series(series[recorded_pick])).words()}).",
              f"Today's rule (precision {options.precision:g}): "
              + (f"decided after round {done}" if decided else
                 f"undecided at the recorded last round, {done}")
              + f", {measured} measurements, pick {pick} "
                f"({Point.of(spec_of_series(series[pick])).words()})."]
    return lines


def recorded_selections(target: str, runs: list) -> list:
    """``target``'s selections under the rule its recorded runs measured: a tune recorded
    before the fork's rule existed ran this engine's, whatever its target."""
    measured = [spec_of(t) for t in runs if t.user_attrs.get("claim") != VANILLA]
    if measured and all(spec.rule == "engine" for spec in measured):
        return [dataclasses.replace(s, rule="engine") for s in selections(target)]
    return selections(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("journal", type=Path, help="a tune's optuna journal")
    parser.add_argument("--grid", type=Path, help="a vegas-tune grid file of the same workload")
    args = parser.parse_args()
    for path in [args.journal] + ([args.grid] if args.grid else []):
        if not path.is_file():
            sys.exit(f"error: {path}: no such file")
    grid = json.loads(args.grid.read_text()) if args.grid else None
    by_step = studies(open_storage(str(args.journal)))
    if not by_step:
        sys.exit(f"error: {args.journal}: no tuning study in it")
    fingerprint = next(iter(by_step.values())).user_attrs["fingerprint"]
    lines = [f"# Replay of {args.journal.name}", ""]
    for batch in sorted({b for _, b in by_step}):
        lines += replay_size(batch, by_step, fingerprint, grid) + [""]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
