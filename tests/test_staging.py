"""The pinned staging ring of the expert offsets' host-to-device copy (ops/staging.py)."""

from array import array

import pytest
import torch

from megatron_overlap.ops.staging import PinnedStaging


class FakeEvent:
    """A CUDA event stand-in: `done` says whether the work recorded behind it has run."""

    def __init__(self):
        self.done, self.records, self.waits = True, 0, 0

    def query(self):
        return self.done

    def synchronize(self):
        self.waits += 1
        self.done = True

    def record(self):
        self.records += 1


def staging(slots=2, capacity=4):
    return PinnedStaging(torch.device("cpu"), slots=slots, capacity=capacity,
                         event_factory=FakeEvent)


def test_upload_returns_the_values_and_later_uploads_leave_earlier_results_alone():
    ring = staging()
    got = [ring.upload(array("i", [i, -i, 7 * i])) for i in range(5)]
    for i, t in enumerate(got):
        assert t.dtype == torch.int32 and t.tolist() == [i, -i, 7 * i]


def test_a_slot_is_rewritten_only_after_its_last_copy_ran():
    ring = staging(slots=2)
    ring.upload(array("i", [1]))
    ring.upload(array("i", [2]))
    first, second = ring._events
    first.done = False  # slot 0's copy still queued on the stream
    ring.upload(array("i", [3]))  # wraps to slot 0
    assert first.waits == 1 and second.waits == 0
    assert first.records == 2 and second.records == 1


def test_an_unused_slot_never_waits():
    ring = staging(slots=3)
    for e in ring._events:
        e.done = False
    ring.upload(array("i", [5]))
    assert all(e.waits == 0 for e in ring._events)


def test_slots_grow_for_larger_arrays():
    ring = staging(slots=1, capacity=4)
    values = list(range(100))
    assert ring.upload(array("i", values)).tolist() == values
    assert ring.upload(array("i", [])).tolist() == []


def test_rejects_what_is_not_int32():
    with pytest.raises(ValueError, match="int32"):
        staging().upload(array("d", [1.0]))
    with pytest.raises(ValueError, match="slots"):
        PinnedStaging(torch.device("cpu"), slots=0, event_factory=FakeEvent)
