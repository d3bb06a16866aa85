"""The queues: import then export round-trips each series byte for byte."""

import shutil

import pytest

from torchrl_fork.base import BASES_FILE, Pin
from torchrl_fork.gitcmd import git
from torchrl_fork.queue import export_queue, import_queue, SenderError
from torchrl_fork.series import patch_author, read_series, series_paths


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
    patches = tmp_path / "patches"
    shutil.copytree(pin.patches_dir, patches, ignore=shutil.ignore_patterns("main"))
    repo = import_queue(pin, tmp_path / "queue", patches)
    log = git("log", "--format=%s", "base..HEAD", cwd=repo).stdout.splitlines()
    assert len(log) == len(read_series(patches / "series"))
    assert all(subject.startswith("[") for subject in log), log

    for _ in range(2):  # a second export of the unchanged queue changes no byte
        names = export_queue(pin, repo, patches, draft=True)
        assert names == read_series(patches / "series")
        for path in sorted(pin.patches_dir.glob("*")):
            if path.is_file():
                assert (patches / path.name).read_bytes() == path.read_bytes()
        assert bases_file.read_bytes() == BASES_FILE.read_bytes()


def test_upstream_series_takes_the_sender_as_author(tmp_path, bases_file):
    pin = Pin.load("main")
    patches = tmp_path / "patches"
    repo = import_queue(pin, tmp_path / "queue", pin.patches_dir)
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
