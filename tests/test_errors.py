"""The bad-input table (``docs/errors.md``): one test per row, and a test that keeps them in sync.

Every test triggers the real error with the input its row shows and asserts the exception type
(exactly, not a subclass) and the message through :func:`expect`. The message text is the one the
doc quotes: ``…`` stands for omitted text (a trailing ``…``: the message's stable beginning) and
``<name>`` for a value the test supplies (a temporary path, the machine's GPU count).
:func:`test_doc_table_matches_these_tests` parses the doc and checks that each row names a test of
this file, that each test has a row, and that the row quotes the very type and text its test
asserts.

Everything runs in this process, with no training: configs are composed with Hydra and passed to
``train.validate``; callback errors come from ``SyncBNCallback.setup(trainer, module, "fit")`` on a
real (not yet launched) Trainer, which is what ``Trainer.fit`` runs on every rank before training;
group-size errors that need a world of 4 use torch's in-process ``fake`` backend, and the checks
they exercise run before any collective.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import json
import re
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from _service import RENDEZVOUS_VARS
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig
from torch import nn

import syncbn_lightning.app.train as app
from syncbn_lightning import (
    CallOrderError,
    SyncBatchNorm,
    SyncBNCallback,
    SyncBNLayerSync,
    _backend,
    convert_sync_batchnorm,
    new_sync_group,
    revert_sync_batchnorm,
)
from syncbn_lightning import ops as syncbn_ops
from syncbn_lightning._backend import ExtensionBuildError
from syncbn_lightning.app.tasks.coco import CocoDetection
from syncbn_lightning.callback import resolve_group_size

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
DOC = ROOT / "docs" / "errors.md"
# Tests that check the doc itself rather than one of its rows (named in the doc's introduction).
SYNC_TESTS = {"test_doc_table_matches_these_tests"}


@contextlib.contextmanager
def expect(error: type[BaseException], text: str, **values: object) -> Iterator[None]:
    """Assert that the block raises exactly ``error`` with the message ``text``.

    ``…`` in ``text`` matches any text (also across lines); ``<name>`` is replaced by
    ``str(values[name])``. The whole message must match, so a text without a trailing ``…`` is
    the exact message.
    """
    for name, value in values.items():
        text = text.replace(f"<{name}>", str(value))
    pattern = r"\A" + ".*?".join(re.escape(part) for part in text.split("…")) + r"\Z"
    with pytest.raises(error) as info:
        yield
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert re.search(pattern, str(info.value), re.DOTALL), str(info.value)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No rendezvous or cluster variables (they change what train.validate checks), default
    kernels, W&B quiet."""
    for var in (
        *RENDEZVOUS_VARS,
        "GROUP_RANK",
        "LOCAL_WORLD_SIZE",
        "SLURM_NTASKS",
        "SLURM_JOB_NAME",
        "LSB_JOBID",
        "SYNCBN_IMPL",
        "WANDB_MODE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture(scope="module")
def ext():
    """The compiled kernels (built on first use, then loaded from the cache)."""
    return _backend.load_extension()


@pytest.fixture
def world_of_4() -> Iterator[None]:
    """This process as rank 0 of a 4-rank default group (torch's in-process ``fake`` backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fresh_extension(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``SYNCBN_IMPL=ext`` with an empty cache and no extension loaded or failed in this process
    (both restored afterwards)."""
    monkeypatch.setattr(_backend, "_ext_module", None)
    monkeypatch.setattr(_backend, "_ext_error", None)
    monkeypatch.setattr(syncbn_ops, "_choices", {})  # the layers' remembered choice of kernels
    monkeypatch.setenv("SYNCBN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SYNCBN_IMPL", "ext")


class _BNModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _setup(callback: SyncBNCallback, **trainer_kwargs: object) -> None:
    """Run the callback's ``setup("fit")`` hook on a 2-process CPU Trainer, as fit does per rank."""
    options: dict[str, object] = {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": "ddp_spawn",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    options.update(trainer_kwargs)
    trainer = pl.Trainer(callbacks=[callback], **options)
    callback.setup(trainer, _BNModule(), "fit")


def _compose(tmp_path: Path, *overrides: str) -> DictConfig:
    paths = [f"paths.output_dir={tmp_path / 'out'}", f"paths.data_dir={tmp_path / 'data'}"]
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=[*paths, *overrides])


def _validate(tmp_path: Path, *overrides: str) -> None:
    """``python train.py OVERRIDES`` up to its config check (nothing is started or written)."""
    app.validate(_compose(tmp_path, *overrides))


# ----------------------------------------------------------------------------- 1. kernels


def test_impl_unknown_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", "fast")
    with expect(
        ValueError, "SYNCBN_IMPL='fast' is not valid: use one of auto, ext, ref (reference)"
    ):
        SyncBatchNorm(4, force_sync=True)(torch.randn(2, 4))


def test_impl_argument_unknown() -> None:
    with expect(
        ValueError,
        "impl='cuda' is not valid: use 'auto' (the C++ kernels, else the pure-PyTorch reference "
        "with one warning), 'ext' (the kernels or an error), 'reference', or None (the "
        "SYNCBN_IMPL environment variable, default 'auto')",
    ):
        SyncBatchNorm(4, impl="cuda")


def test_impl_argument_not_a_string() -> None:
    with expect(
        TypeError,
        "impl must be 'auto' (the C++ kernels, else the pure-PyTorch reference with one "
        "warning), 'ext' (the kernels or an error), 'reference', or None (the SYNCBN_IMPL "
        "environment variable, default 'auto'), got int 1",
    ):
        convert_sync_batchnorm(nn.BatchNorm2d(4), impl=1)


def test_impl_ext_without_kernels_for_the_device(monkeypatch: pytest.MonkeyPatch, ext) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", "ext")
    bn = SyncBatchNorm(4, force_sync=True, device="meta")
    with expect(
        ExtensionBuildError,
        "syncbn_lightning: the C++ extension has no kernels for meta tensors in this build; using "
        "the pure-PyTorch reference for them is not allowed with SYNCBN_IMPL=ext",
    ):
        bn(torch.randn(2, 4, device="meta"))


def test_impl_ext_build_fails(monkeypatch: pytest.MonkeyPatch, fresh_extension: None) -> None:
    monkeypatch.setenv("CXX", "/bin/false")
    with expect(
        ExtensionBuildError,
        "building the C++ extension failed (CalledProcessError) in <build>: …If a previous "
        "build was killed, a leftover `lock` file in that directory makes torch wait forever; "
        "syncbn_lightning removes it when it holds the build lock, or delete the directory by "
        "hand.",
        build=_backend.build_dir(),
    ):
        SyncBatchNorm(4, force_sync=True)(torch.randn(2, 4))


def test_impl_ext_build_lock_held(monkeypatch: pytest.MonkeyPatch, fresh_extension: None) -> None:
    monkeypatch.setenv("SYNCBN_BUILD_TIMEOUT", "1")
    build = _backend.build_dir()
    with open(build / ".syncbn_build.flock", "w") as held:  # another build holds the lock
        fcntl.flock(held, fcntl.LOCK_EX)
        with expect(
            ExtensionBuildError,
            "waited 1 s for another process building the extension in <build>; if no build is "
            "running, that process is hung: kill it, or raise SYNCBN_BUILD_TIMEOUT",
            build=build,
        ):
            SyncBatchNorm(4, force_sync=True)(torch.randn(2, 4))


def test_kernel_input_one_dim(ext) -> None:
    with expect(
        RuntimeError,
        "syncbn: `input` must have shape (N, C, *) with at least 2 dims, got 1-D input of shape "
        "[5]",
    ):
        ext.local_stats(torch.randn(5))


def test_kernel_input_integer(ext) -> None:
    with expect(
        RuntimeError, "syncbn: `input` must be float16, bfloat16, float32 or float64, got Int"
    ):
        ext.local_stats(torch.ones(2, 3, dtype=torch.int32))


def test_kernel_input_no_channels(ext) -> None:
    with expect(RuntimeError, "syncbn: `input` must have at least one channel (dim 1)"):
        ext.local_stats(torch.ones(2, 0))


def test_kernel_input_wrong_device(ext) -> None:
    with expect(
        RuntimeError, "syncbn: `input` must be a CPU tensor for these kernels, got one on meta"
    ):
        ext.local_stats(torch.ones(2, 3, device="meta"))


def test_kernel_stats_wrong_shape(ext) -> None:
    with expect(
        RuntimeError,
        "syncbn: `mean` must have shape [3] (one value per channel of `input`), got [4]",
    ):
        ext.normalize(torch.randn(2, 3), torch.zeros(4), torch.ones(3), None, None)


def test_kernel_stats_wrong_dtype(ext) -> None:
    mean = torch.zeros(3, dtype=torch.float64)
    with expect(RuntimeError, "syncbn: `mean` must be Float for Float input, got Double"):
        ext.normalize(torch.randn(2, 3), mean, torch.ones(3), None, None)


def test_kernel_stats_wrong_device(ext) -> None:
    mean = torch.zeros(3, device="meta")
    with expect(RuntimeError, "syncbn: `mean` is on meta but `input` is on cpu"):
        ext.normalize(torch.randn(2, 3), mean, torch.ones(3), None, None)


def test_kernel_weight_wrong_shape(ext) -> None:
    with expect(
        RuntimeError,
        "syncbn: `weight` must have shape [3] (one value per channel of `input`), got [2]",
    ):
        ext.normalize(torch.randn(2, 3), torch.zeros(3), torch.ones(3), torch.ones(2), None)


def test_kernel_merge_means_wrong_shape(ext) -> None:
    with expect(
        RuntimeError, "syncbn: `means` must have shape [2, C] to match `counts`, got [3, 4]"
    ):
        ext.merge_stats(torch.ones(2), torch.zeros(3, 4), torch.zeros(3, 4), 1e-5, True)


def test_kernel_merge_half_stats(ext) -> None:
    half = torch.zeros(2, 4, dtype=torch.float16)
    with expect(RuntimeError, "syncbn: `means` must be float32 or float64, got Half"):
        ext.merge_stats(torch.ones(2), half, half, 1e-5, True)


def test_kernel_merge_mixed_dtypes(ext) -> None:
    counts = torch.ones(2, dtype=torch.float64)
    with expect(RuntimeError, "syncbn: `counts`, `means` and `m2s` must share one dtype"):
        ext.merge_stats(counts, torch.zeros(2, 4), torch.zeros(2, 4), 1e-5, True)


def test_kernel_merge_eps_not_positive(ext) -> None:
    with expect(RuntimeError, "syncbn: `eps` must be > 0, got 0"):
        ext.merge_stats(torch.ones(1), torch.zeros(1, 4), torch.zeros(1, 4), 0.0, True)


def test_kernel_grad_out_wrong_shape(ext) -> None:
    x, mean, invstd = torch.randn(2, 3), torch.zeros(3), torch.ones(3)
    with expect(RuntimeError, "syncbn: `grad_out` has shape [2, 4] but `input` has shape [2, 3]"):
        ext.backward_reduce(torch.randn(2, 4), x, mean, invstd, None, False, False)


def test_kernel_grad_out_wrong_dtype(ext) -> None:
    x, mean, invstd = torch.randn(2, 3), torch.zeros(3), torch.ones(3)
    dy = torch.randn(2, 3, dtype=torch.float64)
    with expect(RuntimeError, "syncbn: `grad_out` dtype Double differs from `input` dtype Float"):
        ext.backward_reduce(dy, x, mean, invstd, None, False, False)


def test_kernel_count_not_one_element(ext) -> None:
    x, mean, invstd = torch.randn(2, 3), torch.zeros(3), torch.ones(3)
    with expect(
        RuntimeError,
        "syncbn: `count` must be a one-element tensor on the input's device, got shape [2] on cpu",
    ):
        ext.backward_elemt(x, x, mean, invstd, None, mean, mean, torch.ones(2))


# ----------------------------------------------------------------------------- 2. constructor


def test_bn_num_features_zero() -> None:
    with expect(ValueError, "num_features must be > 0 (the number of channels), got 0"):
        SyncBatchNorm(0)


def test_bn_num_features_not_int() -> None:
    with expect(TypeError, "num_features must be an int (the number of channels), got float 2.5"):
        SyncBatchNorm(2.5)  # type: ignore[arg-type]


def test_bn_eps_zero() -> None:
    with expect(ValueError, "eps must be a finite float > 0 (e.g. 1e-5), got 0.0"):
        SyncBatchNorm(4, eps=0.0)


def test_bn_eps_nan() -> None:
    with expect(ValueError, "eps must be a finite float > 0 (e.g. 1e-5), got nan"):
        SyncBatchNorm(4, eps=float("nan"))


def test_bn_eps_string() -> None:
    with expect(TypeError, "eps must be a float > 0, got str '1e-5'"):
        SyncBatchNorm(4, eps="1e-5")  # type: ignore[arg-type]


def test_bn_momentum_above_one() -> None:
    with expect(
        ValueError,
        "momentum must be in [0, 1] or None (cumulative average), got 1.5; torch convention: the "
        "weight of the new batch (TF/Keras momentum m is 1 - m here)",
    ):
        SyncBatchNorm(4, momentum=1.5)


def test_bn_momentum_string() -> None:
    with expect(
        TypeError,
        "momentum must be a float in [0, 1] or None (cumulative average), got str '0.1'",
    ):
        SyncBatchNorm(4, momentum="0.1")  # type: ignore[arg-type]


def test_bn_process_group_wrong_type() -> None:
    with expect(
        TypeError,
        "process_group must be a torch.distributed.ProcessGroup or None (world), got int; create "
        "one with syncbn_lightning.new_sync_group()",
    ):
        SyncBatchNorm(4, process_group=2)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- 3. forward


def test_bn_input_not_a_tensor() -> None:
    with expect(TypeError, "SyncBatchNorm input must be a torch.Tensor, got list"):
        SyncBatchNorm(4)([1.0, 2.0])


def test_bn_input_one_dim() -> None:
    with expect(
        ValueError,
        "SyncBatchNorm expects input of shape (N, C, *) with at least 2 dims, got 1-D input of "
        "shape (4,)",
    ):
        SyncBatchNorm(4)(torch.randn(4))


def test_bn_input_wrong_channels() -> None:
    with expect(
        ValueError,
        "SyncBatchNorm input has 5 channels (dim 1) but the layer was built with num_features=4: "
        "use SyncBatchNorm(5) or fix the preceding layer (input shape (2, 5, 3))",
    ):
        SyncBatchNorm(4)(torch.randn(2, 5, 3))


def test_bn_input_integer() -> None:
    with expect(
        TypeError,
        "SyncBatchNorm input must be floating point (float16, bfloat16, float32, float64), got "
        "torch.int64: convert it, e.g. input.float()",
    ):
        SyncBatchNorm(4)(torch.ones(2, 4, 3, dtype=torch.int64))


def test_bn_input_dtype_differs_from_weight() -> None:
    with expect(
        TypeError,
        "SyncBatchNorm input dtype torch.float64 does not match the layer's weight dtype "
        "torch.float32: cast the model (model.to(torch.float64)) or the input; float16/bfloat16 "
        "inputs may also use float32 parameters",
    ):
        SyncBatchNorm(4)(torch.randn(2, 4, 3, dtype=torch.float64))


def test_bn_input_on_other_device() -> None:
    with expect(
        ValueError,
        "SyncBatchNorm input is on meta but the layer's parameters/buffers are on cpu: move the "
        "model with model.to('meta')",
    ):
        SyncBatchNorm(4)(torch.randn(2, 4, 3, device="meta"))


def test_bn_one_value_per_channel() -> None:
    with expect(
        ValueError,
        "Expected more than 1 value per channel when training, got input size torch.Size([1, 3])",
    ):
        SyncBatchNorm(3)(torch.randn(1, 3))


def test_bn_one_value_per_channel_in_the_group() -> None:
    with expect(
        ValueError,
        "Expected more than 1 value per channel when training, got input size torch.Size([1, 3]) "
        "(1 value per channel in the whole sync group of 1 rank(s))",
    ):
        SyncBatchNorm(3, force_sync=True)(torch.randn(1, 3))


def test_bn_process_group_without_this_rank(world_of_4: None) -> None:
    bn = SyncBatchNorm(3)
    bn.process_group = dist.new_group([2, 3])  # what rank 0 gets for a group it is not in
    with expect(
        ValueError,
        "this rank (global rank 0) is not a member of the layer's process_group; give every rank "
        "the group it belongs to (see new_sync_group)",
    ):
        bn(torch.randn(4, 3))


def test_bn_input_dtype_differs_from_running_stats() -> None:
    with expect(
        TypeError,
        "SyncBatchNorm input dtype torch.float64 does not match the layer's running_mean dtype "
        "torch.float32: cast the model (model.to(torch.float64)) or the input; float16/bfloat16 "
        "inputs may also use float32 parameters",
    ):
        SyncBatchNorm(4, affine=False)(torch.randn(2, 4, 3, dtype=torch.float64))


def _skipping_rank(rank: int, world: int) -> BaseException | None:
    net = convert_sync_batchnorm(
        nn.ModuleDict({"stem": nn.BatchNorm1d(4), "head": nn.BatchNorm1d(4)})
    )
    try:
        if rank == 0:
            net["stem"](torch.randn(3, 4))
        net["head"](torch.randn(3, 4))
    except CallOrderError as exc:
        return exc
    return None


@pytest.mark.distributed
def test_bn_call_order_differs_across_ranks() -> None:
    errors = run_distributed(_skipping_rank, 2, timeout=60, pg_timeout_s=30)
    assert errors[0] is not None and str(errors[0]) == str(errors[1])  # every rank raises
    with expect(
        CallOrderError,
        "SyncBatchNorm layers were called in a different order on the ranks of one sync group "
        "(global ranks [0, 1]): rank 0 ran 'stem' (call #1); rank 1 ran 'head' (call #1). Every "
        "rank must run every SyncBatchNorm layer of the group in the same order …",
    ):
        raise errors[0]


# ----------------------------------------------------------------------------- 4. convert/revert


def test_convert_uninitialized_lazy_layer() -> None:
    with expect(
        ValueError,
        "cannot convert the uninitialized lazy layer LazyBatchNorm2d(…): run one forward pass "
        "first so that num_features is known",
    ):
        convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.LazyBatchNorm2d()))


