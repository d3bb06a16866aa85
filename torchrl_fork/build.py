"""Build a fork wheel: upstream's wheel for this interpreter, plus a series."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from torchrl_fork import DIST_DIR, LOCAL_VERSION
from torchrl_fork.base import Pin, verified_wheel
from torchrl_fork.series import apply_part, series_paths


def build_wheel(
    dest: Path = DIST_DIR, pin: Pin | None = None, patches_dir: Path | None = None
) -> Path:
    """Write upstream's wheel, patched, with the local version ``+keepkeys`` into ``dest``.

    The wheel is upstream's entry for entry: only the files the series
    changes, the version in the metadata and the ``.dist-info`` name, and the
    ``RECORD`` that ``wheel pack`` regenerates differ. The compiled extension is
    carried unchanged. Returns the path of the new wheel.
    """
    pin = pin or Pin.load()
    upstream = verified_wheel(pin)
    with tempfile.TemporaryDirectory() as tmp:
        _wheel("unpack", "--dest", tmp, str(upstream))
        (unpacked,) = Path(tmp).iterdir()
        for patch in series_paths(patches_dir or pin.patches_dir):
            # wheels carry no tests: only the torchrl/ part applies
            apply_part(patch, unpacked, "torchrl/*")
        dest.mkdir(parents=True, exist_ok=True)
        _wheel(
            "pack",
            "--local-version",
            LOCAL_VERSION,
            "--dest-dir",
            str(dest),
            str(unpacked),
        )
    version = f"-{pin.version}-"
    return dest / upstream.name.replace(version, f"-{pin.version}+{LOCAL_VERSION}-", 1)


def _wheel(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "wheel", *args], check=True, capture_output=True
    )
