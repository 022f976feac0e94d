"""DeferredInterrupts: Ctrl-C held outside interruptible regions, at once inside them."""

import signal

import pytest

from vegas_tune.interrupts import DeferredInterrupts


@pytest.fixture(autouse=True)
def default_sigint():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_outside_a_region_is_held_until_the_next_region_starts():
    with DeferredInterrupts() as gate:
        signal.raise_signal(signal.SIGINT)
        assert gate.pending
        with pytest.raises(KeyboardInterrupt):
            with gate.interruptible():
                pytest.fail("a held Ctrl-C must stop the region before it runs")
        assert not gate.pending
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_inside_a_region_and_a_second_ctrl_c_stop_at_once():
    with DeferredInterrupts() as gate:
        with pytest.raises(KeyboardInterrupt):
            with gate.interruptible():
                signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_another_handler_is_left_alone():
    seen = []
    signal.signal(signal.SIGINT, lambda *_: seen.append(1))
    with DeferredInterrupts() as gate:
        signal.raise_signal(signal.SIGINT)
        assert seen == [1] and not gate.pending