def test_convert_process_group_wrong_type() -> None:
    with expect(
        TypeError,
        "process_group must be a torch.distributed.ProcessGroup or None (world), got str; create "
        "one with syncbn_lightning.new_sync_group()",
    ):
        convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4)), "world")  # type: ignore[arg-type]


def test_convert_not_a_module() -> None:
    with expect(
        TypeError, "module must be a torch.nn.Module (the model or one BatchNorm layer), got str"
    ):
        convert_sync_batchnorm("model")  # type: ignore[arg-type]


def test_revert_not_a_module() -> None:
    with expect(
        TypeError,
        "module must be a torch.nn.Module (the model or one BatchNorm layer), got NoneType",
    ):
        revert_sync_batchnorm(None)  # type: ignore[arg-type]


def test_revert_restores_the_input_rank_check() -> None:
    back = revert_sync_batchnorm(convert_sync_batchnorm(nn.BatchNorm2d(4)))
    with expect(ValueError, "expected 4D input (got 3D input)"):
        back(torch.randn(2, 4, 3))


def test_revert_direct_layer_one_dim_input() -> None:
    back = revert_sync_batchnorm(SyncBatchNorm(4))
    with expect(ValueError, "expected at least 2D input (got 1D input)"):
        back(torch.randn(4))


