"""The series' tests in upstream's own test files pass against the installed fork.

The series adds its tests to upstream's test classes (``TestKeepKeys`` in
``test_values.py`` and ``test_loss_module.py``, a ``test_<loss>_keep_keys`` in
each ``Test<Loss>`` class, the bug fixes' tests), which need the rest of
upstream's test tree: it is read at the pinned pytorch/rl commit from
``$TORCHRL_FORK_RL_GIT``, and the test is skipped without one. Only the tests
that the series adds run, by node id.
"""

import ast
import io
import os
import re
import subprocess
import sys
import tarfile

import pytest

from torchrl_fork.base import Pin, RL_GIT_ENV
from torchrl_fork.series import apply_part, patch_paths, series_paths, upstream_paths

ADDED_TEST = re.compile(r"^\+ *def (test_\w+)\(", re.MULTILINE)


def added_test_ids(root, path, names):
    """The node ids of the tests called ``names`` in the file ``path`` under ``root``."""
    ids = []
    for node in ast.parse((root / path).read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            ids.append(f"{path}::{node.name}")
        for item in node.body if isinstance(node, ast.ClassDef) else ():
            if isinstance(item, ast.FunctionDef) and item.name in names:
                ids.append(f"{path}::{node.name}::{item.name}")
    return ids


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
    patches = series_paths(pin.patches_dir)
    upstream_tests = [p for p in upstream_paths(patches) if p.startswith("test/")]
    names = set()
    for patch in patches:
        for path in sorted(patch_paths(patch) & set(upstream_tests)):
            apply_part(patch, tmp_path, path)
        names.update(ADDED_TEST.findall(patch.read_text()))
    ids = [i for path in upstream_tests for i in added_test_ids(tmp_path, path, names)]
    missing = names - {i.rsplit("::", 1)[1] for i in ids}
    assert len(names) > 20 and not missing, f"added tests not found: {sorted(missing)}"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    passed = int(re.search(r"(\d+) passed", result.stdout).group(1))
    assert passed >= len(names), result.stdout[-3000:]
