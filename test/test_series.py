"""`check` passes on the real series and fails loudly, naming the patch, on each fault."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from torchrl_fork.base import Pin
from torchrl_fork.check import check_series
from torchrl_fork.series import (
    apply_part,
    header_problems,
    patch_paths,
    placeholder_reason,
    read_series,
    series_paths,
    upstream_paths,
)

PIN = Pin.load()


@pytest.fixture
def patches(tmp_path):
    dest = tmp_path / "patches"
    shutil.copytree(PIN.patches_dir, dest, ignore=shutil.ignore_patterns("main"))
    return dest


def _first_patch(patches):
    return patches / read_series(patches / "series")[0]


def _edit(path, old, new, count=1):
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, count))


@pytest.mark.parametrize("base", Pin.names())
def test_series_is_not_empty(base):
    names = read_series(Pin.load(base).patches_dir / "series")
    assert names
    for name in names:
        assert re.fullmatch(r"\d{4}-[\w.-]+\.patch", name), name


@pytest.mark.parametrize("base", Pin.names())
def test_real_series_checks_clean(base):
    pin = Pin.load(base)
    assert check_series(pin, queue=pin.queue_dir) == []


def _subject(patch):
    # without the "[k/n]" counter, which counts main-only commits too
    subject = re.search(r"^Subject: (.*)", patch.read_text(), re.M).group(1)
    return re.sub(r" \[\d+/\d+\]", "", subject)


def _main_only(patch):
    # a commit for losses that the fork's base does not have: it changes no
    # file of torchrl that the fork's series changes
    torchrl_files = [p for p in patch_paths(patch) if p.startswith("torchrl/")]
    return bool(torchrl_files) and not set(torchrl_files) & set(PIN.files)


def _paired_patches():
    fork = series_paths(PIN.patches_dir)
    main = series_paths(Pin.load("main").patches_dir)
    return fork, [patch for patch in main if not _main_only(patch)], main


def test_upstream_series_carries_the_fork_series():
    # the same changes, in the same order, under the same subjects; main adds
    # commits only for losses that the fork's base lacks
    fork, paired, main = _paired_patches()
    assert [_subject(p) for p in paired] == [_subject(p) for p in fork]
    for patch in set(main) - set(paired):
        assert "[Feature] [keep_keys] Keep network outputs in" in _subject(patch)


def _changed_lines(patch):
    return [
        line
        for line in patch.read_text().split("\n---\n", 1)[1].splitlines()
        if line[:1] in "+-" and not line.startswith(("+++ ", "--- "))
    ]


def test_upstream_series_makes_the_same_changes():
    # the bases differ around the patched lines, never in what a patch adds or removes
    fork, paired, _ = _paired_patches()
    for fork_patch, main_patch in zip(fork, paired):
        assert _changed_lines(main_patch) == _changed_lines(fork_patch), fork_patch.name


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
    assert check_series(PIN, patches)
    assert list(scratch.iterdir()) == []


def test_broken_hunk_names_patch_and_hunk(patches):
    patch = _first_patch(patches)
    _corrupt_context_line(patch)
    problems = check_series(PIN, patches)
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
    problems = check_series(PIN, patches)
    assert any(p.startswith(patch.name) and "differs in hunk" in p for p in problems)


@pytest.mark.parametrize("trailer", ["Bug", "Forwarded", "Last-Update"])
def test_dep3_trailer_is_reported(patches, trailer):
    patch = _first_patch(patches)
    _edit(patch, "\n---\n", f"\n{trailer}: not-needed\n---\n")
    assert f"{patch.name}: carries the DEP-3 trailer '{trailer}:'" in header_problems(
        patch
    )
    assert any(patch.name in p for p in check_series(PIN, patches))


@pytest.mark.parametrize(
    "identity,placeholder",
    [
        ("Jane Doe <jane.doe@pytorch.org>", False),
        ("Jane Doe <jane@users.noreply.github.com>", False),
        ("Jane Doe <jane@example.com>", True),
        ("Seed maintainers <maintainers@users.noreply.a-seed.example>", True),
        ("Jane Doe <jane@host.invalid>", True),
        ("Jane Doe <jane@localhost>", True),
        ("<jane.doe@pytorch.org>", True),
        ("Jane Doe", True),
    ],
)
def test_placeholder_identities(identity, placeholder):
    assert (placeholder_reason(identity) is not None) == placeholder


def test_check_send_requires_a_real_upstream_author(tmp_path):
    main = Pin.load("main")
    patches = tmp_path / "patches"
    shutil.copytree(main.patches_dir, patches)
    patch = patches / read_series(patches / "series")[0]
    text = patch.read_text()
    author = re.search(r"^From: .*(?:\n .*)*", text, re.M).group(0)
    patch.write_text(text.replace(author, "From: Jane Doe <jane@example.com>", 1))
    problems = check_series(main, patches, sending=True)
    assert f"{patch.name}: not ready to send: jane@example.com is a placeholder" in (
        " ".join(problems)
    )


def test_bad_subject_is_reported(patches):
    patch = _first_patch(patches)
    _edit(patch, "Subject: [PATCH] [BugFix] ", "Subject: [PATCH] ")
    assert any("subject" in p for p in header_problems(patch))


def test_unlisted_and_missing_patches_are_reported(patches):
    (patches / "9999-stray.patch").write_text("stray")
    (patches / "series").write_text(
        (patches / "series").read_text() + "9998-missing.patch\n"
    )
    problems = check_series(PIN, patches)
    assert "9999-stray.patch: not listed in series" in problems
    assert "9998-missing.patch: listed in series but missing" in problems


def test_unpinned_file_is_reported(patches):
    touched = min(p for p in upstream_paths([_first_patch(patches)]) if "torchrl/" in p)
    files = {k: v for k, v in PIN.files.items() if k != touched}
    problems = check_series(PIN.replace(files=files), patches)
    assert any(f"touches {touched}, which the pin lacks" in p for p in problems)


def test_apply_part_inside_a_repository(tmp_path, monkeypatch):
    # the build applies into a relative folder of a checkout: git must apply
    # there, not relative to the checkout's root (which skips every file)
    repo = tmp_path / "checkout"
    repo.mkdir()
    subprocess.run(["git", "init", "--quiet"], cwd=repo, check=True)
    monkeypatch.chdir(repo)
    patches = series_paths(Pin.load("main").patches_dir)
    created = "test/objectives/test_keep_keys.py"  # a file the main series creates
    first = next(p for p in patches if created in patch_paths(p))
    dest = Path("build") / "tree"
    dest.mkdir(parents=True)
    apply_part(first, dest, created)
    assert (dest / created).is_file()
