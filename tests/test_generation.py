"""The decode driver: one loop for vanilla and speculative decoding, steady-state stats."""

from __future__ import annotations

import ast
import gc
import os
import pathlib
import weakref

import pytest
import torch

from vegas_core import SpecConfig, generate, graphs
from tests.test_engine import prompt, tiny_model

SPEC = SpecConfig(gamma=3, sparsity=0.1, min_tokens=4)


def test_vanilla_steady_window_is_every_step_of_a_full_batch():
    out = generate(tiny_model(), [prompt(30, 1), prompt(20, 2)], max_new_tokens=9,
                   ignore_eos=True)
    s = out.stats
    assert s.iterations == 8 and s.steady_iterations == 8
    assert s.steady_tokens == 16 == s.decode_tokens
    assert 0 < s.steady_seconds <= s.decode_seconds
    assert s.steady_tokens_per_second == pytest.approx(s.steady_tokens / s.steady_seconds)


def test_speculative_steady_window_stops_when_a_sequence_finishes():
    out = generate(tiny_model(), [prompt(40, 1), prompt(40, 2), prompt(40, 3)],
                   max_new_tokens=15, ignore_eos=True, spec=SPEC)
    s = out.stats
    assert 1 <= s.steady_iterations <= s.iterations
    # Every steady iteration produced 1..gamma+1 tokens for each of the 3 sequences,
    # counted before the token limit cuts them.
    assert 3 * s.steady_iterations <= s.steady_tokens <= 3 * (SPEC.gamma + 1) * s.steady_iterations
    assert set(s.steady_phase_seconds) == {"draft", "verify", "selection"}
    assert sum(s.steady_phase_seconds.values()) <= s.steady_seconds + 1e-6


def test_stop_after_steady_decodes_the_steady_window_and_no_further():
    """The steady window and everything before it are decoded as without the stop, and
    the decode ends with the window: the first iteration in which a sequence finishes."""
    prompts = [prompt(40, 1), prompt(40, 2), prompt(40, 3)]
    full = generate(tiny_model(), prompts, max_new_tokens=15, ignore_eos=True, spec=SPEC)
    cut = generate(tiny_model(), prompts, max_new_tokens=15, ignore_eos=True, spec=SPEC,
                   stop_after_steady=True)
    f, c = full.stats, cut.stats
    assert f.iterations > f.steady_iterations  # the tail exists, and the cut skips it
    assert c.iterations == c.steady_iterations == f.steady_iterations
    assert c.steady_tokens == f.steady_tokens
    assert max(len(t) for t in cut.tokens) == 15 > min(len(t) for t in cut.tokens)
    assert all(t == u[:len(t)] for t, u in zip(cut.tokens, full.tokens))


def test_stop_after_steady_goes_on_until_there_is_a_steady_iteration(monkeypatch):
    """With no steady iteration (here every iteration captures a graph) the decode runs
    to completion, as without the stop: the measurer then reports that rate."""
    from vegas_core.speculative import SpeculativeSession

    step = SpeculativeSession.step

    def capturing(self, active):
        graphs._captures += 1
        return step(self, active)

    monkeypatch.setattr(SpeculativeSession, "step", capturing)
    prompts = [prompt(40, 1), prompt(40, 2), prompt(40, 3)]
    full = generate(tiny_model(), prompts, max_new_tokens=15, ignore_eos=True, spec=SPEC)
    cut = generate(tiny_model(), prompts, max_new_tokens=15, ignore_eos=True, spec=SPEC,
                   stop_after_steady=True)
    assert cut.stats.steady_iterations == 0
    assert cut.tokens == full.tokens and all(len(t) == 15 for t in cut.tokens)


def test_an_iteration_that_captures_a_graph_is_not_steady(monkeypatch):
    """Capture (and kernel compilation inside it) is one-off work: not a steady rate."""
    from vegas_core.speculative import SpeculativeSession

    step = SpeculativeSession.step

    def capturing_first(self, active):
        if self.iteration == 0:
            graphs._captures += 1
        return step(self, active)

    monkeypatch.setattr(SpeculativeSession, "step", capturing_first)
    s = generate(tiny_model(), [prompt(40, 1)], max_new_tokens=30, ignore_eos=True,
                 spec=SPEC).stats
    assert s.steady_iterations == s.iterations - 1


def test_speculative_decoding_does_not_import_the_driver():
    """generation drives speculative sessions; the session knows nothing of the loop."""
    source = pathlib.Path(__file__).parents[1] / "vegas_core" / "speculative.py"
    imported = {node.module for node in ast.walk(ast.parse(source.read_text()))
                if isinstance(node, ast.ImportFrom)}
    assert "vegas_core.generation" not in imported


