"""Pin and verify the upstream TorchRL release that the series patches."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

from torchrl_fork import CACHE_DIR

PIN_FILE = Path(__file__).with_name("base.json")


class BaseMismatch(RuntimeError):
    """The downloaded upstream release is not the pinned one."""


@dataclass(frozen=True)
class Pin:
    package: str
    version: str
    git_tag: str
    files: dict[str, str]

    @classmethod
    def load(cls, path: Path = PIN_FILE) -> Pin:
        data = json.loads(path.read_text())
        return cls(
            package=data["package"],
            version=data["version"],
            git_tag=data["git_tag"],
            files=dict(data["files"]),
        )

    def save(self, path: Path = PIN_FILE) -> None:
        data = {
            "package": self.package,
            "version": self.version,
            "git_tag": self.git_tag,
            "files": dict(sorted(self.files.items())),
        }
        path.write_text(json.dumps(data, indent=2) + "\n")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def download_wheel(
    version: str, dest: Path = CACHE_DIR, package: str = "torchrl"
) -> Path:
    """Download the upstream wheel of ``package==version`` for this interpreter."""
    dest.mkdir(parents=True, exist_ok=True)
    found = _compatible_wheel(dest, package, version)
    if found is not None:
        return found
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            str(dest),
            f"{package}=={version}",
        ],
        check=True,
    )
    found = _compatible_wheel(dest, package, version)
    if found is None:
        raise FileNotFoundError(
            f"pip downloaded no {package} {version} wheel for this interpreter"
        )
    return found


def _compatible_wheel(dest: Path, package: str, version: str) -> Path | None:
    supported = list(sys_tags())
    best: tuple[int, Path] | None = None
    for path in dest.glob(f"{package}-{version}-*.whl"):
        _, wheel_version, _, tags = parse_wheel_filename(path.name)
        if str(wheel_version) != version:
            continue
        ranks = [supported.index(tag) for tag in tags if tag in supported]
        if ranks and (best is None or min(ranks) < best[0]):
            best = (min(ranks), path)
    return None if best is None else best[1]


def extract_sources(wheel: Path, dest: Path, package: str = "torchrl") -> None:
    """Extract the ``package/`` tree of ``wheel`` into ``dest``, nothing else."""
    with zipfile.ZipFile(wheel) as archive:
        members = [n for n in archive.namelist() if n.startswith(f"{package}/")]
        archive.extractall(dest, members)


def verify_tree(tree: Path, pin: Pin) -> None:
    """Raise :class:`BaseMismatch` naming the first pinned file that differs."""
    for relpath, expected in sorted(pin.files.items()):
        path = tree / relpath
        if not path.is_file():
            raise BaseMismatch(
                f"{relpath}: missing from the base, expected torchrl {pin.version}"
            )
        actual = sha256(path)
        if actual != expected:
            raise BaseMismatch(
                f"{relpath}: sha256 {actual} does not match the pin {expected} "
                f"for torchrl {pin.version}; refusing to patch this base"
            )


def verify_wheel(wheel: Path, pin: Pin) -> None:
    """Check the pinned files inside ``wheel`` without extracting anything."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for relpath, expected in sorted(pin.files.items()):
            if relpath not in names:
                raise BaseMismatch(f"{relpath}: missing from {wheel.name}")
            actual = hashlib.sha256(archive.read(relpath)).hexdigest()
            if actual != expected:
                raise BaseMismatch(
                    f"{relpath}: sha256 {actual} in {wheel.name} does not match "
                    f"the pin {expected}; refusing to patch this base"
                )


def verified_wheel(pin: Pin) -> Path:
    """Download the pinned base wheel and verify it; nothing is extracted."""
    wheel = download_wheel(pin.version, package=pin.package)
    verify_wheel(wheel, pin)
    return wheel
