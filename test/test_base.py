"""The pinned bases: a wheel or file that is not the pinned one is refused first."""

import hashlib
import os
import shutil
import subprocess
import zipfile

import pytest

from torchrl_fork import build as build_module, queue as queue_module
from torchrl_fork.base import (
    _compatible_wheel,
    base_wheel,
    BASE_WHEEL_ENV,
    BaseMismatch,
    download_wheel,
    extract_sources,
    Pin,
    repo_sources,
    RL_GIT_ENV,
    sha256,
    verified_wheel,
    verify_tree,
    verify_wheel,
)


@pytest.fixture(scope="module")
def upstream_wheel():
    pin = Pin.load()
    return download_wheel(pin.package, pin.version)


@pytest.fixture
def tampered_wheel(upstream_wheel, tmp_path):
    """A copy of the upstream wheel with one pinned file changed by one byte."""
    target = sorted(Pin.load().files)[0]
    tampered = tmp_path / upstream_wheel.name
    with zipfile.ZipFile(upstream_wheel) as src, zipfile.ZipFile(tampered, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename == target:
                data += b"\n"
            dst.writestr(item, data)
    return tampered, target


def test_bases_name_their_builds():
    assert Pin.names() == ["fork", "main"]
    fork, main = Pin.load("fork"), Pin.load("main")
    assert (fork.package, fork.version) == ("torchrl", "0.14.1")
    assert (main.package, main.version) == ("torchrl-nightly", "2026.10.27")
    for pin in (fork, main):
        assert pin.files, "the pin must cover the files the series touches"
        # one wheel per supported interpreter and platform
        assert len(pin.wheels) == len(pin.python_versions) * len(pin.platforms)


def test_pristine_wheel_verifies(upstream_wheel):
    verify_wheel(upstream_wheel, Pin.load())


def test_tampered_wheel_refused_naming_both_hashes(tampered_wheel):
    wheel, _ = tampered_wheel
    pin = Pin.load()
    with pytest.raises(BaseMismatch) as info:
        verify_wheel(wheel, pin)
    message = str(info.value)
    assert message.startswith(wheel.name)
    assert sha256(wheel) in message and pin.wheels[wheel.name] in message


def test_tampered_file_refused_by_name(tampered_wheel):
    # even a wheel whose own hash were pinned is checked file by file
    wheel, target = tampered_wheel
    pin = Pin.load()
    pin = pin.replace(wheels={**pin.wheels, wheel.name: sha256(wheel)})
    with pytest.raises(BaseMismatch, match=target):
        verify_wheel(wheel, pin)


def test_unpinned_wheel_refused(upstream_wheel, tmp_path):
    other = tmp_path / upstream_wheel.name.replace("manylinux", "otherlinux")
    shutil.copyfile(upstream_wheel, other)
    with pytest.raises(BaseMismatch, match="no sha256 is pinned for this wheel"):
        verify_wheel(other, Pin.load())


def test_wheel_at_hand(upstream_wheel, tampered_wheel, monkeypatch):
    monkeypatch.setenv(BASE_WHEEL_ENV, str(upstream_wheel))
    assert verified_wheel(Pin.load()) == upstream_wheel
    monkeypatch.setenv(BASE_WHEEL_ENV, str(tampered_wheel[0]))
    with pytest.raises(BaseMismatch):
        verified_wheel(Pin.load())
    monkeypatch.setenv(BASE_WHEEL_ENV, "/no/such/torchrl.whl")
    with pytest.raises(FileNotFoundError, match=BASE_WHEEL_ENV):
        base_wheel(Pin.load())


def test_wheel_names_are_matched_canonically(upstream_wheel, tmp_path):
    # pip saves torchrl-nightly as torchrl_nightly-...whl
    nightly = tmp_path / upstream_wheel.name.replace("torchrl-", "torchrl_nightly-")
    shutil.copyfile(upstream_wheel, nightly)
    assert _compatible_wheel(tmp_path, "torchrl-nightly", "0.14.1") == nightly
    assert _compatible_wheel(tmp_path, "torchrl_nightly", "0.14.1") == nightly
    assert _compatible_wheel(tmp_path, "torchrl", "0.14.1") is None


def test_tampered_tree_refused(upstream_wheel, tmp_path):
    extract_sources(upstream_wheel, tmp_path)
    pin = Pin.load()
    verify_tree(tmp_path, pin)
    target = sorted(pin.files)[-1]
    with open(tmp_path / target, "a") as f:
        f.write("# local edit\n")
    with pytest.raises(BaseMismatch, match=target):
        verify_tree(tmp_path, pin)
    (tmp_path / target).unlink()
    with pytest.raises(BaseMismatch, match=f"{target}: missing"):
        verify_tree(tmp_path, pin)


def test_build_refuses_tampered_base_before_writing(
    tampered_wheel, tmp_path, monkeypatch
):
    wheel, _ = tampered_wheel
    monkeypatch.setenv(BASE_WHEEL_ENV, str(wheel))
    dest = tmp_path / "dist"
    with pytest.raises(BaseMismatch, match=wheel.name):
        build_module.build_wheel(dest)
    assert not dest.exists()


def test_import_refuses_tampered_base_before_writing(
    tampered_wheel, tmp_path, monkeypatch
):
    wheel, _ = tampered_wheel
    monkeypatch.setenv(BASE_WHEEL_ENV, str(wheel))
    repo = tmp_path / "queue"
    repo.mkdir()
    (repo / "keep.txt").write_text("untouched")
    with pytest.raises(BaseMismatch, match=wheel.name):
        queue_module.build_base_repo(repo, Pin.load())
    assert [p.name for p in repo.iterdir()] == ["keep.txt"]


@pytest.fixture
def rl_git(tmp_path, monkeypatch):
    """A pytorch/rl-like git directory holding one docs file, named in the environment."""
    repo = tmp_path / "rl"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "index.rst").write_text("Index\n=====\n")
    env = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
    for args in (
        ["init", "--quiet"],
        ["add", "docs"],
        ["-c", "user.name=x", "-c", "user.email=x@y.z", "commit", "--quiet", "-m", "x"],
    ):
        subprocess.run(["git", *args], cwd=repo, check=True, env={**os.environ, **env})
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    monkeypatch.setenv(RL_GIT_ENV, str(repo / ".git"))
    return commit, hashlib.sha256(b"Index\n=====\n").hexdigest()


def test_repo_sources_read_at_the_pinned_commit(rl_git):
    commit, digest = rl_git
    pin = Pin.load().replace(
        repo_files={"commit": commit, "files": {"docs/index.rst": digest}}
    )
    assert repo_sources(pin) == {"docs/index.rst": b"Index\n=====\n"}


def test_repo_sources_refuse_another_file(rl_git):
    commit, digest = rl_git
    pin = Pin.load().replace(
        repo_files={"commit": commit, "files": {"docs/index.rst": "0" * 64}}
    )
    with pytest.raises(BaseMismatch, match=f"docs/index.rst: sha256 {digest}"):
        repo_sources(pin)


def test_repo_sources_absent_without_a_checkout(monkeypatch):
    monkeypatch.delenv(RL_GIT_ENV, raising=False)
    assert repo_sources(Pin.load()) is None
