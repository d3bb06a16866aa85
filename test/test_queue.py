"""The queues: import then export round-trips each series byte for byte.

The series patches upstream's docs and test files, which only a pytorch/rl
git directory holds (``$TORCHRL_FORK_RL_GIT``): without one, the round trips
are skipped.
"""

import os
import shutil

import pytest

from torchrl_fork.base import BASES_FILE, Pin, RL_GIT_ENV
from torchrl_fork.gitcmd import git
from torchrl_fork.queue import export_queue, import_queue, SenderError
from torchrl_fork.series import is_docs_patch, patch_author, read_series, series_paths


def _series_at_hand(pin, dest):
    """A copy of the series in ``dest``; skips without upstream's docs and tests at hand."""
    if not os.environ.get(RL_GIT_ENV):
        pytest.skip(
            f"the series patches upstream's docs and tests, which {RL_GIT_ENV} "
            "(a pytorch/rl git directory) holds"
        )
    shutil.copytree(pin.patches_dir, dest, ignore=shutil.ignore_patterns("main"))
    return dest


@pytest.fixture
def bases_file(tmp_path, monkeypatch):
    copy = tmp_path / "bases.json"
    shutil.copyfile(BASES_FILE, copy)
    monkeypatch.setattr("torchrl_fork.base.BASES_FILE", copy)
    monkeypatch.setattr(Pin.save, "__defaults__", (copy,))
    return copy


@pytest.mark.parametrize("base", Pin.names())
def test_import_export_round_trip(base, tmp_path, bases_file):
    pin = Pin.load(base)
    patches = _series_at_hand(pin, tmp_path / "patches")
    imported = {path.name: path.read_bytes() for path in patches.iterdir()}
    repo = import_queue(pin, tmp_path / "queue", patches)
    log = git("log", "--format=%s", "base..HEAD", cwd=repo).stdout.splitlines()
    assert len(log) == len(read_series(patches / "series"))
    assert all(subject.startswith("[") for subject in log), log

    for _ in range(2):  # a second export of the unchanged queue changes no byte
        names = export_queue(pin, repo, patches, draft=True)
        assert names == read_series(patches / "series")
        assert {path.name: path.read_bytes() for path in patches.iterdir()} == imported
        assert bases_file.read_bytes() == BASES_FILE.read_bytes()


def test_upstream_series_takes_the_sender_as_author(tmp_path, bases_file):
    pin = Pin.load("main")
    series = _series_at_hand(pin, tmp_path / "series")
    patches = tmp_path / "patches"
    repo = import_queue(pin, tmp_path / "queue", series)
    with pytest.raises(SenderError, match="placeholder address"):
        export_queue(pin, repo, patches, author="Jane Doe <jane@example.com>")
    assert not patches.exists()
    with pytest.raises(SenderError, match="not of the form"):
        export_queue(pin, repo, patches, author="jane")
    export_queue(pin, repo, patches, author="Jane Doe <jane.doe@pytorch.org>")
    for patch in series_paths(patches):
        assert patch_author(patch) == "Jane Doe <jane.doe@pytorch.org>"
        # the author changes, not the dates: a re-export is byte-stable
        ours = patch.read_text().split("\nSubject: ", 1)[1]
        theirs = (pin.patches_dir / patch.name).read_text().split("\nSubject: ", 1)[1]
        assert ours == theirs
    before = {p.name: p.read_bytes() for p in patches.iterdir()}
    export_queue(pin, repo, patches, author="Jane Doe <jane.doe@pytorch.org>")
    assert before == {p.name: p.read_bytes() for p in patches.iterdir()}


def test_import_needs_upstream_docs_and_tests(tmp_path, monkeypatch):
    monkeypatch.delenv(RL_GIT_ENV, raising=False)
    pin = Pin.load()
    (docs_patch,) = [p.name for p in series_paths(pin.patches_dir) if is_docs_patch(p)]
    with pytest.raises(RuntimeError, match=f"{docs_patch} change upstream files"):
        import_queue(pin, tmp_path / "queue")
    assert not (tmp_path / "queue").exists()
