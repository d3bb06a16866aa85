"""The wheel: upstream's wheel entry for entry, plus the series; offline builds too."""

import email
import os
import shutil
import site
import subprocess
import sys
import zipfile

import pytest

from torchrl_fork import LOCAL_VERSION, ROOT
from torchrl_fork.base import BASE_WHEEL_ENV, download_wheel, Pin
from torchrl_fork.build import build_wheel

PIN = Pin.load()
VERSION = f"{PIN.version}+{LOCAL_VERSION}"


@pytest.fixture(scope="module")
def upstream_wheel():
    return download_wheel(PIN.package, PIN.version)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return build_wheel(tmp_path_factory.mktemp("dist"))


def _files(path):
    """File entries by name, the version dropped from the ``.dist-info`` name.

    Directory entries, which upstream's wheel lists and ``wheel pack`` does
    not write, carry no content and are left out.
    """
    with zipfile.ZipFile(path) as archive:
        return {
            name.replace(f"-{VERSION}.dist-info/", f"-{PIN.version}.dist-info/"): (
                archive.read(name)
            )
            for name in archive.namelist()
            if not name.endswith("/")
        }


def test_wheel_is_upstream_plus_the_series(wheel, upstream_wheel):
    assert wheel.name == upstream_wheel.name.replace(
        f"-{PIN.version}-", f"-{VERSION}-", 1
    )
    ours, theirs = _files(wheel), _files(upstream_wheel)
    assert ours.keys() == theirs.keys()
    differ = {name for name in theirs if ours[name] != theirs[name]}
    dist_info = f"torchrl-{PIN.version}.dist-info"
    assert differ == {*PIN.files, f"{dist_info}/METADATA", f"{dist_info}/RECORD"}
    # the metadata differs in the version alone
    ours_meta = email.message_from_bytes(ours[f"{dist_info}/METADATA"])
    theirs_meta = email.message_from_bytes(theirs[f"{dist_info}/METADATA"])
    assert ours_meta["Version"] == VERSION and theirs_meta["Version"] == PIN.version
    del ours_meta["Version"], theirs_meta["Version"]
    assert ours_meta.items() == theirs_meta.items()
    assert ours_meta.get_payload() == theirs_meta.get_payload()


def test_wheel_carries_patched_sources(wheel):
    with zipfile.ZipFile(wheel) as archive:
        utils = archive.read("torchrl/objectives/utils.py").decode()
        advantages = archive.read("torchrl/objectives/value/advantages.py").decode()
    assert "class _KeepsNetworkOutputs" in utils
    assert "keep_keys: list[NestedKey] | None = None" in advantages


def _fresh_venv(path):
    """A venv whose own site-packages come first, then this environment's."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    (site_dir,) = path.glob("lib/python*/site-packages")
    (site_dir / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return path / "bin" / "python"


def _installed_fork(python, cwd):
    return subprocess.run(
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
        cwd=cwd,
    ).stdout.splitlines()


@pytest.mark.slow
def test_wheel_installs_in_fresh_venv(wheel, tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--force-reinstall",
        ]
        + [wheel],
        check=True,
    )
    version, path, kept = _installed_fork(python, tmp_path)
    assert version == VERSION
    assert path.startswith(str(tmp_path / "venv"))
    assert kept == "['feat']"


def _source_copy(dest):
    """This repository's files as git would clone them, without build/ or dist/."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.mark.slow
def test_pip_wheel_builds_the_same_distribution(wheel, tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path, ROOT],
        check=True,
    )
    (built,) = tmp_path.glob("torchrl-*.whl")
    assert built.name == wheel.name
    assert _files(built) == _files(wheel)


@pytest.mark.slow
def test_offline_build_from_a_wheel_at_hand(upstream_wheel, wheel, tmp_path):
    # no registry and no download cache: only the wheel the variable names
    source = _source_copy(tmp_path / "src")
    at_hand = shutil.copy(upstream_wheel, tmp_path / upstream_wheel.name)
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", BASE_WHEEL_ENV: str(at_hand)}
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps"]
        + ["--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    (built,) = (tmp_path / "dist").glob("*.whl")
    assert _files(built).keys() == _files(wheel).keys()
    assert not (source / "build" / "cache").exists()

    # a tampered wheel at hand is refused before anything is built
    with zipfile.ZipFile(at_hand, "a") as archive:
        archive.writestr("torchrl/extra.py", "")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps"]
        + ["--no-build-isolation", "-w", str(tmp_path / "dist2"), str(source)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert f"{upstream_wheel.name}: sha256" in result.stdout + result.stderr
    assert not list((tmp_path / "dist2").glob("*.whl"))
