"""Pin and verify the upstream TorchRL builds that the two series patch.

``bases.json`` holds one pin per base: ``fork`` (the torchrl release the
installable fork is built from) and ``main`` (the newest upstream build, that
the pull-request series targets). A pin records the sha256 of every upstream
wheel it supports, one per platform tag, and of each upstream file a series
touches. Wheels carry no ``docs/`` and no ``test/``: the documentation and test
files a series touches (``repo_files``) are pinned to a commit of pytorch/rl,
read from a git directory of it (``$TORCHRL_FORK_RL_GIT``) where one is at hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

from torchrl_fork import BUILD_DIR, CACHE_DIR, ROOT

BASES_FILE = Path(__file__).with_name("bases.json")
#: A wheel of the base at hand: builds with it instead of downloading one.
BASE_WHEEL_ENV = "TORCHRL_FORK_BASE_WHEEL"
#: A git directory of pytorch/rl, for the files of a base that its wheels lack.
RL_GIT_ENV = "TORCHRL_FORK_RL_GIT"


class BaseMismatch(RuntimeError):
    """The upstream wheel or file is not the pinned one."""


@dataclass(frozen=True)
class Pin:
    name: str
    package: str
    version: str
    source: str
    patches: str
    python_versions: tuple[str, ...]
    platforms: tuple[str, ...]
    wheels: dict[str, str]
    files: dict[str, str]
    #: ``commit`` of pytorch/rl and the sha256 of each of its ``files`` that
    #: the series touches and the wheels lack
    repo_files: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, name: str = "fork", path: Path = BASES_FILE) -> Pin:
        data = json.loads(path.read_text())
        if name not in data:
            raise KeyError(f"no base {name!r} in {path.name}: {sorted(data)}")
        entry = data[name]
        return cls(
            name=name,
            package=entry["package"],
            version=entry["version"],
            source=entry["source"],
            patches=entry["patches"],
            python_versions=tuple(entry["python_versions"]),
            platforms=tuple(entry["platforms"]),
            wheels=dict(entry["wheels"]),
            files=dict(entry["files"]),
            repo_files=dict(entry.get("repo_files", {})),
        )

    @staticmethod
    def names(path: Path = BASES_FILE) -> list[str]:
        return list(json.loads(path.read_text()))

    def save(self, path: Path = BASES_FILE) -> None:
        data = json.loads(path.read_text())
        entry = dataclasses.asdict(self)
        del entry["name"]
        entry["wheels"] = dict(sorted(self.wheels.items()))
        entry["files"] = dict(sorted(self.files.items()))
        if self.repo_files:
            entry["repo_files"] = {
                **self.repo_files,
                "files": dict(sorted(self.repo_files["files"].items())),
            }
        else:
            del entry["repo_files"]
        data[self.name] = entry
        path.write_text(json.dumps(data, indent=2) + "\n")

    def replace(self, **changes) -> Pin:
        return dataclasses.replace(self, **changes)

    @property
    def patches_dir(self) -> Path:
        return ROOT / self.patches

    @property
    def queue_dir(self) -> Path:
        return BUILD_DIR / ("queue" if self.name == "fork" else f"queue-{self.name}")

    @property
    def label(self) -> str:
        return f"{self.package} {self.version}"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def download_wheel(package: str, version: str, dest: Path = CACHE_DIR) -> Path:
    """The upstream wheel of ``package==version`` for this interpreter, downloaded once."""
    dest.mkdir(parents=True, exist_ok=True)
    found = _compatible_wheel(dest, package, version)
    if found is None:
        _pip_download(package, version, dest)
        found = _compatible_wheel(dest, package, version)
    if found is None:
        raise FileNotFoundError(
            f"pip downloaded no {package} {version} wheel for this interpreter"
        )
    return found


def _pip_download(package: str, version: str, dest: Path, *platform_args: str):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            *platform_args,
            "--dest",
            str(dest),
            f"{package}=={version}",
        ],
        check=True,
    )


def _compatible_wheel(dest: Path, package: str, version: str) -> Path | None:
    # wheel file names normalise the distribution name (torchrl-nightly is
    # torchrl_nightly-...whl): compare canonical names, not a glob
    supported = list(sys_tags())
    best: tuple[int, Path] | None = None
    for path in dest.glob("*.whl"):
        name, wheel_version, _, tags = parse_wheel_filename(path.name)
        if name != canonicalize_name(package) or str(wheel_version) != version:
            continue
        ranks = [supported.index(tag) for tag in tags if tag in supported]
        if ranks and (best is None or min(ranks) < best[0]):
            best = (min(ranks), path)
    return None if best is None else best[1]


def base_wheel(pin: Pin) -> Path:
    """The base wheel: ``$TORCHRL_FORK_BASE_WHEEL`` if set, else a download."""
    at_hand = os.environ.get(BASE_WHEEL_ENV)
    if at_hand:
        wheel = Path(at_hand)
        if not wheel.is_file():
            raise FileNotFoundError(f"{BASE_WHEEL_ENV}={at_hand}: no such file")
        return wheel
    return download_wheel(pin.package, pin.version)


def verify_wheel(wheel: Path, pin: Pin) -> None:
    """Check the whole wheel, then each pinned file in it, without extracting."""
    expected = pin.wheels.get(wheel.name)
    if expected is None:
        raise BaseMismatch(
            f"{wheel.name}: no sha256 is pinned for this wheel of {pin.label} "
            f"(pinned: {', '.join(sorted(pin.wheels))})"
        )
    actual = sha256(wheel)
    if actual != expected:
        raise BaseMismatch(
            f"{wheel.name}: sha256 {actual} does not match the pin {expected}; "
            "refusing to build on it"
        )
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
    """The base wheel, verified against the pin; nothing is extracted."""
    wheel = base_wheel(pin)
    verify_wheel(wheel, pin)
    return wheel


def extract_sources(wheel: Path, dest: Path) -> None:
    """Extract the ``torchrl/`` tree of ``wheel`` into ``dest``, nothing else."""
    with zipfile.ZipFile(wheel) as archive:
        members = [n for n in archive.namelist() if n.startswith("torchrl/")]
        archive.extractall(dest, members)


def verify_tree(tree: Path, pin: Pin) -> None:
    """Raise :class:`BaseMismatch` naming the first pinned file that differs."""
    for relpath, expected in sorted(pin.files.items()):
        path = tree / relpath
        if not path.is_file():
            raise BaseMismatch(
                f"{relpath}: missing from the base, expected {pin.label}"
            )
        actual = sha256(path)
        if actual != expected:
            raise BaseMismatch(
                f"{relpath}: sha256 {actual} does not match the pin {expected} "
                f"for {pin.label}; refusing to patch this base"
            )


def pin_wheels(pin: Pin) -> Pin:
    """Download every supported wheel of the base and pin its sha256.

    The per-file pins must hold in each of them: they are the files a series
    touches, and pure Python.
    """
    with tempfile.TemporaryDirectory() as tmp:
        for python_version in pin.python_versions:
            for platform in pin.platforms:
                _pip_download(
                    pin.package,
                    pin.version,
                    Path(tmp),
                    "--implementation=cp",
                    f"--python-version={python_version}",
                    f"--platform={platform}",
                )
        wheels = {path.name: sha256(path) for path in Path(tmp).glob("*.whl")}
        pinned = pin.replace(wheels=wheels)
        for name in wheels:
            verify_wheel(Path(tmp) / name, pinned)
    return pinned


def repo_sources(pin: Pin) -> dict[str, bytes] | None:
    """The pinned ``repo_files`` of the base, or ``None`` if they are not at hand.

    They are read at the pinned commit from the pytorch/rl git directory that
    ``$TORCHRL_FORK_RL_GIT`` names, and verified against their sha256.
    """
    rl_git = os.environ.get(RL_GIT_ENV)
    if not pin.repo_files or not rl_git:
        return None
    sources = {}
    for relpath, expected in sorted(pin.repo_files["files"].items()):
        result = subprocess.run(
            [
                "git",
                "--git-dir",
                rl_git,
                "show",
                f"{pin.repo_files['commit']}:{relpath}",
            ],
            capture_output=True,
        )
        if result.returncode:
            raise BaseMismatch(
                f"{relpath}: not found at pytorch/rl {pin.repo_files['commit']} in "
                f"{RL_GIT_ENV}={rl_git}: {result.stderr.decode().strip()}"
            )
        actual = hashlib.sha256(result.stdout).hexdigest()
        if actual != expected:
            raise BaseMismatch(
                f"{relpath}: sha256 {actual} at pytorch/rl {pin.repo_files['commit']} "
                f"does not match the pin {expected}; refusing to patch it"
            )
        sources[relpath] = result.stdout
    return sources
