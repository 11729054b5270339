"""The C++ path's queue of call-order flags with the CUDA flag store, under the emulation
(``pytest -m cuda_emu``).

``csrc/layer/order_ring.cpp`` (the ring) and ``csrc/cuda/order_flags_cuda.cu`` (pinned slots,
``cudaMemcpyAsync`` on the device's stream, one event per slot asked with ``cudaEventQuery``) run
on the CPU: the emulation's events stay "not ready" while its device is held, as a GPU's do until
it gets there. Layer tags stand for the queued flags; ``poll`` and ``drain`` return the tag of the
flag that read 0, else -1.
"""

from __future__ import annotations

import pytest
import torch
from cuda_emu.build import load_emulator

# Needs the emulation build (minutes on 2 cores): outside the fast check.
pytestmark = [pytest.mark.cuda_emu, pytest.mark.slow]


@pytest.fixture
def ring():
    emu = load_emulator()
    emu.hold_device(False)
    emu.set_capturing(False)
    emu.order_ring_reset(4)
    emu.take_stream_devices()
    yield emu
    emu.hold_device(False)
    emu.set_capturing(False)
    emu.order_ring_reset(4)


def _flag(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A merge's info as the layer's flag source: its order flag at index 2."""
    info = torch.tensor([4.0, 2.0, value, 1.0, 7.0, 0.0], dtype=dtype)
    return info


def test_landed_flags_are_taken_off_in_order(ring) -> None:
    for tag in (1, 2, 3):
        assert ring.order_ring_push(_flag(1), 2, tag)
    assert ring.order_ring_queued() == [1, 2, 3]
    assert ring.order_ring_poll() == -1
    assert ring.order_ring_queued() == []


def test_poll_stops_at_the_first_flag_the_device_has_not_written(ring) -> None:
    """Oldest first: a landed flag behind one not landed waits, and a zero is reported only once
    the device has written it; the ring is then emptied (later flags mean nothing)."""
    ring.order_ring_push(_flag(1), 2, 1)  # landed
    ring.hold_device(True)
    ring.order_ring_push(_flag(0), 2, 2)  # not yet
    ring.order_ring_push(_flag(1), 2, 3)
    assert ring.order_ring_poll() == -1
    assert ring.order_ring_queued() == [2, 3]
    ring.release_device()
    assert ring.order_ring_poll() == 2
    assert ring.order_ring_queued() == []


def test_slots_wrap_around_without_mixing_flags(ring) -> None:
    """A ring of 4 slots over 11 flags: each flag is read from its own slot, so the one zero
    (the 10th, in a reused slot) is reported with its own tag, never a neighbour's."""
    for tag in range(1, 10):
        assert ring.order_ring_push(_flag(1), 2, tag)
        if tag % 3 == 0:
            assert ring.order_ring_poll() == -1
    assert ring.order_ring_queued() == []
    ring.order_ring_push(_flag(0), 2, 10)
    ring.order_ring_push(_flag(1, torch.float64), 2, 11)
    assert ring.order_ring_poll() == 10


def test_a_full_ring_refuses_until_drained(ring) -> None:
    ring.hold_device(True)
    for tag in range(4):
        assert ring.order_ring_push(_flag(1), 2, tag)
    assert not ring.order_ring_push(_flag(1), 2, 4)
    assert ring.order_ring_poll() == -1 and len(ring.order_ring_queued()) == 4
    assert ring.order_ring_drain() == -1  # waits for every copy (the host syncs)
    assert ring.order_ring_queued() == []
    assert ring.order_ring_push(_flag(1), 2, 4)


def test_drain_reports_the_first_zero(ring) -> None:
    ring.hold_device(True)
    for tag, value in ((1, 1), (2, 0), (3, 0)):
        ring.order_ring_push(_flag(value, torch.float64), 2, tag)
    assert ring.order_ring_drain() == 2
    assert ring.order_ring_queued() == []


def test_the_flag_is_copied_when_queued(ring) -> None:
    """The slot holds the value at the time of the copy: a flag tensor reused afterwards (the
    caching allocator's next block) does not change what is read."""
    flags = _flag(1)
    ring.hold_device(True)
    ring.order_ring_push(flags, 2, 5)
    flags.zero_()
    ring.release_device()
    assert ring.order_ring_poll() == -1


def test_each_copy_is_queued_on_its_device_s_stream(ring) -> None:
    """The store asks for the stream of the flag's device (3 here), never the current device's
    (-1): a model on cuda:k with another current device records on k's stream."""
    ring.order_ring_push(_flag(1), 2, 1, device=3)
    asked = ring.take_stream_devices()
    assert asked and set(asked) == {3}


def test_the_store_sees_a_capture(ring) -> None:
    assert not ring.order_ring_capturing()
    ring.set_capturing(True)
    assert ring.order_ring_capturing()


def test_a_capture_asks_no_event_and_the_flags_wait_for_its_end(ring) -> None:
    """While the device captures a graph, neither a poll nor a drain asks or waits for an event
    (the emulation refuses both then, as CUDA does: the capture would end): the flags stay
    queued, and are read once the capture is over."""
    ring.hold_device(True)
    ring.order_ring_push(_flag(0), 2, 1)
    ring.set_capturing(True)
    assert ring.order_ring_poll() == -1
    assert ring.order_ring_drain() == -1
    assert ring.order_ring_queued() == [1]
    ring.set_capturing(False)
    ring.release_device()
    assert ring.order_ring_poll() == 1


def test_a_capture_makes_no_store(ring) -> None:
    """A device's first flag queued during a capture makes no store (its pinned memory is an
    allocation the capture forbids; the emulation refuses it then): the flag is left alone, and
    the store is made at the first flag after the capture."""
    ring.set_capturing(True)
    assert not ring.order_ring_store_for_queueing(11)
    ring.set_capturing(False)
    assert ring.order_ring_store_for_queueing(11)
