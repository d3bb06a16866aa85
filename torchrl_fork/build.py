"""Build the fork's wheel: upstream's wheel for this interpreter, plus the series."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from torchrl_fork import DIST_DIR, LOCAL_VERSION, PATCHES_DIR
from torchrl_fork.base import Pin, verified_wheel
from torchrl_fork.series import series_paths


def build_wheel(
    dest: Path = DIST_DIR, patches_dir: Path = PATCHES_DIR, pin: Pin | None = None
) -> Path:
    """Write ``torchrl-<version>+keepkeys-<tags>.whl`` into ``dest`` and return it.

    Only ``torchrl/`` and the ``.dist-info`` directory are kept from upstream's
    wheel; its compiled extension is carried unchanged. ``wheel pack`` writes
    the new version into the metadata and regenerates ``RECORD``.
    """
    pin = pin or Pin.load()
    upstream = verified_wheel(pin)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _wheel("unpack", "--dest", tmp, str(upstream))
        (unpacked,) = Path(tmp).iterdir()
        _keep_only_package(unpacked, pin.package)
        for patch in series_paths(patches_dir):
            _apply_to_package(unpacked, patch, pin.package)
        before = set(dest.glob("*.whl"))
        _wheel(
            "pack",
            "--local-version",
            LOCAL_VERSION,
            "--dest-dir",
            str(dest),
            str(unpacked),
        )
    built = sorted(set(dest.glob("*.whl")) - before) or sorted(
        dest.glob(f"{pin.package}-{pin.version}+{LOCAL_VERSION}-*.whl")
    )
    return built[-1]


def _wheel(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "wheel", *args], check=True, capture_output=True
    )


def _keep_only_package(unpacked: Path, package: str) -> None:
    for entry in unpacked.iterdir():
        if entry.name != package and not entry.name.endswith(".dist-info"):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    for top_level in unpacked.glob("*.dist-info/top_level.txt"):
        top_level.write_text(f"{package}\n")


def _apply_to_package(unpacked: Path, patch: Path, package: str) -> None:
    # Outside any repository, so that git applies relative to ``unpacked``.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(unpacked.parent))
    result = subprocess.run(
        ["git", "apply", f"--include={package}/*", str(patch)],
        cwd=unpacked,
        env=env,
        text=True,
        capture_output=True,
    )
    if result.returncode:
        raise RuntimeError(f"{patch.name} does not apply: {result.stderr.strip()}")
