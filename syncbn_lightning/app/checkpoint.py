"""Checkpoint IO of the service: a killed process never leaves a truncated checkpoint."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from typing_extensions import override

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO``, but a local checkpoint is written beside its final path
    (``.<name>.partial``), flushed to disk and renamed over it, so a process killed mid-write
    leaves the previous ``last.ckpt`` whole.

    Lightning writes to a temporary file in ``$TMPDIR`` and moves it into place: atomic only when
    ``$TMPDIR`` is on the checkpoint's filesystem; otherwise the move copies into the final file,
    and a kill during the copy leaves a truncated checkpoint (and a stray file in ``$TMPDIR``).
    Remote paths (fsspec URLs) still go through Lightning's implementation.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        from fsspec.implementations.local import LocalFileSystem

        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(str(path).removeprefix("file://"))
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial")
        try:
            with open(partial, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, target)
        except BaseException:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise
