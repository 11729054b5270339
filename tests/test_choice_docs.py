"""Layer 7: "Choosing a normalization" states what the experiment's results file holds, and
``target_norm_batch``'s default is the one the page states (the published ImageNet curve, not the
experiment's knee), everywhere the library, the service and the docs name it.

The results file (``docs/small_batch/results.json``) is written by ``python -m
experiments.small_batch``; the page (``docs/choosing-normalization.md``) and
``docs/small-batch.md`` quote it. These tests read both, so neither can drift from the other.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import yaml

from experiments.small_batch.choice import KNEE_SIGMAS, KNEE_TOLERANCE, choice_table, knee
from syncbn_lightning import SyncBNCallback
from syncbn_lightning.distributed.group_sizes import (
    DEFAULT_TARGET_NORM_BATCH,
    norm_batch_verdict,
    resolve_group_size,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = json.loads((ROOT / "docs" / "small_batch" / "results.json").read_text())
PAGE = (ROOT / "docs" / "choosing-normalization.md").read_text()
SMALL_BATCH = (ROOT / "docs" / "small-batch.md").read_text()
COST = (ROOT / "docs" / "small_batch" / "cost.md").read_text()
TABLE = re.compile(r"<!-- choice-table -->\n(.*?)\n<!-- /choice-table -->", re.S)


def test_page_is_in_the_site_navigation() -> None:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("\nnot_in_nav:")[0])["nav"]
    pages = json.dumps(nav)
    assert '"Choosing a normalization": "choosing-normalization.md"' in pages


def test_results_hold_every_variant_the_issue_asks_for_with_three_seeds() -> None:
    variants = RESULTS["variants"]
    for name in ("gn", "pre_frozen", "pre_syncbn", "pre_local_bn", "syncbn_b8", "group2_b8"):
        assert [j["seed"] for j in variants[name]["jobs"]] == [0, 1, 2], name
    sweep = {v["norm_batch"] for v in variants.values() if v["family"] in ("batchnorm", "sweep")}
    assert {2, 4, 8, 16, 32} <= sweep
    assert [p["seed"] for p in RESULTS["pretrain"]] == [0, 1, 2]


def test_page_table_is_the_results_files() -> None:
    (block,) = TABLE.findall(PAGE)
    assert block == choice_table(RESULTS["choice"])


def test_every_mean_and_std_the_pages_quote_is_in_the_results_file() -> None:
    mean_std = re.compile(r"\d+\.\d ± \d+\.\d")
    choice = {row["mAP"] for row in RESULTS["choice"]}
    # The results file's report also holds mAP50, the other evaluations and accumulation's family.
    report = choice | set(
        mean_std.findall((ROOT / "docs" / "small_batch" / "results.md").read_text())
    )
    accumulation = (ROOT / "docs" / "gradient-accumulation.md").read_text()
    for name, text, cells in (
        ("choosing-normalization.md", PAGE, choice),
        ("small-batch.md", SMALL_BATCH, report),
        ("gradient-accumulation.md", accumulation, report),
    ):
        quoted = set(mean_std.findall(text))
        assert quoted and quoted <= cells, (name, sorted(quoted - cells))


def test_every_wall_time_the_page_quotes_is_measured() -> None:
    walls = {f"{row['wall_s']} s" for row in RESULTS["choice"]}
    for quoted in re.findall(r"\b\d+ s\b", TABLE.findall(PAGE)[0]):
        assert quoted in walls


def test_the_pages_cost_profile_is_the_profile_run() -> None:
    profile = [line for line in COST.splitlines() if re.match(r"\| \w+ \| \d", line)]
    assert len(profile) >= 2
    assert all(row in PAGE for row in profile)


def test_knee_follows_the_documented_rule_from_the_means() -> None:
    entry = RESULTS["knee"]
    points = {
        int(b): {int(n): tuple(p) for n, p in per.items()} for b, per in entry["points"].items()
    }
    assert (entry["tolerance_points"], entry["sigmas"]) == (KNEE_TOLERANCE, KNEE_SIGMAS)
    assert knee(points) == entry["norm_batch"]
    assert f"knee: **{entry['norm_batch']}**" in PAGE.lower()


def test_target_norm_batch_default_is_the_pages_and_the_same_everywhere() -> None:
    match = re.search(r"The default is \*\*(\d+)\*\*", PAGE)
    assert match, "the page states the default in bold"
    found = int(match.group(1))
    assert found == 16 and f"## The default: {found} images per normalization" in PAGE
    assert DEFAULT_TARGET_NORM_BATCH == found != RESULTS["knee"]["norm_batch"]
    assert SyncBNCallback().target_norm_batch == found
    for fn in (resolve_group_size, norm_batch_verdict):
        assert (
            inspect.signature(fn)
            .parameters["target_norm_batch" if fn is resolve_group_size else "target"]
            .default
            == found
        )
    sync = yaml.safe_load((ROOT / "conf" / "bn" / "sync.yaml").read_text())
    assert sync["target_norm_batch"] == found
    # The cited curve: BatchNorm at the default within 0.1 point of twice it.
    assert "| BatchNorm top-1 error (%) | 23.6 | 23.7 | 24.8 | 27.3 | 34.7 |" in PAGE
    # With 2 images per device, `auto` picks the smallest group that reaches it.
    assert resolve_group_size("auto", 16, 16, per_rank_batch=2) == 8


def test_every_place_that_names_the_default_names_the_same_number() -> None:
    """README, the Lightning guide, the dashboards page and the bn config say 16, nowhere the old
    4 as the default."""
    texts = {
        "README.md": (ROOT / "README.md").read_text(),
        "docs/lightning.md": (ROOT / "docs" / "lightning.md").read_text(),
        "docs/dashboards.md": (ROOT / "docs" / "dashboards.md").read_text(),
        "conf/bn/sync.yaml": (ROOT / "conf" / "bn" / "sync.yaml").read_text(),
    }
    for name, text in texts.items():
        # The default next to its name (a bare "16" would also match "bf16" or "2016").
        assert re.search(r"target_norm_batch[`\s:|(,]*(?:default\s+)?`?16\b", text), name
        assert not re.search(r"default[^.\n]{0,40}\b4\b", text), name
