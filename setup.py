"""Install the keep_keys fork of TorchRL: ``pip install .`` or ``pip wheel .``.

The distribution is upstream's own torchrl wheel with the patch series
applied (see ``torchrl_fork/build.py``). Its name, version and requirements
are read from that wheel's metadata, so they are upstream's, with the local
version label ``+keepkeys`` added. With ``TORCHRL_FORK_BASE_WHEEL`` set to the
path of that wheel, the build downloads nothing.
"""

import email
import importlib.machinery
import re
import sys
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel

# pyproject.toml's build requirements; without build isolation, name a missing
# one. setuptools puts its own vendored copies on sys.path, where neither
# torchrl_fork's imports from a clean path nor `python -m wheel` (build.py) find
# them, so they do not count.
_INSTALLED = [p for p in sys.path if Path(p).parts[-2:] != ("setuptools", "_vendor")]
for module, requirement in (("packaging", "packaging>=23"), ("wheel", "wheel==0.48.0")):
    if importlib.machinery.PathFinder.find_spec(module, _INSTALLED) is None:
        sys.exit(
            f"error: building the fork needs {requirement}, which is not installed. "
            f"Install it (pip install '{requirement}'), or build with pip's build "
            "isolation (without --no-build-isolation)."
        )

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torchrl_fork import BUILD_DIR, LOCAL_VERSION  # noqa: E402
from torchrl_fork.base import Pin, verified_wheel  # noqa: E402
from torchrl_fork.build import build_wheel  # noqa: E402

EXTRA_MARKER = re.compile(r"""\s*(?:and\s+)?extra\s*==\s*["']([^"']+)["']""")


def upstream_metadata(pin: Pin) -> email.message.Message:
    with zipfile.ZipFile(verified_wheel(pin)) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(archive.read(name))


def split_requirements(metadata: email.message.Message):
    """Upstream's Requires-Dist, as setuptools' install_requires and extras_require."""
    install_requires, extras = [], {}
    for requirement in metadata.get_all("Requires-Dist") or []:
        match = EXTRA_MARKER.search(requirement)
        if match is None:
            install_requires.append(requirement)
            continue
        rest = EXTRA_MARKER.sub("", requirement).strip().rstrip(";").strip()
        rest = re.sub(r";\s*and\s+", "; ", rest)
        extras.setdefault(match.group(1), []).append(rest)
    for extra in metadata.get_all("Provides-Extra") or []:
        extras.setdefault(extra, [])
    return install_requires, extras


class ForkWheel(bdist_wheel):
    """Build the patched upstream wheel instead of packaging this directory."""

    def run(self):
        build_wheel(Path(self.dist_dir), pin)


# setuptools writes torchrl.egg-info to egg_base; at the checkout root it would
# make a Python started there report this version for any installed torchrl
BUILD_DIR.mkdir(exist_ok=True)

pin = Pin.load()
metadata = upstream_metadata(pin)
install_requires, extras_require = split_requirements(metadata)
setup(
    name=pin.package,
    version=f"{pin.version}+{LOCAL_VERSION}",
    description=metadata["Summary"],
    python_requires=metadata["Requires-Python"],
    install_requires=install_requires,
    extras_require=extras_require,
    packages=[],
    py_modules=[],
    cmdclass={"bdist_wheel": ForkWheel},
    options={"egg_info": {"egg_base": str(BUILD_DIR)}},
)
