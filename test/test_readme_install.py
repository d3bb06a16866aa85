"""The README's install lines, run exactly as written: from a git clone, and offline.

(The quick start's two commands are what ``.ci/run`` runs.) Each line runs in
bash, in a fresh virtual environment that sees this environment's packages
(torch, tensordict, setuptools) after its own, so that only torchrl is
installed into it.
"""

import site
import subprocess
import sys
from pathlib import Path

import pytest

from torchrl_fork import LOCAL_VERSION, ROOT
from torchrl_fork.base import Pin

README = (ROOT / "README.md").read_text()
PIN = Pin.load()
GIT_URL_LINE = 'pip install "torchrl @ git+file://localhost$PWD/torchrl-keepkeys@main"'
DOWNLOAD_LINE = (
    "pip download --only-binary=:all: -d wheels/ "
    "torchrl==0.14.1 torch==2.13.0 setuptools wheel==0.48.0"
)
DEPENDENCIES_LINE = (
    "pip install --no-index --find-links wheels/ torch==2.13.0 "
    '"tensordict>=0.14.3,<0.15" numpy packaging cloudpickle pyvers hoptorch '
    "setuptools wheel==0.48.0"
)
OFFLINE_LINE = (
    "TORCHRL_FORK_BASE_WHEEL=$(ls wheels/torchrl-0.14.1-*.whl) "
    "pip install --no-index --no-build-isolation ."
)
#: pip without any configuration (no index, no find-links) and no registry
OFFLINE_ENV = "export PIP_CONFIG_FILE=/dev/null PIP_INDEX_URL=http://127.0.0.1:9/; "


def _venv(path):
    """A venv that sees this environment's packages, except torchrl, after its own."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    bin_dir = path / "bin"
    # the venv's own, older setuptools would shadow this environment's
    subprocess.run(
        [bin_dir / "python", "-m", "pip", "uninstall", "-q", "-y", "setuptools"],
        check=True,
    )
    view = path / "outer"
    view.mkdir()
    for site_dir in map(Path, site.getsitepackages()):
        for entry in site_dir.iterdir():
            if (
                not entry.name.startswith("torchrl")
                and not (view / entry.name).exists()
            ):
                (view / entry.name).symlink_to(entry)
    (site_dir,) = path.glob("lib/python*/site-packages")
    (site_dir / "outer.pth").write_text(f"{view}\n")
    return bin_dir


def _run(line, cwd, bin_dir):
    """``line`` in bash, with the venv's ``pip`` and ``python`` first on PATH."""
    result = subprocess.run(
        ["bash", "-c", line],
        cwd=cwd,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(cwd)},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _installed(bin_dir, cwd):
    out = subprocess.run(
        [
            bin_dir / "python",
            "-c",
            "import importlib.metadata, torchrl; "
            "print(importlib.metadata.version('torchrl'), torchrl.__file__)",
        ],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return out[0], out[1]


def _clone(dest):
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(dest)], check=True)
    return dest


@pytest.mark.slow
def test_readme_git_url_install_from_a_clone(tmp_path):
    assert GIT_URL_LINE in README
    _clone(tmp_path / "torchrl-keepkeys")
    bin_dir = _venv(tmp_path / "venv")
    _run(GIT_URL_LINE, tmp_path, bin_dir)
    version, path = _installed(bin_dir, tmp_path)
    assert version == f"{PIN.version}+{LOCAL_VERSION}"
    assert path.startswith(str(tmp_path / "venv"))


def _bare_venv(path):
    """A venv with nothing but pip and the setuptools that ``venv`` brings."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin"


@pytest.fixture(scope="module")
def offline_clone(tmp_path_factory):
    """A clone holding the downloads of the README's offline section."""
    tmp_path = tmp_path_factory.mktemp("offline")
    clone = _clone(tmp_path / "torchrl-keepkeys")
    _run(DOWNLOAD_LINE, clone, _bare_venv(tmp_path / "download-venv"))
    return clone


@pytest.mark.slow
def test_readme_offline_install_from_a_wheel_at_hand(offline_clone, tmp_path):
    assert DOWNLOAD_LINE in README and DEPENDENCIES_LINE in README
    assert OFFLINE_LINE in README
    bin_dir = _bare_venv(tmp_path / "venv")
    # the registry is cut off from here on: pip may only read the files at hand
    _run(OFFLINE_ENV + DEPENDENCIES_LINE, offline_clone, bin_dir)
    _run(OFFLINE_ENV + OFFLINE_LINE, offline_clone, bin_dir)
    version, path = _installed(bin_dir, tmp_path)
    assert version == f"{PIN.version}+{LOCAL_VERSION}"
    assert path.startswith(str(tmp_path / "venv"))
    assert not (offline_clone / "build" / "cache").exists()


@pytest.mark.slow
def test_offline_install_names_a_missing_build_requirement(offline_clone, tmp_path):
    bin_dir = _bare_venv(tmp_path / "venv")
    without_wheel = DEPENDENCIES_LINE.replace(" wheel==0.48.0", "")
    _run(OFFLINE_ENV + without_wheel, offline_clone, bin_dir)
    result = subprocess.run(
        ["bash", "-c", OFFLINE_ENV + OFFLINE_LINE],
        cwd=offline_clone,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "building the fork needs wheel==0.48.0" in result.stdout + result.stderr
