"""Layer 2: implementation choice, lazy cached build, fallback, stale build locks.

Scenarios that involve building run in fresh interpreters, with their own cache directory where the
build must not touch the shared one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from syncbn_lightning._compat import torch_build_lock_is_flock
from syncbn_lightning.ops import build as ops_build
from syncbn_lightning.ops import build_lock
from syncbn_lightning.ops import dispatch as syncbn_impl
from syncbn_lightning.ops import reference as R


def _python(code: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "always::RuntimeWarning", "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_invalid_impl_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", "fast")
    with pytest.raises(ValueError, match=r"SYNCBN_IMPL='fast' is not valid: use one of auto, ext"):
        syncbn_impl.ops_for(torch.zeros(1))


def test_ref_selects_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", "REF")
    assert syncbn_impl.ops_for(torch.zeros(1)) is R


def test_ext_on_cpu_selects_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYNCBN_IMPL", "ext")
    ops = syncbn_impl.ops_for(torch.zeros(1))
    assert ops is ops_build.load_extension()
    assert ops.with_cuda is False or torch.cuda.is_available()


def test_cache_directory_is_private_and_keyed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYNCBN_CACHE_DIR", str(tmp_path / "cache"))
    path = ops_build.build_dir()
    assert path.parent == tmp_path / "cache"
    assert len(path.name) == 16 and path.name in ops_build._build_spec()["name"]
    for p in (path, path.parent):
        assert p.stat().st_mode & 0o077 == 0, f"{p} must not be accessible to group/others"


@pytest.mark.slow
def test_import_and_plain_use_build_nothing(tmp_path: Path) -> None:
    result = _python(
        """
        import torch, syncbn_lightning as s
        bn = s.SyncBatchNorm(3)
        bn(torch.randn(4, 3, 2, 2))            # no process group: plain BatchNorm path
        s.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(2)))
        """,
        {"SYNCBN_CACHE_DIR": str(tmp_path)},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_failed_build_falls_back_once_with_the_cause(tmp_path: Path) -> None:
    code = """
        import torch, syncbn_lightning as s
        bn = s.SyncBatchNorm(3, force_sync=True)
        x = torch.randn(4, 3, 5)
        for _ in range(3):
            y = bn(x)
        torch.testing.assert_close(y, torch.nn.functional.batch_norm(x, None, None, training=True))
        print("FORWARD-OK")
    """
    env = {"SYNCBN_CACHE_DIR": str(tmp_path), "CXX": "/bin/false", "SYNCBN_IMPL": "auto"}
    auto = _python(code, env)
    assert auto.returncode == 0, auto.stderr
    assert "FORWARD-OK" in auto.stdout
    assert auto.stderr.count("C++ extension unavailable") == 1, auto.stderr
    assert "Build dir: " + str(tmp_path) in auto.stderr
    # Said before the build starts, with the one measured build time.
    announced = auto.stderr.index("syncbn_lightning: compiling the C++ extension")
    assert announced < auto.stderr.index("C++ extension unavailable")
    assert f"about {ops_build.MEASURED_BUILD_S} s on an idle 2-core machine" in auto.stderr

    strict = _python(code, {**env, "SYNCBN_IMPL": "ext"})
    assert strict.returncode != 0
    assert "ExtensionBuildError: building the C++ extension failed" in strict.stderr
    assert "lock" in strict.stderr  # the message explains stale build locks


def test_a_build_is_announced_then_says_how_long_it_has_been_running(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build_lock, "HEARTBEAT_S", 0.05)
    with caplog.at_level("WARNING", logger=ops_build.__name__):  # the build's one logger
        with build_lock._heartbeat("ext", tmp_path / "key", with_cuda=False):
            time.sleep(0.3)
        after = len(caplog.messages)
        time.sleep(0.2)  # nothing once the build is over
    assert len(caplog.messages) == after
    first, *beats = caplog.messages
    assert first == (
        f"syncbn_lightning: compiling the C++ extension ext once (about "
        f"{ops_build.MEASURED_BUILD_S} s on an idle 2-core machine); later runs load it from "
        f"{tmp_path / 'key'}"
    )
    assert 2 <= len(beats) <= 6, beats
    beat = re.compile(r"syncbn_lightning: still compiling the C\+\+ extension, (\d+) s so far")
    seconds = [int(beat.fullmatch(b)[1]) for b in beats]  # type: ignore[index]
    assert seconds == sorted(seconds) and seconds[-1] <= 1


@pytest.mark.slow
def test_stale_lock_from_a_killed_build_is_removed() -> None:
    ops_build.load_extension()  # built (or loaded) under the default cache
    lock = ops_build.build_dir() / "lock"
    lock.write_text("")  # what a build killed mid-way leaves behind, its library not marked built
    (ops_build.build_dir() / ops_build.BUILT_MARK).unlink(missing_ok=True)
    result = _python(
        """
        from syncbn_lightning.ops import build as ops_build
        from syncbn_lightning.ops import dispatch as syncbn_impl
        ops_build.load_extension()
        print("LOADED")
        """,
        {},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "LOADED" in result.stdout
    if torch_build_lock_is_flock():  # torch 2.14's builder flocks the file and leaves it
        assert "removing a stale build lock" not in result.stderr, result.stderr[-2000:]
    else:
        assert "removing a stale build lock" in result.stderr
        assert not lock.exists()


def test_a_rank_that_waited_for_another_s_build_loads_it_without_a_word() -> None:
    """Two ranks start on an unbuilt directory: the one that waited for the lock finds the
    library built and marked, and loads it (no compile, no ninja, no warning about the ``lock``
    file the builder left: torch 2.14's builder leaves one after every build)."""
    import fcntl
    import threading

    ops_build.load_extension()
    directory = ops_build.build_dir()
    mark = directory / ops_build.BUILT_MARK
    with open(directory / ".syncbn_build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # "the other rank" is building
        mark.unlink()
        (directory / "lock").write_text("")
        timer = threading.Timer(3.0, lambda: (mark.touch(), fcntl.flock(handle, fcntl.LOCK_UN)))
        timer.start()
        result = _python(
            """
            from syncbn_lightning.ops import build as ops_build
            ops_build.load_extension()
            print("LOADED")
            """,
            {},
            timeout=120,
        )
        timer.join()
    (directory / "lock").unlink(missing_ok=True)
    assert result.returncode == 0 and "LOADED" in result.stdout, result.stderr[-2000:]
    assert "stale" not in result.stderr and "compiling" not in result.stderr, result.stderr


def test_build_running_says_whether_a_process_holds_the_build_lock(tmp_path: Path) -> None:
    """What the service's rank uses to say it loaded another process's build (app/kernels.py):
    true while a descriptor of another open holds the lock, false before and after."""
    import fcntl

    from syncbn_lightning.ops.build_lock import build_running

    assert not build_running(tmp_path)
    with open(tmp_path / ".syncbn_build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        assert build_running(tmp_path)
        fcntl.flock(handle, fcntl.LOCK_UN)
        assert not build_running(tmp_path)
    assert not build_running(tmp_path / "missing")


def test_a_built_library_loads_while_another_process_holds_the_build_lock() -> None:
    """The ranks of a node load a built extension side by side: no lock, no ninja (a rank that
    waited behind the others, or behind another checkout's compile, could miss its first
    collective's timeout)."""
    import fcntl

    ops_build.load_extension()  # built and marked, or loaded
    directory = ops_build.build_dir()
    assert (directory / ops_build.BUILT_MARK).exists()
    with open(directory / ".syncbn_build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # a build in progress, as far as the lock says
        result = _python(
            """
            from syncbn_lightning.ops import build as ops_build
            ops_build.load_extension()
            print("LOADED")
            """,
            {ops_build.BUILD_TIMEOUT_ENV: "5"},
            timeout=120,
        )
    assert result.returncode == 0 and "LOADED" in result.stdout, result.stderr[-2000:]


def test_two_checkouts_of_the_same_sources_build_in_directories_of_their_own(
    tmp_path: Path,
) -> None:
    """ninja's build file names the sources' paths: one directory shared by two checkouts (a
    clone and a worktree) was rebuilt whenever the other had loaded it, for minutes, under the
    lock every rank waits on."""
    import shutil

    keys = []
    for checkout in ("clone", "worktree"):
        csrc = shutil.copytree(ops_build.csrc_dir(), tmp_path / checkout / "csrc")
        files = ops_build.csrc_files(Path(csrc), ".cpp", ".h")
        keys.append(ops_build.source_key(files, ()))
        assert ops_build.source_key(files, ()) == keys[-1]  # the same checkout: the same key
    assert keys[0] != keys[1]


def test_cache_key_follows_cuda_architectures_and_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    hopper = ops_build._build_spec(cuda=True)["key"]
    cpu = ops_build._build_spec(cuda=False)["key"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    assert ops_build._build_spec(cuda=True)["key"] != hopper  # an sm_90 binary is not for an A100
    assert ops_build._build_spec(cuda=False)["key"] == cpu  # CPU builds do not depend on it
    monkeypatch.setattr(sys, "prefix", sys.prefix + "-another-venv")
    assert ops_build._build_spec(cuda=False)["key"] != cpu


@pytest.mark.slow
def test_a_failed_cuda_build_falls_back_to_the_cpu_kernels_with_one_warning() -> None:
    """The CUDA part of the build fails (here: made to); the CPU kernels still build and serve."""
    result = _python(
        """
        import warnings, torch
        from torch.utils import cpp_extension
        from syncbn_lightning.ops import build as ops_build
        from syncbn_lightning.ops import dispatch as syncbn_impl
        real_load, calls = cpp_extension.load, []
        def load(**kwargs):
            calls.append(kwargs["with_cuda"])
            if kwargs["with_cuda"]:
                raise RuntimeError("nvcc fatal: Unsupported gpu architecture 'compute_99'")
            return real_load(**kwargs)
        cpp_extension.load = load
        ops_build._cuda_build_blockers = lambda csrc: []
        cpu_dir = ops_build.build_dir(ops_build._build_spec(cuda=False))
        marked = (cpu_dir / ops_build.BUILT_MARK).exists()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ext = ops_build.load_extension()
        # A CPU build already completed (marked) loads without cpp_extension.load.
        assert calls == ([True] if marked else [True, False]), (calls, marked)
        assert ext.with_cuda is False
        messages = [str(w.message) for w in caught if "CUDA kernels failed" in str(w.message)]
        assert len(messages) == 1 and "compute_99" in messages[0], messages
        assert "CPU kernels only" in messages[0]
        x = torch.randn(6, 3)
        torch.testing.assert_close(ext.local_stats(x)[0], x.mean(0))
        print("ok")
        """,
        {},
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_a_required_cuda_build_fails_at_once_naming_why() -> None:
    """``SYNCBN_REQUIRE_CUDA_BUILD=1`` (the GPU check's build step): a build that would have no
    CUDA kernels raises before compiling anything, naming the reasons."""
    result = _python(
        """
        from syncbn_lightning.ops import build as ops_build
        try:
            ops_build.load_extension()
        except ops_build.ExtensionBuildError as exc:
            print(exc)
        else:
            print("built")
        """,
        {"SYNCBN_REQUIRE_CUDA_BUILD": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    assert "SYNCBN_REQUIRE_CUDA_BUILD=1, but the extension would have no CUDA kernels" in text
    assert "is a build without CUDA" in text or "no CUDA device is visible" in text, text


@pytest.mark.slow
def test_a_required_cuda_build_that_fails_raises_instead_of_falling_back() -> None:
    result = _python(
        """
        from torch.utils import cpp_extension
        from syncbn_lightning.ops import build as ops_build
        def load(**kwargs):
            raise RuntimeError("nvcc fatal: Unsupported gpu architecture 'compute_99'")
        cpp_extension.load = load
        ops_build._cuda_build_blockers = lambda csrc: []
        try:
            ops_build.load_extension()
        except ops_build.ExtensionBuildError as exc:
            print("raised", "compute_99" in str(exc))
        """,
        {"SYNCBN_REQUIRE_CUDA_BUILD": "1"},
    )
    assert result.stdout.strip() == "raised True", (result.stdout, result.stderr[-3000:])


def test_a_fresh_shared_library_build_returns_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``build_locked`` returns the library's path after a fresh build whatever torch's loader
    returns: torch 2.4's ``cpp_extension.load`` returns None for a shared library (the floor's
    first build failed on it in ``Path(None)``)."""
    from torch.utils import cpp_extension

    from syncbn_lightning.ops.build_lock import BUILT_MARK, build_locked

    calls: list[str] = []

    def load_as_torch_2_4(**kwargs: Any) -> None:
        calls.append(kwargs["name"])

    monkeypatch.setattr(cpp_extension, "load", load_as_torch_2_4)
    library = build_locked(
        "fake_ext", tmp_path, sources=[], include_paths=[], cflags=[], ldflags=[],
        python_module=False,
    )  # fmt: skip
    assert library == str(tmp_path / "fake_ext.so") and calls == ["fake_ext"]
    assert (tmp_path / BUILT_MARK).exists()


def test_the_build_records_what_the_library_links(tmp_path: Path) -> None:
    """The ``.so``'s NEEDED entries, read from its ELF header: this machine's build links
    libstdc++ dynamically, so the layers need no Python checks in front of the C++ path."""
    from syncbn_lightning.ops import link_record

    ext = ops_build.load_extension()
    library = ops_build.build_dir() / f"{ext.__name__}.so"
    record = link_record.link_record(library)
    assert library.with_name(library.name + ".link.json").is_file()
    assert any(name.startswith("libstdc++") for name in record["needed"]), record
    assert record["static_libstdcxx"] is False and ext.static_libstdcxx is False
    assert len(ext.sources_digest) == 16
    text = tmp_path / "not_elf.so"
    text.write_bytes(b"#!/bin/sh\n")
    assert link_record.needed_libraries(text) is None
    assert link_record.write_link_record(text)["static_libstdcxx"] is True  # unknown: safe side


def test_uses_extension_carries_the_mark_of_assume_constant_result() -> None:
    """``uses_extension`` is marked by hand (sparing ``import syncbn_lightning`` the import of
    ``torch._dynamo``); the mark must be what the decorator sets, or torch.compile would trace
    into it (a graph break) instead of baking its answer into the graph."""

    def probe() -> bool:
        return True

    marked = torch.compiler.assume_constant_result(probe)
    assert vars(marked)  # the decorator marks the function itself
    assert {key: getattr(syncbn_impl.uses_extension, key, None) for key in vars(marked)} == vars(
        marked
    )
