"""DataParallel: the replicas of one module normalize as one batch, inside one process.

torch refuses ``nn.DataParallel`` replication on CPU, so the replicas here are copies of the
converted module joined by :func:`join_replicas` (what :class:`SyncDataParallel` does after
``replicate``) and run in threads, each with its own forward and backward, as ``DataParallel``
runs them on GPUs. Oracle: one plain ``nn.BatchNorm2d`` model on the concatenated batch (fp32).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from syncbn_lightning import SyncDataParallel, convert_sync_batchnorm, join_replicas

SIZES = [2, 5, 0]  # uneven per-replica batches and an empty replica


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4)
    )


def _run_threads(
    replicas: list[nn.Module], inputs: list[torch.Tensor], grads: list[torch.Tensor]
) -> list[object]:
    """Each replica's forward and backward in its own thread; returns outputs or exceptions."""
    results: list[object] = [None] * len(replicas)

    def work(i: int) -> None:
        try:
            out = replicas[i](inputs[i])
            out.backward(grads[i])
            results[i] = out.detach()
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_replicas_in_threads_match_one_batchnorm_on_the_whole_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(n, 3, 5, 5, generator=gen).requires_grad_(True) for n in SIZES]
    grads = [torch.randn(n, 4, 5, 5, generator=gen) for n in SIZES]
    synced = convert_sync_batchnorm(_model())
    replicas = [copy.deepcopy(synced) for _ in SIZES]
    join_replicas(replicas)
    outputs = _run_threads(replicas, inputs, grads)
    for out in outputs:
        assert isinstance(out, torch.Tensor), out

    plain = _model()
    whole = torch.cat([x.detach() for x in inputs]).requires_grad_(True)
    expected = plain(whole)
    expected.backward(torch.cat(grads))
    for i, n in enumerate(SIZES):
        start = sum(SIZES[:i])
        torch.testing.assert_close(
            outputs[i], expected[start : start + n].detach(), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            inputs[i].grad, whole.grad[start : start + n], rtol=1e-5, atol=1e-5
        )
    # DataParallel sums the replicas' parameter gradients into the module's. (The conv bias's is
    # 0 analytically, BatchNorm removes it; both sides hold float32 rounding residue ~1e-5.)
    for name, param in plain.named_parameters():
        summed = sum(dict(r.named_parameters())[name].grad for r in replicas)
        torch.testing.assert_close(summed, param.grad, rtol=1e-5, atol=5e-5)
    # Every replica holds the running statistics of the whole batch.
    for replica in replicas:
        for layer, ref in ((replica[1], plain[1]), (replica[3], plain[3])):
            torch.testing.assert_close(layer.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(layer.running_var, ref.running_var, rtol=1e-5, atol=1e-6)
            assert int(layer.num_batches_tracked) == 1


def test_a_replica_that_never_arrives_is_an_error_not_a_hang() -> None:
    replicas = [convert_sync_batchnorm(_model()) for _ in range(2)]
    join_replicas(replicas, timeout_s=1.0)
    x = torch.randn(2, 3, 5, 5)
    results = _run_threads(replicas[:1], [x], [torch.ones(2, 4, 5, 5)])
    assert isinstance(results[0], RuntimeError)
    assert "the other DataParallel replicas did not reach this layer within 1 s" in str(results[0])


def test_without_replication_data_parallel_runs_the_module_itself() -> None:
    """On CPU ``nn.DataParallel`` (and so SyncDataParallel) calls the module directly."""
    model = convert_sync_batchnorm(_model())
    x = torch.randn(4, 3, 5, 5)
    torch.testing.assert_close(SyncDataParallel(model)(x), _model()(x), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_sync_data_parallel_on_two_gpus() -> None:
    plain = _model().cuda()
    model = SyncDataParallel(convert_sync_batchnorm(_model()).cuda(), device_ids=[0, 1])
    x = torch.randn(5, 3, 5, 5, device="cuda")
    torch.testing.assert_close(model(x), plain(x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.module[1].running_mean, plain[1].running_mean)
