"""The pinned base: a tampered upstream file is refused before anything is written."""

import shutil
import zipfile

import pytest

from torchrl_fork import build as build_module, queue as queue_module
from torchrl_fork.base import (
    BaseMismatch,
    download_wheel,
    extract_sources,
    Pin,
    verify_tree,
    verify_wheel,
)


@pytest.fixture(scope="module")
def upstream_wheel():
    return download_wheel(Pin.load().version)


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


def test_pin_names_release_and_tag():
    pin = Pin.load()
    assert (pin.package, pin.version, pin.git_tag) == ("torchrl", "0.14.1", "v0.14.1")
    assert pin.files, "the pin must cover the files the series touches"


def test_pristine_wheel_verifies(upstream_wheel):
    verify_wheel(upstream_wheel, Pin.load())


def test_tampered_wheel_refused(tampered_wheel):
    wheel, target = tampered_wheel
    with pytest.raises(BaseMismatch, match=target):
        verify_wheel(wheel, Pin.load())


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
    wheel, target = tampered_wheel
    monkeypatch.setattr("torchrl_fork.base.download_wheel", lambda *a, **k: wheel)
    dest = tmp_path / "dist"
    with pytest.raises(BaseMismatch, match=target):
        build_module.build_wheel(dest)
    assert not dest.exists()


def test_import_refuses_tampered_base_before_writing(
    tampered_wheel, tmp_path, monkeypatch
):
    wheel, target = tampered_wheel
    monkeypatch.setattr("torchrl_fork.base.download_wheel", lambda *a, **k: wheel)
    repo = tmp_path / "queue"
    repo.mkdir()
    (repo / "keep.txt").write_text("untouched")
    with pytest.raises(BaseMismatch, match=target):
        queue_module.build_base_repo(repo)
    assert [p.name for p in repo.iterdir()] == ["keep.txt"]
    shutil.rmtree(repo)
