"""Progress of a tuning run: plain lines when stderr is not a terminal (CI logs), rich
bars on a terminal, and the callback the tune command hands the tuner."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from vegas_tune import cli
from vegas_tune.progress import (ProgressEvent, ProgressReporter, format_duration,
                                 format_estimate)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def plain_reporter(interval: float = 60.0):
    clock, stream = Clock(), io.StringIO()
    reporter = ProgressReporter(plain=True, stream=stream, interval=interval, clock=clock)
    return reporter, clock, stream


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (45.4, "45s"), (130, "2m10s"),
                                           (3900, "1h05m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds, text", [(40, "40s"), (170, "3m"), (4800, "1h20m")])
def test_format_estimate(seconds, text):
    assert format_estimate(seconds) == text


def test_plain_lines_at_start_and_each_finished_trial_with_a_step_estimate():
    reporter, clock, stream = plain_reporter()
    reporter(ProgressEvent("refine", 0, 8))
    clock.now += 30
    reporter(ProgressEvent("refine", 1, 8, "gamma 3: 1.42x [1.38, 1.46]"))
    clock.now += 90
    reporter(ProgressEvent("refine", 3, 8, "gamma 3: 1.45x [1.40, 1.50]"))
    assert lines(stream) == [
        "vegas-tune: step refine: 0/8 trials, elapsed 0s",
        "vegas-tune: step refine: 1/8 trials, best gamma 3: 1.42x [1.38, 1.46], elapsed 30s, "
        "about 4m left in this step",  # 30 s per trial x 7 left = 210 s
        "vegas-tune: step refine: 3/8 trials, best gamma 3: 1.45x [1.40, 1.50], elapsed "
        "2m00s, about 3m left in this step",  # 120 s / 3 trials x 5 left = 200 s
    ]


def test_plain_events_without_a_finished_trial_are_throttled():
    reporter, clock, stream = plain_reporter(interval=60)
    reporter(ProgressEvent("sparsity", 0, 6))
    for _ in range(5):
        clock.now += 10
        reporter(ProgressEvent("sparsity", 0, 6))  # the tuner reports again, nothing done
    assert len(lines(stream)) == 1
    clock.now += 20  # 70 s since the last line
    reporter(ProgressEvent("sparsity", 0, 6))
    assert len(lines(stream)) == 2


def test_estimate_counts_only_trials_finished_in_this_process():
    reporter, clock, stream = plain_reporter()
    reporter(ProgressEvent("sparsity", 4, 6))  # resumed: 4 finished by an earlier run
    assert "left" not in lines(stream)[-1]  # no trial of this run finished yet
    clock.now += 50
    reporter(ProgressEvent("sparsity", 5, 6))
    assert lines(stream)[-1].endswith("about 50s left in this step")
    clock.now += 50
    reporter(ProgressEvent("sparsity", 6, 6))
    assert lines(stream)[-1].endswith("step done")


def test_heartbeat_while_a_long_trial_runs():
    reporter, clock, stream = plain_reporter(interval=60)
    reporter(ProgressEvent("gamma", 0, 3))
    clock.now += 20
    reporter.heartbeat()
    assert len(lines(stream)) == 1  # too soon
    clock.now += 80
    reporter.heartbeat()
    assert lines(stream)[-1] == ("vegas-tune: step gamma: 0/3 trials, elapsed 1m40s, current "
                                 "trial running for 1m40s")
    reporter(ProgressEvent("gamma", 3, 3))
    clock.now += 600
    before = len(lines(stream))
    reporter.heartbeat()
    assert len(lines(stream)) == before  # a finished step needs no heartbeat


def test_rounds_are_named_as_rounds():
    reporter, _, stream = plain_reporter()
    reporter(ProgressEvent("baselines", 2, 8, "1.20x [1.10, 1.30] over vanilla", unit="rounds"))
    assert lines(stream)[-1].startswith("vegas-tune: step baselines: 2/8 rounds, best 1.20x")


def test_heartbeat_thread_stops_with_the_context():
    reporter, _, _ = plain_reporter(interval=0.01)
    with reporter:
        reporter(ProgressEvent("sparsity", 0, 2))
    assert not reporter._heartbeat.is_alive()


def test_terminal_gets_bars_and_a_pipe_gets_lines():
    terminal = Console(file=io.StringIO(), force_terminal=True)
    pipe = Console(file=io.StringIO(), force_terminal=False)
    assert ProgressReporter(pipe).plain
    reporter = ProgressReporter(terminal)
    assert not reporter.plain
    with reporter:
        reporter(ProgressEvent("sparsity", 1, 6, "sparsity 0.05: 2.10 [2.0, 2.2]"))
        reporter(ProgressEvent("gamma", 2, 3))
        tasks = {t.description: t for t in reporter._bars.tasks}
        assert tasks["step sparsity"].completed == 1 and tasks["step sparsity"].total == 6
        assert tasks["step sparsity"].fields["best"] == "best sparsity 0.05: 2.10 [2.0, 2.2]"
        assert tasks["step gamma"].completed == 2


def test_tune_hands_the_tuner_a_callback_of_progress_events(tmp_path, monkeypatch, capsys):
    def fake_run_tune(settings, progress):
        progress(ProgressEvent("sparsity", 0, 2))
        progress(ProgressEvent("sparsity", 1, 2, "sparsity 0.05: 2.00 tokens per iteration"))
        return {"profile": str(settings.out)}, 0

    monkeypatch.setattr("vegas_tune.pipeline.run_tune", fake_run_tune)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model", "dummy:tiny", "--ctx", "512", "--device", "cpu",
                  "--out", str(tmp_path / "p.yaml"), "--json"])
    out = capsys.readouterr()
    assert exit_info.value.code == 0
    assert json.loads(out.out) == {"profile": str(tmp_path / "p.yaml")}
    # capsys's stderr is not a terminal: plain lines, one per finished trial.
    assert "vegas-tune: step sparsity: 0/2 trials" in out.err
    assert ("vegas-tune: step sparsity: 1/2 trials, best sparsity 0.05: 2.00 tokens per "
            "iteration") in out.err
