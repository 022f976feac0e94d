"""Decode-style forwards on static buffers, replayed from CUDA graphs.

A ``StepGraph`` wraps a body that reads only tensors allocated once (token, position
and selection buffers, the KV cache) and returns its outputs. On a GPU the body is run
twice eagerly (Triton compiles, cuBLAS picks its kernels), then captured once and
replayed at every later call: one launch per step instead of hundreds, and no Python
between kernels. Elsewhere it simply runs eagerly on the same buffers, so CPU tests
exercise the code that the GPU captures.

A body must be idempotent (running it twice on the same inputs leaves the same state:
forwards overwrite the same cache slots) and must not read device values on the host;
lengths stay on the device and the kernels size their work from them.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable

import torch

from vegas_core.attention import AttentionMeta, SparseSelection
from vegas_core.scores import ScoreCollector
from vegas_kernels.select_slots import aligned_slots

# PyTorch's CUDA allocator options, and the one the command-line tools ask for.
ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def prefer_expandable_segments() -> None:
    """Ask PyTorch's CUDA allocator for expandable segments, unless its options are set.

    Why: a model's workspace keeps one set of graphs and static buffers per gamma and
    budget measured, beside a KV cache that may fill most of the GPU. With fixed-size
    segments, Gemma3-270M at 32k context and batch 128 on an 80 GB H100 ran out of memory
    even after the kept graphs were freed. Takes effect only before the process's first
    CUDA allocation: the tools call it before loading anything."""
    os.environ.setdefault(ALLOCATOR_ENV, EXPANDABLE_SEGMENTS)


# VEGAS_CUDA_GRAPHS: "auto" (capture on CUDA), "0" (eager steps with host-sized
# shapes, for debugging and comparison), or "static" (the static-buffer steps, run
# eagerly on any device: how CPU tests exercise what the GPU captures).
GRAPHS_ENV = "VEGAS_CUDA_GRAPHS"
# Eager runs before capture: the first compiles Triton kernels and autotunes cuBLAS;
# the second runs on warm caches so that capture records no one-off work.
WARMUP_RUNS = 2


_captures = 0


def capture_count() -> int:
    """CUDA graphs captured so far in this process: a decode iteration during which it
    grows paid for one-off work (kernel compilation, capture) and is not steady."""
    return _captures


def _setting() -> str:
    return os.environ.get(GRAPHS_ENV, "auto")


def graphs_enabled(device: torch.device) -> bool:
    """CUDA graphs for decode steps: on CUDA devices unless VEGAS_CUDA_GRAPHS=0/static."""
    return device.type == "cuda" and _setting() == "auto"


def static_steps(device: torch.device) -> bool:
    """Whether decode steps run on static buffers (shapes fixed by the cache's
    capacity): when they are captured, or when forced with VEGAS_CUDA_GRAPHS=static."""
    return graphs_enabled(device) or _setting() == "static"


class StepGraph:
    """``body()`` captured once on first call (CUDA) and replayed afterwards.

    Returns whatever ``body`` returned during capture: the same tensors on every call,
    overwritten in place by each replay.
    """

    def __init__(self, body: Callable[[], object], device: torch.device,
                 pool: object | None = None) -> None:
        self.body = body
        self.capture = graphs_enabled(device)
        self.pool = pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: object = None

    def __call__(self) -> object:
        if not self.capture:
            return self.body()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.outputs

    def _capture(self) -> None:
        global _captures
        _captures += 1
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Dead sessions can hold graphs and buffers in reference cycles (tuning makes
        # one session per trial): collect them now, and keep the collector from freeing
        # them in the middle of the capture, where no free or sync may touch the device.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs = self.body()
        finally:
            if collecting:
                gc.enable()
        self.graph = graph


class StaticForward:
    """A forward of fixed [B, T] token and position buffers on a ``StepGraph``: copy
    the inputs in, get float32 logits out (of every row, or of the last row only).

    ``make_meta(positions)`` builds the attention metadata from the static position
    buffer; it must read its own inputs from static tensors too.
    """

    def __init__(self, net, cache, batch: int, rows: int, make_meta, *, all_rows: bool,
                 device: torch.device, pool: object | None) -> None:
        self.tokens = torch.zeros(batch, rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, rows, dtype=torch.long, device=device)

        def body() -> torch.Tensor:
            hidden = net(self.tokens, self.positions, cache, make_meta(self.positions))
            return net.logits(hidden if all_rows else hidden[:, -1])

        self.graph = StepGraph(body, device, pool)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        return self.graph()


class StaticCall:
    """``fn(*inputs)`` on static input buffers shaped like the first call's arguments,
    on a ``StepGraph``: each call copies its arguments in and replays."""

    def __init__(self, fn: Callable[..., object], device: torch.device,
                 pool: object | None) -> None:
        self.fn, self.device, self.pool = fn, device, pool
        self.inputs: list[torch.Tensor] | None = None
        self.graph: StepGraph | None = None

    def __call__(self, *args: torch.Tensor) -> object:
        if self.inputs is None:
            self.inputs = [torch.zeros_like(a) for a in args]
            self.graph = StepGraph(lambda: self.fn(*self.inputs), self.device, self.pool)
        for buffer, arg in zip(self.inputs, args):
            buffer.copy_(arg)
        return self.graph()


def new_pool(device: torch.device) -> object | None:
    """One memory pool for all graphs of a session: their intermediates share memory
    (they never run at the same time); outputs that are kept stay allocated."""
    return torch.cuda.graph_pool_handle() if graphs_enabled(device) else None


# KV capacity is rounded up to this many slots, so that calls with slightly different
# lengths (tuning trials, warm-ups) share one cache and its captured graphs.
CAPACITY_STEP = 256


class Workspace:
    """A KV cache, static buffers and captured graphs kept across ``generate`` calls on
    one model, for one batch size and capacity: capturing costs far more than a step,
    so a short generation must not pay for it again. ``get(key, make)`` returns the
    item stored under ``key``, made on first use (``find`` and ``put`` when making it
    depends on more than the key)."""

    def __init__(self, net, batch: int, capacity: int, device: torch.device) -> None:
        self.cache = net.new_cache(batch, capacity)
        self.device = device
        self.pool = new_pool(device)
        self._items: dict[tuple, object] = {}

    def __len__(self) -> int:
        return len(self._items)

    def forget_items(self) -> None:
        """Forget every kept graph and static buffer, keeping the cache (and the prompts
        it holds): their memory returns once no session uses them. New graphs go to a
        new pool, since the old one is freed only with the last graph captured in it."""
        self._items.clear()
        self.pool = new_pool(self.device)

    def get(self, key: tuple, make: Callable[[], object]) -> object:
        if key not in self._items:
            self._items[key] = make()
        return self._items[key]

    def find(self, key: tuple) -> object | None:
        return self._items.get(key)

    def put(self, key: tuple, item: object) -> None:
        self._items[key] = item


# One workspace per model: a long-context cache is most of a GPU's memory, so a new
# shape replaces the old one rather than joining it.
_workspaces: "weakref.WeakKeyDictionary[object, Workspace]" = weakref.WeakKeyDictionary()


def workspace(net, batch: int, min_len: int, device: torch.device) -> Workspace | None:
    """The model's workspace for ``batch`` sequences of up to ``min_len`` slots, when
    decode steps run on static buffers (else None: callers allocate per call). A kept
    workspace of the same batch and at least that capacity is reused as it is."""
    if not static_steps(device):
        return None
    space = _workspaces.get(net)
    if space is not None and space.cache.batch_size == batch and space.cache.max_len >= min_len:
        return space
    if space is not None:
        del _workspaces[net], space
        gc.collect()  # free the old cache (dead sessions keep it in cycles) before the new
    capacity = -(-min_len // CAPACITY_STEP) * CAPACITY_STEP
    _workspaces[net] = Workspace(net, batch, capacity, device)
    return _workspaces[net]


def forget_kept_graphs(net) -> bool:
    """Forget the graphs and static buffers kept in the model's workspace (its cache
    stays); False when there were none to forget."""
    space = _workspaces.get(net)
    if space is None or not len(space):
        return False
    space.forget_items()
    # A kept StaticForward's body closes over itself: its graph, pool and buffers are
    # freed only by the collector, and the caller retries an allocation that needs them.
    gc.collect()
    return True


def release_workspace(net) -> None:
    """Drop the model's kept cache and graphs (their memory returns to the allocator)."""
    if _workspaces.pop(net, None) is not None:
        # Dead sessions keep the workspace in reference cycles; the next workspace (a
        # cache of most of the GPU) would not fit beside it.
        gc.collect()


