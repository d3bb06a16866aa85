"""Tooling that pins TorchRL, carries the keep_keys patch series and builds the fork."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCHES_DIR = ROOT / "patches"
SERIES_FILE = PATCHES_DIR / "series"
BUILD_DIR = ROOT / "build"
QUEUE_DIR = BUILD_DIR / "queue"
CACHE_DIR = BUILD_DIR / "cache"
DIST_DIR = ROOT / "dist"

#: Local version label appended to upstream's version in the built wheel.
LOCAL_VERSION = "keepkeys"