# ----------------------------------------------------------------------------- 5. groups


def test_group_without_process_group() -> None:
    with expect(
        RuntimeError,
        "new_sync_group() needs an initialized default process group: call "
        "torch.distributed.init_process_group(...) first",
    ):
        new_sync_group(2)


def test_group_size_not_int() -> None:
    with expect(TypeError, "group_size must be an int or None (whole world), got float 2.0"):
        new_sync_group(2.0)  # type: ignore[arg-type]


def test_group_size_not_dividing_world(world_of_4: None) -> None:
    with expect(
        ValueError,
        "group_size=3 must be >= 1 and divide the world size 4; valid values: [1, 2, 4] or None "
        "for the whole world",
    ):
        new_sync_group(3)


def test_group_size_zero(world_of_4: None) -> None:
    with expect(
        ValueError,
        "group_size=0 must be >= 1 and divide the world size 4; valid values: [1, 2, 4] or None "
        "for the whole world",
    ):
        new_sync_group(0)


def test_group_size_larger_than_world(world_of_4: None) -> None:
    with expect(
        ValueError,
        "group_size=8 must be >= 1 and divide the world size 4; valid values: [1, 2, 4] or None "
        "for the whole world",
    ):
        new_sync_group(8)


# ----------------------------------------------------------------------------- 6. callback args


