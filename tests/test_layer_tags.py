"""Two layers of one model never share a call-order tag.

A layer's tag is a 24-bit hash of its qualified name; two names can hash alike (the pair below
does). Two layers with one tag would let ranks that call different ones merge their statistics
unnoticed: the conversion gives the later layer another tag, the same on every rank.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed
from torch import nn

from syncbn_lightning import CallOrderError, convert_sync_batchnorm
from syncbn_lightning._shared import CALL_ORDER_MARK
from syncbn_lightning.distributed.call_order.tags import name_tag

# Two names whose tags collide (found by search; crc32 modulo 2^24).
FIRST, SECOND = "h324079092367", "b547068720973"


def _model() -> nn.ModuleDict:
    return convert_sync_batchnorm(
        nn.ModuleDict({FIRST: nn.BatchNorm1d(4), SECOND: nn.BatchNorm1d(4)})
    )


def test_the_names_collide() -> None:
    assert name_tag(FIRST) == name_tag(SECOND)


def test_layers_of_one_model_get_distinct_tags_the_same_on_every_conversion() -> None:
    model = _model()
    tags = [model[FIRST].layer_tag, model[SECOND].layer_tag]
    assert tags[0] == name_tag(FIRST) and tags[1] != tags[0]
    assert tags[1] == name_tag(SECOND, 1)
    again = _model()
    assert [again[FIRST].layer_tag, again[SECOND].layer_tag] == tags


def _one_layer_each(rank: int, world: int) -> str:
    model = _model()
    try:
        model[FIRST if rank == 0 else SECOND](torch.randn(3, 4))
    except CallOrderError as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
def test_ranks_calling_the_two_layers_raise_call_order_error() -> None:
    for message in run_distributed(_one_layer_each, 2, timeout=60, pg_timeout_s=30):
        assert f"rank 0 ran '{FIRST}'" in message and f"rank 1 ran '{SECOND}'" in message, message


def _one_layer_each_report_silenced(rank: int, world: int) -> tuple[str, str]:
    """As :func:`_one_layer_each` with the Python report of ``syncbn::call_order_failed``
    returning instead of raising: (the error's type, its message)."""
    from syncbn_lightning.functional import native

    native.report = lambda *args, **kwargs: None
    model = _model()
    try:
        model[FIRST if rank == 0 else SECOND](torch.randn(3, 4))
    except Exception as exc:  # the type is what the test reads
        return type(exc).__name__, str(exc)
    return "none", ""


@pytest.mark.distributed
def test_the_kernels_error_stands_when_the_report_returns() -> None:
    """If the report does not raise (it always does), ``call_order_failed`` returns and the C++
    layer's handler rethrows the kernel's own error with ``throw;`` (the object as thrown, its
    type kept: nothing copies it to its ``c10::Error`` base). The call fails with the kernel's
    message."""
    for kind, message in run_distributed(
        _one_layer_each_report_silenced, 2, timeout=60, pg_timeout_s=30
    ):
        assert kind == "RuntimeError", (kind, message)
        assert message.startswith(f"{CALL_ORDER_MARK} SyncBatchNorm layers were called"), message
