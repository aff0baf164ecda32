"""The autograd actors' messages survive pickling; malformed ones are refused by name."""

from __future__ import annotations

import pytest
import torch

from actorgrad import ProtocolError
from actorgrad.autograd._messages import (
    BackwardReport,
    PropagateGrads,
    pack_ids,
    travelling,
    unpack_ids,
)
from actorgrad.wire import Payload


def _through_the_wire(payload: Payload) -> Payload:
    """What the receiver sees: the body, and the buffers as received uint8 tensors."""
    received = Payload(bytes(payload.body))
    received.raw = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in payload.buffers]
    return received


def test_ids_round_trip() -> None:
    ids = {(3 << 48) | 7, (1 << 48) | 1, 5, (2**15 << 48) | (2**48 - 1)}
    assert unpack_ids(pack_ids(ids)) == ids
    assert unpack_ids(pack_ids(())) == frozenset()


@pytest.mark.parametrize("bad", [b"1234567", "not bytes", 12])
def test_malformed_ids_are_refused(bad: object) -> None:
    with pytest.raises(ProtocolError, match="autograd message ids"):
        unpack_ids(bad)  # type: ignore[arg-type]


def test_propagate_grads_round_trip_with_a_broadcast_gradient() -> None:
    dense, ones = torch.rand(4, 5), torch.ones(()).expand(64, 64)
    sent = PropagateGrads(
        context_id=(1 << 48) | 2, backward_id=(1 << 48) | 3, message_id=(0 << 48) | 9,
        grads=(travelling(dense), None, travelling(ones)), mode="fast", retain_graph=True,
        reply=(0, 17, 1), pairs=pack_ids({1, 2, 3}), fired=pack_ids({2}),
    )
    got = PropagateGrads.load(_through_the_wire(sent.dump()))
    assert torch.equal(got.grads[0], dense) and got.grads[1] is None
    assert torch.equal(got.grads[2], torch.ones(64, 64)) and got.grads[2].stride() == (0, 0)
    assert (got.context_id, got.backward_id, got.message_id, got.reply) == (
        sent.context_id, sent.backward_id, sent.message_id, sent.reply)
    assert unpack_ids(got.pairs) == {1, 2, 3} and unpack_ids(got.fired) == {2}


def test_partly_broadcast_gradients_of_views_keep_their_values() -> None:
    row = torch.rand(3, 5)[1:2].expand(4, 5)  # storage offset 5, strides (0, 1)
    column = torch.rand(4, 2)[:, 1:].expand(4, 6)  # storage offset 1, strides (2, 0)
    sent = PropagateGrads(context_id=1, backward_id=1, message_id=1, mode="fast", retain_graph=False,
                          grads=(travelling(row), travelling(column)))
    got = PropagateGrads.load(_through_the_wire(sent.dump()))
    assert torch.equal(got.grads[0], row) and torch.equal(got.grads[1], column)
    assert got.grads[0].stride()[0] == 0 and got.grads[1].stride()[1] == 0


def test_backward_report_round_trip_and_refusal() -> None:
    report = BackwardReport(pairs=frozenset({1, 2, 3}), fired=frozenset({3}))
    assert BackwardReport.load(_through_the_wire(report.dump())) == report
    with pytest.raises(ProtocolError, match="BackwardReport"):
        BackwardReport.load(_through_the_wire(Payload.dump((b"", b"", b""))))
