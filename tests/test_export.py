"""Layer 4: exporting a converted model (``docs/library.md``, Export).

In eval mode a converted model computes what the plain model computes (running statistics, no
communication), and the export paths that record a call take it as it is: ``torch.export``,
ONNX (``torch.onnx.export``, its default torch.export-based exporter) and ``torch.jit.trace``.
``torch.jit.script`` cannot compile the layer and says so, naming ``revert_sync_batchnorm``,
which gives a scriptable model of the same tensors. Each export is checked against the converted
model's own eval output on an input it was not recorded with.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from syncbn_lightning import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm


def _converted() -> nn.Module:
    """A small convnet with BatchNorm in 1-D and 2-D, converted, with non-trivial running stats
    (a few training steps outside torch.distributed), in eval mode."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 6),
        nn.BatchNorm1d(6),
    )
    model = convert_sync_batchnorm(model)
    for _ in range(3):
        model(torch.randn(4, 3, 10, 10) * 3 + 1)
    return model.eval()


def _sample(seed: int) -> torch.Tensor:
    return torch.randn(5, 3, 10, 10, generator=torch.Generator().manual_seed(seed))


def test_jit_script_of_the_reverted_copy_matches_and_leaves_the_model_alone() -> None:
    model = _converted()
    scripted = torch.jit.script(revert_sync_batchnorm(copy.deepcopy(model)).eval())
    x = _sample(1)
    torch.testing.assert_close(scripted(x), model(x), rtol=0, atol=0)
    assert isinstance(model[1], SyncBatchNorm) and isinstance(model[6], SyncBatchNorm)
    assert "SyncBatchNorm" not in str(scripted.graph)


def test_torch_export_records_plain_batch_norm() -> None:
    model = _converted()
    program = torch.export.export(model, (_sample(0),))
    x = _sample(1)
    torch.testing.assert_close(program.module()(x), model(x), rtol=0, atol=0)
    code = program.graph_module.code
    # aten.batch_norm, or the inference op it decomposes to (torch 2.4 records the latter).
    calls = [n for n in program.graph.nodes if n.op == "call_function" and "batch_norm" in str(n)]
    assert len(calls) == 2, code
    assert "syncbn" not in code and "c10d" not in code  # no kernels of ours, no collective


def test_jit_trace_matches_without_tracer_warnings() -> None:
    """(torch 2.13 deprecates ``torch.jit.trace`` itself with a DeprecationWarning.)"""
    model = _converted()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("error", torch.jit.TracerWarning)  # none from the layer's checks
        traced = torch.jit.trace(model, _sample(0))
    x = _sample(1)
    torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)


@pytest.mark.slow
def test_onnx_export_runs_in_the_onnx_reference_evaluator(tmp_path, monkeypatch) -> None:
    from onnx.reference import ReferenceEvaluator  # the [test] extra's onnx

    monkeypatch.chdir(tmp_path)  # a failed export writes its report into the working folder
    model = _converted()
    try:  # the control: torch's exporter on the plain model (torch 2.4's fails on it)
        torch.onnx.export(revert_sync_batchnorm(copy.deepcopy(model)), (_sample(0),), dynamo=True)
    except Exception as exc:
        pytest.skip(f"torch {torch.__version__} cannot export the plain model either: {exc!r:.80}")
    program = torch.onnx.export(model, (_sample(0),), dynamo=True, verbose=False)
    proto = program.model_proto
    x = _sample(1)
    (got,) = ReferenceEvaluator(proto).run(None, {proto.graph.input[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), model(x), rtol=1e-5, atol=1e-5)
