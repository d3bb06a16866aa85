"""`check` passes on the real series and fails loudly, naming the patch, on each fault."""

import re
import shutil

import pytest

from torchrl_fork import PATCHES_DIR, QUEUE_DIR
from torchrl_fork.check import check_series
from torchrl_fork.series import header_problems, read_series, upstream_paths


@pytest.fixture
def patches(tmp_path):
    dest = tmp_path / "patches"
    shutil.copytree(PATCHES_DIR, dest)
    return dest


def _first_patch(patches):
    return patches / read_series(patches / "series")[0]


def _edit(path, old, new, count=1):
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, count))


def test_series_is_not_empty():
    names = read_series()
    assert names
    for name in names:
        assert re.fullmatch(r"\d{4}-[\w.-]+\.patch", name), name


def test_real_series_checks_clean():
    queue = QUEUE_DIR if (QUEUE_DIR / ".git").exists() else None
    assert check_series(queue=queue) == []


def _corrupt_context_line(patch):
    """Change one context line of the first hunk on an upstream file."""
    text = patch.read_text()
    block = text.split("\ndiff --git a/torchrl/", 1)[1]
    context = next(
        line
        for line in block[block.index("\n@@") :].splitlines()[1:]
        if line.startswith(" ") and line.strip()
    )
    _edit(patch, "\n" + context + "\n", "\n" + context + "  # drift\n")


def test_check_leaves_no_tree_behind(patches, tmp_path, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr("tempfile.tempdir", None)
    _corrupt_context_line(_first_patch(patches))
    assert check_series(patches, queue=None)
    assert list(scratch.iterdir()) == []


def test_broken_hunk_names_patch_and_hunk(patches):
    patch = _first_patch(patches)
    _corrupt_context_line(patch)
    problems = check_series(patches, queue=None)
    assert len(problems) == 1
    assert problems[0].startswith(f"{patch.name} does not apply: hunk at torchrl/")


def test_offset_patch_is_reported(patches):
    # shifting a hunk header makes git apply at an offset: check must refuse it
    patch = _first_patch(patches)
    text = patch.read_text()
    block_at = text.index("\ndiff --git a/torchrl/")
    header = re.compile(r"@@ -(\d+),(\d+) \+(\d+),(\d+) @@")
    match = header.search(text, block_at)
    start, length, new_start, new_length = map(int, match.groups())
    shifted = f"@@ -{start + 3},{length} +{new_start + 3},{new_length} @@"
    patch.write_text(text[: match.start()] + shifted + text[match.end() :])
    problems = check_series(patches, queue=None)
    assert any(p.startswith(patch.name) and "differs in hunk" in p for p in problems)


@pytest.mark.parametrize("trailer", ["Bug", "Forwarded", "Last-Update"])
def test_missing_trailer_is_reported(patches, trailer):
    patch = _first_patch(patches)
    text = patch.read_text()
    patch.write_text(re.sub(rf"^{trailer}: .*\n", "", text, count=1, flags=re.M))
    assert f"{patch.name}: missing the '{trailer}:' trailer" in header_problems(patch)
    assert any(patch.name in p for p in check_series(patches, queue=None))


def test_bad_subject_is_reported(patches):
    patch = _first_patch(patches)
    _edit(patch, "Subject: [PATCH] [Feature] ", "Subject: [PATCH] ")
    assert any("subject" in p for p in header_problems(patch))


def test_unlisted_and_missing_patches_are_reported(patches):
    (patches / "9999-stray.patch").write_text("stray")
    (patches / "series").write_text(
        (patches / "series").read_text() + "9998-missing.patch\n"
    )
    problems = check_series(patches, queue=None)
    assert "9999-stray.patch: not listed in series" in problems
    assert "9998-missing.patch: listed in series but missing" in problems


def test_unpinned_file_is_reported(patches):
    from torchrl_fork.base import Pin

    pin = Pin.load()
    touched = next(iter(upstream_paths([_first_patch(patches)])))
    files = {k: v for k, v in pin.files.items() if k != touched}
    problems = check_series(
        patches, queue=None, pin=Pin(pin.package, pin.version, pin.git_tag, files)
    )
    assert any(f"touches {touched}, which the pin lacks" in p for p in problems)