def test_callback_group_size_zero() -> None:
    with expect(ValueError, "group_size must be >= 1 (1 = per-rank BatchNorm), got 0"):
        SyncBNCallback(group_size=0)


def test_callback_group_size_unknown_name() -> None:
    with expect(
        TypeError,
        "group_size must be None (the whole world), an int that divides the world size, 'node' "
        "(the processes of one machine) or 'auto' (the smallest group reaching target_norm_batch "
        "samples), got str 'world'",
    ):
        SyncBNCallback(group_size="world")  # type: ignore[arg-type]


def test_callback_momentum_above_one() -> None:
    with expect(ValueError, "momentum must be in [0, 1] or None (cumulative average), got 1.5; …"):
        SyncBNCallback(momentum=1.5)


def test_callback_eps_negative() -> None:
    with expect(ValueError, "eps must be a finite float > 0 (e.g. 1e-5), got -1.0"):
        SyncBNCallback(eps=-1.0)


def test_callback_target_norm_batch_zero() -> None:
    with expect(ValueError, "target_norm_batch must be an int >= 1, got 0"):
        SyncBNCallback(target_norm_batch=0)


def test_callback_log_every_n_steps_zero() -> None:
    with expect(ValueError, "log_every_n_steps must be an int >= 1, got 0"):
        SyncBNCallback(log_every_n_steps=0)


