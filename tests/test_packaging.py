"""The two houses: the library installs and imports with torch alone; the service is an extra.

* ``import syncbn_lightning`` (and every module of ``ops``, ``distributed``, ``functional`` and
  ``nn``) imports neither Lightning nor Hydra, OmegaConf or W&B.
* pyproject's dependencies: torch and ninja; Lightning in ``[lightning]``; the service's packages
  in ``[app]``; the console scripts point at functions that exist.
* ``conf/`` ships in the wheel: every config group is listed as a package, and (slow) a wheel
  installed into a fresh virtualenv runs ``syncbn-train`` outside the clone, one real job included.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
from _service import RENDEZVOUS_VARS

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SERVICE_DEPS = ("lightning", "hydra", "omegaconf", "wandb", "matplotlib", "PIL", "pycocotools")
# The torch-only library: the root package and every module of its four lower layers. The import
# contracts (pyproject.toml, tests/test_architecture.py) check the import statements; this checks
# what importing them actually loads, the root's lazily loaded Lightning names included.
LIBRARY_MODULES = (
    "syncbn_lightning",
    *(
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for layer in ("ops", "distributed", "functional", "nn")
        for path in sorted((ROOT / "syncbn_lightning" / layer).rglob("*.py"))
    ),
)


def _requirement_names(requirements: list[str]) -> set[str]:
    return {r.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip() for r in requirements}


@pytest.mark.slow
def test_library_imports_no_service_dependency() -> None:
    code = (
        "import sys\n"
        f"for name in {LIBRARY_MODULES!r}: __import__(name)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({SERVICE_DEPS!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_dependencies_are_split_into_library_and_extras() -> None:
    project = PYPROJECT["project"]
    assert _requirement_names(project["dependencies"]) == {"torch", "ninja"}
    extras = project["optional-dependencies"]
    assert _requirement_names(extras["lightning"]) == {"lightning"}
    app = _requirement_names(extras["app"])
    assert {"syncbn_lightning", "hydra-core", "omegaconf", "wandb", "pillow"} <= app
    assert "syncbn_lightning[lightning]" in extras["app"]


def test_the_torch_floor_is_pyproject_s() -> None:
    """The floor the import checks and the requirement pip resolves are one release."""
    from syncbn_lightning import _torch

    assert f"torch>={_torch.TORCH_FLOOR}" in PYPROJECT["project"]["dependencies"]
    assert _torch.release(_torch.FLOOR_RELEASE)[:2] == _torch.release(_torch.TORCH_FLOOR)


@pytest.mark.parametrize(
    ("version", "numbers"),
    [("2.4.1+cu121", (2, 4, 1)), ("2.10.0a0+git1234", (2, 10, 0)), ("2.4", (2, 4)), ("x", ())],
)
def test_torch_releases_compare_by_number(version: str, numbers: tuple[int, ...]) -> None:
    from syncbn_lightning import _torch

    assert _torch.release(version) == numbers


def test_the_floor_check_passes_at_and_above_the_floor_only() -> None:
    from syncbn_lightning import _torch

    for ok in (_torch.TORCH_FLOOR, "2.4.0", "2.10.1", "3.0.0"):
        _torch.check_torch(ok)
    with pytest.raises(ImportError, match=r"needs torch >= 2\.4, found torch 2\.3\.1"):
        _torch.check_torch("2.3.1")


@pytest.mark.parametrize("script", ["syncbn-train", "syncbn-report"])
def test_console_scripts_point_at_functions(script: str) -> None:
    module, _, function = PYPROJECT["project"]["scripts"][script].partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_every_library_package_is_packaged() -> None:
    """Each folder of the package with an ``__init__.py`` (``distributed/call_order/``,
    ``ops/reference/``, ...) is in pyproject's list: a wheel carries only the listed ones."""
    packages = set(PYPROJECT["tool"]["setuptools"]["packages"])
    folders = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "syncbn_lightning").rglob("__init__.py")
    }
    missing = folders - packages
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_every_config_group_is_packaged() -> None:
    packages = set(PYPROJECT["tool"]["setuptools"]["packages"])
    groups = {p.name for p in (ROOT / "conf").iterdir() if p.is_dir()}
    missing = {f"syncbn_lightning.conf.{g}" for g in groups} - packages
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def _see_this_interpreters_packages(venv: Path) -> None:
    """Let ``venv`` import what this interpreter imports: a ``.pth`` file adding the site folders
    on this interpreter's ``sys.path`` (and their own ``.pth`` files) after the venv's own.

    Not ``--system-site-packages``: when ``sys.executable`` is itself a virtualenv, that flag
    exposes the base interpreter's packages, not the ones this suite runs with.
    """
    (site_packages,) = venv.glob("lib/python*/site-packages")
    folders = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    (site_packages / "_syncbn_test_parent.pth").write_text(
        f"import site; list(map(site.addsitedir, {folders!r}))\n"
    )


@pytest.mark.slow
def test_installed_wheel_runs_the_service_outside_a_clone(tmp_path: Path) -> None:
    """Build the wheel, install it (no dependencies: they come from this interpreter's
    site-packages) into a new virtualenv, and run the console scripts from an empty folder."""
    # Built from a copy of what the wheel is made of: setuptools writes build/ into the source.
    source = tmp_path / "source"
    for part in ("syncbn_lightning", "csrc", "conf"):
        shutil.copytree(ROOT / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, source / part)
    wheels = tmp_path / "wheels"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"]
    subprocess.run(
        [*pip_wheel, "--no-build-isolation", "--wheel-dir", str(wheels), str(source)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (wheel,) = wheels.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    conf = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "conf").rglob("*.yaml"))
    assert {f"syncbn_lightning/{c}" for c in conf} <= set(names)
    assert not any(n.startswith(("conf/", "tests/", "train.py")) for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    _see_this_interpreters_packages(venv)
    bin_dir = venv / "bin"
    subprocess.run(
        [bin_dir / "pip", "install", "--quiet", "--no-deps", str(wheel)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in (*RENDEZVOUS_VARS, "PYTHONPATH")}
    env.update(WANDB_SILENT="true", PATH=f"{bin_dir}:{env['PATH']}")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(args), cwd=work, env=env, capture_output=True, text=True, timeout=400
        )

    where = run(
        str(bin_dir / "python"), "-c", "import syncbn_lightning; print(syncbn_lightning.__file__)"
    )
    assert str(venv) in where.stdout, where.stdout + where.stderr
    composed = run(str(bin_dir / "syncbn-train"), "--cfg", "job", "bn.group_size=2")
    assert composed.returncode == 0, composed.stderr
    assert "group_size: 2" in composed.stdout

    out = work / "job"
    job = run(
        str(bin_dir / "syncbn-train"),
        f"paths.output_dir={out}",
        f"paths.data_dir={work / 'data'}",
        "logger=csv",
        "data.synthetic.num_train=8",
        "data.synthetic.num_val=4",
        "data.synthetic.progress=false",
        "trainer.max_epochs=1",
        "trainer.check_val_every_n_epoch=1",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "bn.precise_bn_batches=0",
        # The reference kernels: the venv is another interpreter prefix, so the C++ extension
        # would be built again (~45 s) for nothing this test is about.
        "bn.implementation=ref",
        "launch.timeout_s=60",
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert (out / "results.json").is_file()
    report = run(str(bin_dir / "syncbn-report"), str(out))
    assert report.returncode == 0, report.stderr
    assert list((out / "report").glob("*.png"))
