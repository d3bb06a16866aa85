"""`rebase` reports each patch as applying, conflicting or already upstream."""

import shutil

import pytest

from torchrl_fork.base import Pin
from torchrl_fork.build import build_wheel
from torchrl_fork.rebase import APPLIES, CONFLICTS, NOT_TRIED, rebase_series, UPSTREAM
from torchrl_fork.series import is_docs_patch, read_series

PIN = Pin.load()
VERSION = PIN.version
PATCHES_DIR = PIN.patches_dir
SERIES = read_series(PATCHES_DIR / "series")
#: the documentation patch is not tried: release wheels carry no docs
DOCS = [name for name in SERIES if is_docs_patch(PATCHES_DIR / name)]
CODE = [name for name in SERIES if name not in DOCS]


def _statuses(outcomes):
    statuses = {o.patch: o.status for o in outcomes}
    assert [statuses.pop(name) for name in DOCS] == [NOT_TRIED] * len(DOCS)
    return [statuses[name] for name in CODE]


def test_rebase_onto_the_base_applies_everything(tmp_path):
    outcomes = rebase_series(VERSION, repo=tmp_path / "repo")
    assert [o.patch for o in outcomes] == SERIES
    assert set(_statuses(outcomes)) == {APPLIES}


def test_rebase_onto_a_release_that_has_the_series(tmp_path, monkeypatch):
    # a "release" that already contains the series: our own patched wheel
    patched = build_wheel(tmp_path / "dist")
    monkeypatch.setattr("torchrl_fork.rebase.download_wheel", lambda *a, **k: patched)
    outcomes = rebase_series(VERSION, repo=tmp_path / "repo")
    assert set(_statuses(outcomes)) == {UPSTREAM}


def test_rebase_reports_conflicting_hunk(tmp_path):
    patches = tmp_path / "patches"
    shutil.copytree(PATCHES_DIR, patches, ignore=shutil.ignore_patterns("main"))
    first = patches / SERIES[0]
    text = first.read_text()
    marker = "\n@@ "
    hunk = text.index(marker, text.index("diff --git a/torchrl/"))
    line_start = text.index("\n ", hunk + 1) + 1
    line_end = text.index("\n", line_start)
    first.write_text(text[:line_start] + " CONFLICT" + text[line_end:])
    outcomes = rebase_series(VERSION, patches_dir=patches, repo=tmp_path / "repo")
    assert outcomes[0].status == CONFLICTS
    assert outcomes[0].detail.startswith("hunk at torchrl/")
    assert str(outcomes[0]).startswith(f"{first.name}: conflicts (hunk at torchrl/")


def test_rebase_onto_a_release_that_merged_part_of_the_series(tmp_path, monkeypatch):
    # upstream released the first three patches: they are found, the rest applies
    names = SERIES
    partial = tmp_path / "partial"
    shutil.copytree(PATCHES_DIR, partial, ignore=shutil.ignore_patterns("main"))
    (partial / "series").write_text("\n".join(names[:3]) + "\n")
    released = build_wheel(tmp_path / "dist", patches_dir=partial)
    monkeypatch.setattr("torchrl_fork.rebase.download_wheel", lambda *a, **k: released)
    outcomes = rebase_series(VERSION, repo=tmp_path / "repo")
    assert _statuses(outcomes) == [UPSTREAM] * 3 + [APPLIES] * (len(CODE) - 3)


@pytest.mark.slow
def test_rebase_onto_the_nightly_reports_each_patch(tmp_path):
    # torchrl-nightly's wheels are named torchrl_nightly-...: found all the same
    outcomes = rebase_series(
        Pin.load("main").version, package="torchrl-nightly", repo=tmp_path / "repo"
    )
    assert [o.patch for o in outcomes] == SERIES
    assert set(_statuses(outcomes)) <= {APPLIES, CONFLICTS, UPSTREAM}
