"""The series' tests in upstream's own test files pass against the installed fork.

The bug fixes of the series add their tests to upstream's test files
(``test_values.py``, ``test_dqn.py``, ``test_cql.py``), which need the rest of
upstream's test tree: it is read at the pinned pytorch/rl commit from
``$TORCHRL_FORK_RL_GIT``, and the test is skipped without one.
"""

import io
import os
import re
import subprocess
import sys
import tarfile

import pytest

from torchrl_fork.base import Pin, RL_GIT_ENV
from torchrl_fork.series import apply_part, patch_paths, series_paths

ADDED_TEST = re.compile(r"^\+    def (test_\w+)\(", re.MULTILINE)


@pytest.mark.skipif(
    not os.environ.get(RL_GIT_ENV), reason=f"needs {RL_GIT_ENV} (upstream's tests)"
)
def test_series_tests_in_upstream_files(tmp_path):
    pin = Pin.load()
    archive = subprocess.run(
        ["git", "--git-dir", os.environ[RL_GIT_ENV], "archive"]
        + [pin.repo_files["commit"], "test"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp_path, filter="data")
    upstream_tests = [p for p in pin.repo_files["files"] if p.startswith("test/")]
    names = []
    for patch in series_paths(pin.patches_dir):
        for path in sorted(patch_paths(patch) & set(upstream_tests)):
            apply_part(patch, tmp_path, path)
        if patch_paths(patch) & set(upstream_tests):
            names += ADDED_TEST.findall(patch.read_text())
    assert names
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + [*upstream_tests, "-k", " or ".join(names)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    passed = int(re.search(r"(\d+) passed", result.stdout).group(1))
    assert passed >= len(names), result.stdout[-3000:]