def test_callback_precise_bn_batches_negative() -> None:
    with expect(ValueError, "precise_bn_batches must be an int >= 0, got -1"):
        SyncBNCallback(precise_bn_batches=-1)


def test_callback_precise_bn_at_unknown() -> None:
    with expect(ValueError, "precise_bn_at must be one of ('fit_end', 'validation'), got 'epoch'"):
        SyncBNCallback(precise_bn_at="epoch")  # type: ignore[arg-type]


def test_callback_on_nonfinite_unknown() -> None:
    with expect(
        ValueError,
        "on_nonfinite must be one of ('warn', 'raise', 'ignore') (what to do when a batch's "
        "synchronized statistics are NaN/inf), got 'skip'",
    ):
        SyncBNCallback(on_nonfinite="skip")  # type: ignore[arg-type]


def test_callback_single_process_unknown() -> None:
    with expect(
        ValueError,
        "single_process must be one of ('leave', 'monitor') (what to do in a run of one process: "
        "leave BatchNorm alone, or monitor it), got 'always'",
    ):
        SyncBNCallback(single_process="always")  # type: ignore[arg-type]


def test_callback_precise_bn_forward_not_callable() -> None:
    with expect(TypeError, "precise_bn_forward must be a callable fn(module, batch)"):
        SyncBNCallback(precise_bn_forward=3)  # type: ignore[arg-type]


def test_callback_auto_without_batch_size() -> None:
    with expect(
        ValueError,
        "group_size='auto' needs the per-device batch size, but the train DataLoader does not "
        "expose one (batch_size=None with a custom batch_sampler?): pass an explicit "
        "SyncBNCallback(group_size=...)",
    ):
        resolve_group_size("auto", 4, 4, per_rank_batch=None)


def test_callback_state_from_another_version() -> None:
    with expect(
        ValueError,
        "SyncBNCallback state version 2 is not supported (expected 1): the checkpoint was written "
        "by a different syncbn_lightning",
    ):
        SyncBNCallback().load_state_dict({"version": 2})


def test_plugin_group_size_auto() -> None:
    with expect(TypeError, "group_size must be None, an int or node, got str 'auto'"):
        SyncBNLayerSync(group_size="auto")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- 7. with a Trainer


