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


def _twin_worker(rank: int, world: int) -> dict[str, object]:
    import datetime

    from syncbn_lightning.distributed.groups import group_name_of, sync_world_group

    twin = sync_world_group()
    pair = new_sync_group(1)  # a group of its own for each rank
    backend = twin._get_backend(torch.device("cpu"))
    return {
        "default": dist.group.WORLD.group_name,
        "none": group_name_of(None),
        "world": group_name_of(dist.group.WORLD),
        "twin": twin.group_name,
        "same_object": sync_world_group() is twin,
        "ranks": dist.get_process_group_ranks(twin),
        "timeout": backend.options._timeout == datetime.timedelta(seconds=42),
        "pair_timeout": pair._get_backend(torch.device("cpu")).options._timeout
        == datetime.timedelta(seconds=42),
        "pair": group_name_of(pair) == pair.group_name,
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_the_world_synchronizes_through_a_group_of_its_own_with_the_default_timeout() -> None:
    """``None`` and the default group itself map to SyncBN's twin of the world (never the group
    DDP uses); it and new_sync_group's groups take the default group's timeout, not torch's 30
    minutes."""
    for r in run_distributed(_twin_worker, 2, pg_timeout_s=42):
        assert r["none"] == r["world"] == r["twin"] != r["default"]
        assert r["same_object"] and r["ranks"] == [0, 1] and r["pair"]
        assert r["timeout"] and r["pair_timeout"]


def test_the_twins_name_is_a_compile_time_constant_as_torch_marks_one() -> None:
    """The marker set on ``_world_group_name`` (to keep torch._dynamo out of the import) is the
    one ``torch.compiler.assume_constant_result`` sets."""
    from syncbn_lightning.distributed import groups

    def probe() -> None: ...

    marked = torch.compiler.assume_constant_result(probe)
    added = set(vars(marked)) - set(vars(lambda: None))
    assert added == {"_dynamo_marked_constant"}
    assert groups._world_group_name._dynamo_marked_constant is True
