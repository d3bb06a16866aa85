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
DOWNLOAD_LINE = "pip download --no-deps --only-binary=:all: torchrl==0.14.1 -d wheels/"
OFFLINE_LINE = (
    "TORCHRL_FORK_BASE_WHEEL=$(ls wheels/torchrl-0.14.1-*.whl) "
    "pip install --no-index --no-build-isolation ."
)


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


@pytest.mark.slow
def test_readme_offline_install_from_a_wheel_at_hand(tmp_path):
    assert DOWNLOAD_LINE in README and OFFLINE_LINE in README
    clone = _clone(tmp_path / "torchrl-keepkeys")
    bin_dir = _venv(tmp_path / "venv")
    _run(DOWNLOAD_LINE, clone, bin_dir)
    # the registry is cut off from here on: pip may only read the wheel at hand
    _run(
        f"export PIP_INDEX_URL=http://127.0.0.1:9/ PIP_FIND_LINKS=; {OFFLINE_LINE}",
        clone,
        bin_dir,
    )
    version, path = _installed(bin_dir, tmp_path)
    assert version == f"{PIN.version}+{LOCAL_VERSION}"
    assert path.startswith(str(tmp_path / "venv"))
    assert not (clone / "build" / "cache").exists()