def test_trainer_sync_batchnorm_true() -> None:
    with expect(
        ValueError,
        "SyncBNCallback cannot be combined with Trainer(sync_batchnorm=True): that converts the "
        "model to torch.nn.SyncBatchNorm again (which refuses CPU tensors). Remove "
        "sync_batchnorm=True; SyncBNCallback already synchronizes BatchNorm",
    ):
        _setup(SyncBNCallback(), sync_batchnorm=True)


def test_trainer_callback_and_plugin() -> None:
    with expect(
        ValueError,
        "SyncBNCallback and the SyncBNLayerSync plugin both convert BatchNorm layers: use one of "
        "them (pass group_size/momentum/eps to the one you keep)",
    ):
        _setup(SyncBNCallback(), plugins=[SyncBNLayerSync()])


def test_trainer_plugin_and_sync_batchnorm_true() -> None:
    with expect(
        MisconfigurationException,
        "You set `Trainer(sync_batchnorm=True)` and provided a `SyncBNLayerSync` plugin, but this "
        "is not allowed. Choose one or the other.",
    ):
        _setup(SyncBNCallback(), plugins=[SyncBNLayerSync()], sync_batchnorm=True)


def test_trainer_strategy_not_ddp() -> None:
    with expect(
        ValueError,
        "SyncBNCallback supports the DDP strategies (strategy='ddp', 'ddp_spawn', 'ddp_fork'), got "
        "ModelParallelStrategy: sharded strategies (FSDP, DeepSpeed) keep parameters sharded and "
        "are not supported",
    ):
        _setup(SyncBNCallback(), strategy=ModelParallelStrategy())


def test_trainer_group_size_not_dividing_world() -> None:
    with expect(
        ValueError,
        "group_size=3 means 3 ranks per sync group, which does not divide the world size 2 "
        "(num_nodes x devices): use one of [1, 2], None, 'node' or 'auto'",
    ):
        _setup(SyncBNCallback(group_size=3))


def test_trainer_broadcast_buffers_with_groups() -> None:
    strategy = DDPStrategy(broadcast_buffers=True, start_method="spawn")
    with expect(
        ValueError,
        "DDPStrategy(broadcast_buffers=True) broadcasts rank 0's BatchNorm running stats before "
        "every forward, overwriting the other sync groups' statistics: drop broadcast_buffers or "
        "use SyncBNCallback(group_size=None) (one group for the whole world)",
    ):
        _setup(SyncBNCallback(group_size="auto"), strategy=strategy)


# ----------------------------------------------------------------------------- 8. train.py


def test_config_devices_zero(tmp_path: Path) -> None:
    with expect(
        app.ConfigError, "trainer.devices=0: must be a positive integer (processes per node)"
    ):
        _validate(tmp_path, "trainer.devices=0")


def test_config_model_monitor_not_logged(tmp_path: Path) -> None:
    with expect(
        app.ConfigError,
        "model.monitor='val/map': CenterNet logs val/mAP, val/mAP50 (higher is better); use one "
        "of them",
    ):
        _validate(tmp_path, "model.monitor=val/map")


def test_config_global_batch_size_set(tmp_path: Path) -> None:
    with expect(
        app.ConfigError,
        "data.global_batch_size=32: it is derived, data.batch_size x trainer.devices x "
        "trainer.num_nodes x trainer.accumulate_grad_batches = 4; change those instead",
    ):
        _validate(tmp_path, "data.global_batch_size=32")


def test_config_devices_auto(tmp_path: Path) -> None:
    with expect(
        app.ConfigError, "trainer.devices='auto': must be a positive integer (processes per node)"
    ):
        _validate(tmp_path, "trainer.devices=auto")


def test_config_strategy_not_ddp(tmp_path: Path) -> None:
    with expect(
        app.ConfigError,
        "trainer.strategy='ddp_spawn' with 2 processes: the service runs DDP with one started "
        "process per device, use trainer.strategy=ddp",
    ):
        _validate(tmp_path, "trainer.strategy=ddp_spawn")


def test_config_more_gpus_than_present(tmp_path: Path) -> None:
    with expect(
        app.ConfigError,
        "trainer.accelerator=gpu with trainer.devices=64, but this machine has <gpus> CUDA GPU(s): "
        "use trainer=cpu or fewer devices",
        gpus=torch.cuda.device_count(),
    ):
        _validate(tmp_path, "trainer=gpu", "trainer.devices=64")


def test_config_nodes_without_rendezvous(tmp_path: Path) -> None:
    with expect(
        app.ConfigError,
        "trainer.num_nodes=2 needs torchrun/SLURM, or MASTER_ADDR, MASTER_PORT, NODE_RANK set on "
        "every node (NODE_RANK=0 on the node at MASTER_ADDR); see the README",
    ):
        _validate(tmp_path, "trainer.num_nodes=2")


def test_config_group_size_not_dividing_devices(tmp_path: Path) -> None:
    with expect(
        app.ConfigError,
        "bn.group_size=3: group_size=3 means 3 ranks per sync group, which does not divide the "
        "world size 4 (num_nodes x devices): use one of [1, 2, 4], None, 'node' or 'auto'",
    ):
        _validate(tmp_path, "trainer.devices=4", "bn.group_size=3")


