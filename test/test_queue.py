"""The queue: import then export round-trips the series byte for byte."""

import shutil

from torchrl_fork import PATCHES_DIR
from torchrl_fork.base import PIN_FILE
from torchrl_fork.gitcmd import git
from torchrl_fork.queue import export_queue, import_queue
from torchrl_fork.series import read_series


def test_import_export_round_trip(tmp_path):
    patches = tmp_path / "patches"
    shutil.copytree(PATCHES_DIR, patches)
    pin_file = tmp_path / "base.json"
    shutil.copyfile(PIN_FILE, pin_file)
    repo = import_queue(tmp_path / "queue", patches)
    log = git("log", "--format=%s", "base..HEAD", cwd=repo).stdout.splitlines()
    assert len(log) == len(read_series(patches / "series"))
    assert all(subject.startswith("[") for subject in log), log

    names = export_queue(repo, patches, pin_file)
    assert names == read_series(patches / "series")
    for path in sorted(PATCHES_DIR.iterdir()):
        assert (patches / path.name).read_bytes() == path.read_bytes(), path.name
    assert pin_file.read_bytes() == PIN_FILE.read_bytes()

    # a second export of the unchanged queue changes no byte either
    export_queue(repo, patches, pin_file)
    for path in sorted(PATCHES_DIR.iterdir()):
        assert (patches / path.name).read_bytes() == path.read_bytes(), path.name
