"""Tooling that pins TorchRL, carries the keep_keys patch series and builds the fork."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = ROOT / "build"
CACHE_DIR = BUILD_DIR / "cache"
DIST_DIR = ROOT / "dist"

#: Local version label appended to upstream's version in the built wheel.
LOCAL_VERSION = "keepkeys"