def test_config_group_size_unknown_name(tmp_path: Path) -> None:
    with expect(
        app.ConfigError,
        "bn.group_size='banana': group_size must be None (the whole world), an int that divides "
        "the world size, 'node' (the processes of one machine) or 'auto' (the smallest group "
        "reaching target_norm_batch samples), got str 'banana'",
    ):
        _validate(tmp_path, "bn.group_size=banana")


def test_config_group_size_zero(tmp_path: Path) -> None:
    with expect(
        app.ConfigError, "bn.group_size=0: group_size must be >= 1 (1 = per-rank BatchNorm), got 0"
    ):
        _validate(tmp_path, "bn.group_size=0")


def test_config_momentum_out_of_range(tmp_path: Path) -> None:
    with expect(
        app.ConfigError,
        "bn.momentum=2: momentum must be in [0, 1] or None (cumulative average), got 2; torch "
        "convention: the weight of the new batch (TF/Keras momentum m is 1 - m here)",
    ):
        _validate(tmp_path, "bn.momentum=2")


def test_config_eps_zero(tmp_path: Path) -> None:
    with expect(app.ConfigError, "bn.eps=0: eps must be a finite float > 0 (e.g. 1e-5), got 0"):
        _validate(tmp_path, "bn.eps=0")


def test_config_eps_not_a_number(tmp_path: Path) -> None:
    with expect(app.ConfigError, "bn.eps='abc': eps must be a float > 0, got str 'abc'"):
        _validate(tmp_path, "bn.eps=abc")


def test_config_precise_bn_at_unknown(tmp_path: Path) -> None:
    with expect(
        app.ConfigError,
        "bn.precise_bn_at='epoch': precise_bn_at must be one of ('fit_end', 'validation'), got "
        "'epoch'",
    ):
        _validate(tmp_path, "bn.precise_bn_at=epoch")


def test_config_implementation_unknown(tmp_path: Path) -> None:
    with expect(app.ConfigError, "bn.implementation='cuda': use auto, ext or ref"):
        _validate(tmp_path, "bn.implementation=cuda")


def test_config_data_root_missing(tmp_path: Path) -> None:
    with expect(
        app.ConfigError,
        "data.root is required: pass data.root=/path/to/a/coco-format/folder",
    ):
        _validate(tmp_path, "data=coco")


def test_config_data_root_does_not_exist(tmp_path: Path) -> None:
    with expect(
        app.ConfigError,
        "data.root=/nonexistent/coco: 4 required path(s) missing, e.g. "
        "/nonexistent/coco/train2017; point data.root at a COCO-format folder, or use data=shapes",
    ):
        _validate(tmp_path, "data=coco", "data.root=/nonexistent/coco")


def test_config_data_files_missing(tmp_path: Path) -> None:
    root = tmp_path / "coco"
    (root / "train2017").mkdir(parents=True)  # images, but no annotations and no val split
    with expect(
        app.ConfigError,
        "data.root=<root>: 3 required path(s) missing, e.g. "
        "<root>/annotations/instances_train2017.json; point data.root at a COCO-format folder, or "
        "use data=shapes",
        root=root,
    ):
        _validate(tmp_path, "data=coco", f"data.root={root}")


def test_config_data_batch_size_zero(tmp_path: Path) -> None:
    with expect(app.ConfigError, "data.batch_size must be an int >= 1, got 0"):
        _validate(tmp_path, "data.batch_size=0")


def test_config_synthetic_clutter_negative(tmp_path: Path) -> None:
    with expect(
        app.ConfigError,
        "data.synthetic: clutter must be an int >= 0 (most unannotated distractors per image), "
        "got -1",
    ):
        _validate(tmp_path, "data=shapes_hard", "data.synthetic.clutter=-1")


def test_config_synthetic_photometric_out_of_range(tmp_path: Path) -> None:
    with expect(
        app.ConfigError,
        "data.synthetic: photometric must be a number in [0, 1) (the per-image contrast and "
        "brightness spread), got 1.5",
    ):
        _validate(tmp_path, "data=shapes_hard", "data.synthetic.photometric=1.5")


def test_config_data_unknown_key(tmp_path: Path) -> None:
    with expect(
        app.ConfigError, "CocoDataModule.__init__() got an unexpected keyword argument 'foo'"
    ):
        _validate(tmp_path, "+data.foo=1")


def test_config_model_optimizer_unknown(tmp_path: Path) -> None:
    with expect(app.ConfigError, "model.optim.name must be 'adamw' or 'sgd', got 'lamb'"):
        _validate(tmp_path, "model.optim.name=lamb")


def test_config_ckpt_path_missing(tmp_path: Path) -> None:
    with expect(app.ConfigError, "ckpt_path=/nonexistent.ckpt: no such checkpoint file"):
        _validate(tmp_path, "ckpt_path=/nonexistent.ckpt")


def test_config_ckpt_path_is_a_directory(tmp_path: Path) -> None:
    with expect(app.ConfigError, "ckpt_path=<dir>: no such checkpoint file", dir=tmp_path):
        _validate(tmp_path, f"ckpt_path={tmp_path}")


