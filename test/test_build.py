"""The wheel: local version, patched sources, installable into a fresh environment."""

import site
import subprocess
import sys
import zipfile

import pytest

from torchrl_fork import LOCAL_VERSION, ROOT
from torchrl_fork.base import Pin
from torchrl_fork.build import build_wheel

VERSION = f"{Pin.load().version}+{LOCAL_VERSION}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return build_wheel(tmp_path_factory.mktemp("dist"))


def test_wheel_name_and_metadata(wheel):
    assert wheel.name.startswith(f"torchrl-{VERSION}-")
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"torchrl-{VERSION}.dist-info/METADATA").decode()
        top_level = archive.read(f"torchrl-{VERSION}.dist-info/top_level.txt")
        names = archive.namelist()
    assert f"\nVersion: {VERSION}\n" in metadata
    assert "Requires-Dist: tensordict<0.15.0,>=0.14.3" in metadata
    assert top_level == b"torchrl\n"
    assert {name.split("/")[0] for name in names} == {
        "torchrl",
        f"torchrl-{VERSION}.dist-info",
    }
    assert any(name.startswith("torchrl/_torchrl") for name in names)


def test_wheel_carries_patched_sources(wheel):
    with zipfile.ZipFile(wheel) as archive:
        utils = archive.read("torchrl/objectives/utils.py").decode()
        advantages = archive.read("torchrl/objectives/value/advantages.py").decode()
    assert "class _KeptOutputs" in utils
    assert "keep_keys: tuple[NestedKey, ...] | bool = ()" in advantages


@pytest.mark.slow
def test_wheel_installs_in_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel],
        check=True,
    )
    # torch and tensordict come from this environment, after the venv's own
    # site-packages, so that torchrl is the one installed from the wheel
    (site_dir,) = venv.glob("lib/python*/site-packages")
    (site_dir / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    out = subprocess.run(
        [
            python,
            "-c",
            "import importlib.metadata, torchrl, torchrl.objectives.utils as u;"
            "print(importlib.metadata.version('torchrl'));"
            "print(torchrl.__file__);"
            "print(u._normalize_keep_keys('feat'))",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout.splitlines()
    assert out[0] == VERSION
    assert out[1].startswith(str(venv))
    assert out[2] == "('feat',)"


@pytest.mark.slow
def test_pip_wheel_builds_the_same_distribution(wheel, tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "-w",
            tmp_path,
            ROOT,
        ],
        check=True,
    )
    (built,) = tmp_path.glob("torchrl-*.whl")
    assert built.name == wheel.name
    with zipfile.ZipFile(built) as a, zipfile.ZipFile(wheel) as b:
        assert sorted(a.namelist()) == sorted(b.namelist())
        for name in a.namelist():
            if not name.endswith("RECORD"):
                assert a.read(name) == b.read(name), name