def test_measurer_reports_the_steady_rate_over_full_batches():
    from vegas_tune.datasets import Prompt
    from vegas_tune.measure import Measurer, Workload

    prompts = [Prompt(f"p{i}", prompt(40, i)) for i in range(3)]
    workload = Workload(prompts, batch_size=2, max_new_tokens=12)
    assert [len(b) for b in workload.batches()] == [2, 2]
    assert workload.batches()[1][1] == prompts[0].ids  # wrapped around
    m = Measurer(tiny_model(), workload).measure(SPEC)
    assert m.tokens_per_second == pytest.approx(m.steady_tokens / m.steady_seconds)
    assert 0 < m.steady_iterations <= m.iterations
    assert m.wall_seconds >= m.decode_seconds + m.prefill_seconds
    assert m.draft_step_seconds > 0 and m.verify_step_seconds > 0


def test_the_garbage_collector_is_paused_only_while_decoding():
    seen = []

    def progress(phase, done, total):
        if phase == "decode":
            seen.append(gc.isenabled())

    assert gc.isenabled()
    generate(tiny_model(), [prompt(20, 1)], max_new_tokens=4, ignore_eos=True, progress=progress)
    assert seen and not any(seen) and gc.isenabled()


def test_forgetting_kept_graphs_keeps_the_cache():
    """After an out-of-memory the tuner forgets the graphs and buffers kept for earlier
    configurations; the workspace's cache (the prompts' K/V) must survive it."""
    class Net:
        def new_cache(self, batch, capacity):
            return ("cache", batch, capacity)

    net = Net()
    space = graphs.Workspace(net, 2, graphs.CAPACITY_STEP, torch.device("cpu"))  # no pool on a CPU
    graphs._workspaces[net] = space
    try:
        assert not graphs.forget_kept_graphs(net)  # nothing kept yet
        space.get(("vanilla",), lambda: "graph")
        space.put(("draft", 4), "graph")
        assert graphs.forget_kept_graphs(net)
        assert len(space) == 0 and space.find(("draft", 4)) is None
        assert space.cache == ("cache", 2, graphs.CAPACITY_STEP)
        assert graphs._workspaces[net] is space
    finally:
        graphs.release_workspace(net)


def test_forgetting_kept_graphs_frees_those_held_in_reference_cycles():
    """A kept static forward closes over itself (its body reads its own buffers), so
    dropping it from the workspace frees nothing until the collector runs; the tuner
    retries an allocation right after forgetting, so forgetting must collect."""
    class Net:
        def new_cache(self, batch, capacity):
            return None

    class Forward:  # a buffer holder in a cycle, as StaticForward and its body are
        def __init__(self):
            self.body = lambda: self

    net, collecting = Net(), gc.isenabled()
    space = graphs.Workspace(net, 2, graphs.CAPACITY_STEP, torch.device("cpu"))
    graphs._workspaces[net] = space
    gc.disable()  # only an explicit collection may free the cycle
    try:
        kept = weakref.ref(space.get(("verify", 4), Forward))
        assert graphs.forget_kept_graphs(net)
        assert kept() is None
    finally:
        if collecting:
            gc.enable()
        graphs.release_workspace(net)


def test_the_tools_ask_for_expandable_segments_unless_the_user_set_allocator_options(
        monkeypatch):
    monkeypatch.delenv(graphs.ALLOCATOR_ENV, raising=False)
    graphs.prefer_expandable_segments()
    assert os.environ[graphs.ALLOCATOR_ENV] == graphs.EXPANDABLE_SEGMENTS
    monkeypatch.setenv(graphs.ALLOCATOR_ENV, "max_split_size_mb:512")
    graphs.prefer_expandable_segments()
    assert os.environ[graphs.ALLOCATOR_ENV] == "max_split_size_mb:512"


def test_drafters_collecting_from_different_layers_get_score_buffers_of_their_own_shape():
    """A workspace keeps the kernels' score buffer across sessions; a drafter that
    collects from more layers than the last one (vegas's selecting layers after
    SpecExtend's last layer) must not be handed the smaller buffer, which the kernels
    would write past."""
    class Net:
        def new_cache(self, batch, capacity):
            return None

    space = graphs.Workspace(Net(), 2, graphs.CAPACITY_STEP, torch.device("cpu"))
    forwards = graphs.SpeculativeForwards(None, None, None, space, 64, torch.device("cpu"))
    last_layer = forwards.score_buffer((1, 2, 1, 300))
    selecting = forwards.score_buffer((3, 2, 1, 300))
    assert last_layer.shape[:3] == (1, 2, 1) and selecting.shape[:3] == (3, 2, 1)
    assert selecting.shape[-1] >= 300
    assert forwards.score_buffer((3, 2, 1, 300)) is selecting  # kept for the next session
