"""``stepskip.tq.TQClient`` names the real ``transfer_queue`` (0.1.11) functions the role calls, as they are signed.

Only the module's signatures are read (``inspect``): no queue is started.
"""

from __future__ import annotations

import inspect

import pytest

from stepskip.tq import TQClient

tq = pytest.importorskip("transfer_queue")


def test_the_transfer_queue_module_is_a_tq_client():
    assert isinstance(tq, TQClient)


@pytest.mark.parametrize("name", ["kv_batch_put", "kv_batch_get"])
def test_every_protocol_argument_exists_in_transfer_queue_with_its_default(name):
    real = inspect.signature(getattr(tq, name)).parameters
    wanted = [p for p in inspect.signature(getattr(TQClient, name)).parameters.values() if p.name != "self"]
    assert [p.name for p in wanted] == list(real)[:len(wanted)], "the protocol's arguments, in transfer_queue's order"
    for param in wanted:
        assert real[param.name].default == param.default, f"transfer_queue.{name}({param.name}=...) default differs"
    # anything transfer_queue adds after them must be optional, or the role's calls would break
    assert all(p.default is not inspect.Parameter.empty for p in list(real.values())[len(wanted):])