class SpeculativeForwards:
    """The draft and verify forwards of one speculative session, and the static buffers
    behind them.

    With a ``space`` (the kernels serve every forward), drafts and verifies run on its
    static buffers, captured in CUDA graphs on a GPU: one graph for dense drafts, one per
    staged selection (a selection is copied into a static index list as long as the
    largest budget the cache allows, ``list_capacity``), one per kind of verify (its rows
    and what its score collector does) and one per deferred score pass. Without one,
    and for longer index lists, the forwards run eagerly, sized by the host's lengths.
    """

    def __init__(self, net, cache, window, space: Workspace | None, list_capacity: int,
                 device: torch.device) -> None:
        self.net, self.cache, self.window, self.space = net, cache, window, space
        self.list_capacity = list_capacity
        self.device = device
        self._staged_from: SparseSelection | None = None

    @property
    def static(self) -> bool:
        return self.space is not None

    def score_buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A float32 home for the kernels' selection scores, kept with the graphs that
        write it; its rows (the last dim) rounded up to a multiple of LOAD_ALIGN slots,
        so that every row starts aligned and the selection kernel's loads vectorise."""
        *lead, slots = shape
        padded = (*lead, aligned_slots(slots))
        make = lambda: torch.empty(padded, dtype=torch.float32, device=self.device)  # noqa: E731
        # Keyed by shape: drafters that collect from different layers (vegas's selecting
        # layers, SpecExtend's last one) each need their own, or the kernels would write
        # past a smaller one.
        return self.space.get(("scores", padded), make) if self.static else make()

    def draft(self, sel, tokens: torch.Tensor, positions: torch.Tensor,
              kv_len: int) -> torch.Tensor:
        """One draft forward of tokens [B, 1] at positions [B, 1] attending to ``sel``
        (None: dense) -> logits [B, V]; ``kv_len`` bounds the slots an eager forward
        reads."""
        if self.static and (sel is None or (isinstance(sel, SparseSelection)
                                            and sel.indices.shape[-1] <= self.list_capacity)):
            return self._static_draft(sel)(tokens, positions)
        meta = (AttentionMeta.full(positions, kv_len, self.window) if sel is None
                else AttentionMeta.draft(positions, kv_len, sel, self.window))
        return self.net.logits(self.net(tokens, positions, self.cache, meta)[:, -1])

    def verify(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
               kind: tuple, make_collector: Callable[[], ScoreCollector | None]
               ) -> tuple[torch.Tensor, ScoreCollector | None]:
        """The verify forward of tokens [B, T] -> (logits [B, T, V], its collector).
        ``kind`` says what ``make_collector()`` would make, as far as a captured graph is
        concerned: a graph and its collector are made once per kind and rows."""
        key = ("verify", tokens.shape[1], *kind)
        if self.static:
            found = self.space.find(key)
            if found is not None:
                forward, collector = found
                return forward(tokens, positions), collector
        collector = make_collector()
        graphable = collector is None or collector.summed_in_pass or collector.deferrable
        if not (self.static and graphable):
            meta = AttentionMeta.verify(positions, kv_len, self.window, collector)
            return self.net.logits(self.net(tokens, positions, self.cache, meta)), collector
        if collector is not None and not collector.summed_in_pass:
            collector.run_deferred_with(StaticCall(collector.reduce_deferred, self.device,
                                                   self.space.pool))
        cap, window = self.cache.max_len, self.window
        forward = StaticForward(self.net, self.cache, self.cache.batch_size, tokens.shape[1],
                                lambda pos: AttentionMeta.verify(pos, cap, window, collector),
                                all_rows=True, device=self.device, pool=self.space.pool)
        self.space.put(key, (forward, collector))
        return forward(tokens, positions), collector

    def forget_staged(self) -> None:
        """Stage the next selection even if it was the last one staged (a static one
        shared with another session may hold that session's since)."""
        self._staged_from = None

    def _static_draft(self, sel: SparseSelection | None) -> StaticForward:
        cap, batch = self.cache.max_len, self.cache.batch_size
        if sel is None:
            return self.space.get(("draft-dense",), lambda: StaticForward(
                self.net, self.cache, batch, 1,
                lambda pos: AttentionMeta.full(pos, cap, self.window),
                all_rows=False, device=self.device, pool=self.space.pool))
        staged = self._stage(sel)
        return self.space.get(("draft", id(staged)), lambda: StaticForward(
            self.net, self.cache, batch, 1,
            lambda pos: AttentionMeta.draft(pos, cap, staged, self.window),
            all_rows=False, device=self.device, pool=self.space.pool))

    def _stage(self, sel: SparseSelection) -> SparseSelection:
        """Copy a selection into the static one a draft graph reads."""
        l, b, g, k = sel.indices.shape
        k_cap = self.list_capacity
        staged = self.space.get(("selection", sel.layers, g, k_cap), lambda: SparseSelection(
            torch.zeros(l, b, g, k_cap, dtype=torch.long, device=self.device),
            torch.zeros(l, b, dtype=torch.long, device=self.device),
            torch.zeros(b, dtype=torch.long, device=self.device), layers=sel.layers))
        if sel is not self._staged_from:  # a drafter may keep its selection
            staged.indices[..., :k].copy_(sel.indices)
            staged.counts.copy_(sel.counts)
            staged.tail_start.copy_(sel.tail_start)
            self._staged_from = sel
        return staged