def test_config_wandb_offline_invalid(tmp_path: Path) -> None:
    with expect(app.ConfigError, "logger.wandb.offline='maybe': use auto, true or false"):
        _validate(tmp_path, "logger.wandb.offline=maybe")


def test_config_logger_unknown_option(tmp_path: Path) -> None:
    with expect(
        MissingConfigException,
        "In 'train': Could not find 'logger/banana'…Available options in 'logger':…",
    ):
        _validate(tmp_path, "logger=banana")


# ----------------------------------------------------------------------------- 9. datasets


def _annotations(path: Path, annotations: list[dict[str, object]]) -> Path:
    coco = {
        "images": [{"id": 1, "file_name": "x.png"}],
        "categories": [{"id": 1}],
        "annotations": annotations,
    }
    path.write_text(json.dumps(coco))
    return path


def test_dataset_images_dir_missing(tmp_path: Path) -> None:
    with expect(
        FileNotFoundError,
        "images_dir='<tmp>/nope' is not a directory; pass the directory that the images' "
        "file_name entries are relative to",
        tmp=tmp_path,
    ):
        CocoDetection(tmp_path / "nope", tmp_path / "a.json", 64)


def test_dataset_annotation_file_missing(tmp_path: Path) -> None:
    with expect(
        FileNotFoundError,
        "annotation_file='<tmp>/a.json' does not exist; pass a COCO instances JSON file",
        tmp=tmp_path,
    ):
        CocoDetection(tmp_path, tmp_path / "a.json", 64)


def test_dataset_not_coco_json(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("[]")
    with expect(
        ValueError,
        "annotation_file='<tmp>/a.json' is not COCO detection JSON (needs 'images', "
        "'annotations' and 'categories')",
        tmp=tmp_path,
    ):
        CocoDetection(tmp_path, tmp_path / "a.json", 64)


def test_dataset_unknown_category(tmp_path: Path) -> None:
    box = {"id": 7, "image_id": 1, "category_id": 5, "bbox": [0, 0, 4, 4]}
    annotations = _annotations(tmp_path / "a.json", [box])
    with expect(
        ValueError,
        "annotation 7 of <tmp>/a.json refers to category 5 / image 1, which the file does not "
        "list; fix the annotation file",
        tmp=tmp_path,
    ):
        CocoDetection(tmp_path, annotations, 64)


def test_dataset_image_file_missing(tmp_path: Path) -> None:
    dataset = CocoDetection(tmp_path, _annotations(tmp_path / "a.json", []), 64)
    with expect(
        FileNotFoundError, "[Errno 2] No such file or directory: '<tmp>/x.png'", tmp=tmp_path
    ):
        dataset[0]


# ----------------------------------------------------------------------------- the doc


def _doc_rows() -> list[tuple[str, str, str]]:
    """``(exception, message, test)`` of every row of the doc's tables (header rows excluded)."""
    rows = []
    for line in DOC.read_text().splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if cells[0] == "input" or set("".join(cells)) <= set("-: "):
            continue
        assert len(cells) == 4, f"a row needs 4 cells (input, exception, message, test): {line}"
        _input, error, message, test = cells
        assert error.startswith("`") and error.endswith("`"), line
        assert message.startswith("`` ") and message.endswith(" ``"), line
        assert re.fullmatch(r"`test_\w+`", test), line
        rows.append((error.strip("`"), message[3:-3].replace("\\|", "|"), test.strip("`")))
    return rows


def _asserted() -> dict[str, tuple[str, str]]:
    """``{test name: (exception name, text)}`` of the one ``expect(...)`` in each row test."""
    tree = ast.parse(Path(__file__).read_text())
    found = {}
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
            continue
        if node.name in SYNC_TESTS:
            continue
        calls = [
            item.context_expr
            for w in ast.walk(node)
            if isinstance(w, ast.With)
            for item in w.items
            if isinstance(item.context_expr, ast.Call)
            and isinstance(item.context_expr.func, ast.Name)
            and item.context_expr.func.id == "expect"
        ]
        assert len(calls) == 1, f"{node.name} must assert exactly one expect(...)"
        error, text = calls[0].args[:2]
        name = error.attr if isinstance(error, ast.Attribute) else ast.unparse(error)
        assert isinstance(text, ast.Constant) and isinstance(text.value, str), node.name
        found[node.name] = (name, text.value)
    return found


def test_doc_table_matches_these_tests() -> None:
    rows = _doc_rows()
    asserted = _asserted()
    names = [test for _, _, test in rows]
    assert len(names) == len(set(names)), "a test is named by more than one row"
    assert set(names) - set(asserted) == set(), "rows naming no test of tests/test_errors.py"
    assert set(asserted) - set(names) == set(), "tests without a row in docs/errors.md"
    for error, message, test in rows:
        assert (error, message) == asserted[test], f"{test}: the row quotes something else"
    text = DOC.read_text()
    assert all(f"`{name}`" in text for name in SYNC_TESTS)
