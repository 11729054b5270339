"""What was written before the library was split into subpackages still works
(``tests/data/legacy/``, made there at the last commit of the flat layout): its public API (every
name, signature, method and attribute), a whole-model pickle of a converted model, whose classes
it names by their old module paths, and a Lightning checkpoint of a run with ``SyncBNCallback``,
which resumes."""

from __future__ import annotations

import inspect
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _lightning import BNNet, fit_ranks, make_net

import syncbn_lightning
from syncbn_lightning import SyncBatchNorm, SyncBatchNormAct, SyncBNCallback

DATA = Path(__file__).resolve().parent / "data" / "legacy"


def _extends(obj: Any, old: str) -> bool:
    """Whether ``obj``'s signature is ``old``, or ``old`` with keyword-only parameters that have
    defaults appended (every old call still means the same)."""
    signature = inspect.signature(obj)
    params = list(signature.parameters.values())
    while str(signature) != old and params:
        last = params.pop()
        if last.kind is not inspect.Parameter.KEYWORD_ONLY or last.default is last.empty:
            return False
        signature = signature.replace(parameters=params)
    return str(signature) == old


def test_the_public_api_is_a_superset_of_the_old_one_with_the_same_signatures() -> None:
    sys.path.insert(0, str(DATA))
    try:
        from api_dump import public_api
    finally:
        sys.path.remove(str(DATA))
    old, new = json.loads((DATA / "api.json").read_text()), public_api()
    assert set(old) <= set(new)  # every old name still in __all__ (new ones may join)
    for name, entry in old.items():
        now, obj = new[name], getattr(syncbn_lightning, name)
        assert now["kind"] == entry["kind"], name
        # A class whose constructor is torch's has torch's signature, which differs by release
        # (torch 2.4's _BatchNorm has no `bias=`): the dump was made on 2.13.
        init_module = getattr(getattr(obj, "__init__", None), "__module__", None) or ""
        torch_init = isinstance(obj, type) and init_module.startswith("torch.")
        if now["signature"] != entry["signature"] and not torch_init:  # new keyword-only args
            assert _extends(obj, entry["signature"]), (name, now)
        for method, signature in entry.get("methods", {}).items():
            assert now["methods"].get(method) == signature, (name, method)
        assert set(entry.get("attributes", [])) <= set(now.get("attributes", [])), name


def test_a_whole_model_pickled_at_the_old_paths_loads_and_computes_the_same() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = torch.load(DATA / "model.pt", weights_only=False)
    moved = {str(w.message).split(" is now ")[0] for w in caught if "is now" in str(w.message)}
    assert "syncbn_lightning.batchnorm" in moved  # the old path, mapped to the new module
    model = saved["model"]
    bn, act = model[1], model.act
    assert type(bn) is SyncBatchNorm and type(act) is SyncBatchNormAct
    assert (bn.momentum, bn.force_sync, bn.exchange, act.momentum) == (0.2, True, "auto", 0.1)
    for layer in (bn, act):
        layer.sync_options.check_complete()
        assert not {"momentum", "eps", "force_sync", "impl"} & set(vars(layer))
    assert bn.sync_name == "1"
    model.eval()
    # Not bitwise: the convolutions may take another CPU kernel on another machine or thread count.
    torch.testing.assert_close(model(saved["input"]), saved["eval_output"], rtol=1e-6, atol=1e-6)
    model.train()
    torch.testing.assert_close(model(saved["input"]), saved["train_output"], rtol=1e-6, atol=1e-6)


def test_the_old_module_paths_still_import() -> None:
    with pytest.warns(DeprecationWarning, match="syncbn_lightning.callback is now"):
        from syncbn_lightning.callback import SyncBNCallback as Old
    assert Old is SyncBNCallback


def test_a_lightning_checkpoint_loads_into_the_plain_model() -> None:
    checkpoint = torch.load(DATA / "lightning.ckpt", weights_only=False)
    net = make_net()
    state = {k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items()}
    net.load_state_dict(state)  # plain BatchNorm keys
    assert checkpoint["callbacks"]["SyncBNCallback"]["samples_seen"] == 15


@pytest.mark.slow
@pytest.mark.distributed
def test_a_lightning_checkpoint_resumes_with_the_callback(tmp_path: Path) -> None:
    ranks = fit_ranks(
        tmp_path,
        "resumed",
        2,
        [SyncBNCallback(group_size=1, log_every_n_steps=1)],
        model=BNNet(batch_size=[3, 2]),
        max_steps=5,
        ckpt_path=str(DATA / "lightning.ckpt"),
    )
    for got in ranks:
        # 3 steps in the checkpoint (15 samples), 2 more of 3 + 2 samples each.
        assert got["callback_metrics"]["SyncBNCallback"]["bn/samples_seen"] == 25
        assert got["sync_layers"] == 2


def test_a_whole_model_pickled_before_the_redesign_loads_and_runs() -> None:
    """``tests/data/before_redesign/model.pt`` (made before the library was rebuilt around one
    synchronized call): its layers keep their options and their last batch's record, and the
    model computes what it computed then, in eval and in training mode, and trains on."""
    saved = torch.load(DATA.parent / "before_redesign" / "model.pt", weights_only=False)
    model = saved["model"]
    bn, act = model[1], model.act
    assert type(bn) is SyncBatchNorm and type(act) is SyncBatchNormAct
    assert (bn.momentum, bn.exchange, bn.force_sync) == (0.2, "reduce", True)
    record = bn.last_batch
    assert record.local_samples == 5 and record.mean.shape == (4,) and int(record.count) == 180
    model.eval()
    torch.testing.assert_close(model(saved["input"]), saved["eval_output"], rtol=1e-6, atol=1e-6)
    model.train()
    out = model(saved["input"])
    torch.testing.assert_close(out.detach(), saved["train_output"], rtol=1e-6, atol=1e-6)
    out.square().mean().backward()
    assert bn.weight.grad is not None and int(bn.num_batches_tracked) == 3
