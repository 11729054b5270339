"""Process-group helpers: validation and the consecutive split, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from syncbn_lightning import new_sync_group
from syncbn_lightning.distributed.groups import sync_group_size


def test_requires_an_initialized_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        new_sync_group(2)
    assert sync_group_size(None) == 1


@pytest.mark.parametrize("bad", [True, 2.0, "2"])
def test_rejects_non_integer_group_size(bad: object) -> None:
    with pytest.raises(TypeError, match="group_size must be an int or None"):
        new_sync_group(bad)  # type: ignore[arg-type]


def _split_worker(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for bad in (3, 0, -2, 8):
        try:
            new_sync_group(bad)
        except ValueError as exc:
            out[f"error{bad}"] = str(exc)
    out["world_is_none"] = new_sync_group(None) is None and new_sync_group(world) is None
    group = new_sync_group(2)
    out["size"] = sync_group_size(group)
    out["members"] = dist.get_process_group_ranks(group)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=group)
    out["sum"] = total.item()
    singles = new_sync_group(1)
    out["single_size"] = sync_group_size(singles)
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_splits_the_world_into_consecutive_blocks() -> None:
    results = run_distributed(_split_worker, 4)
    for rank, r in enumerate(results):
        assert r["world_is_none"] is True
        assert r["size"] == 2 and r["single_size"] == 1
        first = rank // 2 * 2
        assert r["members"] == [first, first + 1]
        assert r["sum"] == 2 * first + 1
        for bad in (3, 0, -2, 8):
            assert f"group_size={bad} must be >= 1 and divide the world size 4" in r[f"error{bad}"]
            assert "valid values: [1, 2, 4]" in r[f"error{bad}"]
