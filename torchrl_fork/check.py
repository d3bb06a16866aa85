"""Check that a series is well-formed, pinned, exact and exported."""

from __future__ import annotations

import tempfile
from pathlib import Path

from torchrl_fork.base import BaseMismatch, Pin, RL_GIT_ENV
from torchrl_fork.queue import build_base_repo, UPSTREAM_BASE
from torchrl_fork.series import (
    apply_patch,
    compare_exports,
    export_series,
    header_problems,
    patch_author,
    patch_paths,
    placeholder_reason,
    read_series,
    SeriesError,
    upstream_paths,
)


def check_series(
    pin: Pin,
    patches_dir: Path | None = None,
    queue: Path | None = None,
    sending: bool = False,
    notes: list[str] | None = None,
) -> list[str]:
    """Return every problem found, one line each; an empty list means the series is good.

    The series is applied with ``git am`` (no three-way merge, and git never
    fuzzes) onto a freshly verified base in a temporary directory, then
    exported again: a patch that applied at an offset, or that an export would
    write differently, shows up as a difference. ``sending`` also requires the
    upstream series to name a real author, as the pull request needs. The
    hunks in upstream files that wheels lack (docs, tests) are applied only
    where those pinned files are at hand (``$TORCHRL_FORK_RL_GIT``); otherwise
    ``notes`` receives the names of the patches left partly unchecked.
    """
    patches_dir = patches_dir or pin.patches_dir
    names = read_series(patches_dir / "series")
    if not names:
        return ["series: lists no patch"]
    problems = []
    listed = set(names)
    for patch in sorted(patches_dir.glob("*.patch")):
        if patch.name not in listed:
            problems.append(f"{patch.name}: not listed in series")
    missing = [name for name in names if not (patches_dir / name).is_file()]
    problems += [f"{name}: listed in series but missing" for name in missing]
    if missing:
        return problems
    for name in names:
        problems += header_problems(patches_dir / name)
        if sending and pin.name == UPSTREAM_BASE:
            reason = placeholder_reason(patch_author(patches_dir / name))
            if reason:
                problems.append(f"{name}: not ready to send: {reason}")
    touched = upstream_paths([patches_dir / name for name in names])
    for relpath, name in touched.items():
        if relpath not in {**pin.files, **pin.repo_files.get("files", {})}:
            problems.append(f"{name}: touches {relpath}, which the pin lacks")
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "base"
        try:
            absent = set()
            if not build_base_repo(repo, pin):
                absent = set(pin.repo_files.get("files", {}))
            partial = {name: patch_paths(patches_dir / name) & absent for name in names}
            partial = {name: paths for name, paths in partial.items() if paths}
            for name in names:
                if patch_paths(patches_dir / name) - absent:
                    apply_patch(repo, patches_dir / name, exclude=partial.get(name, ()))
        except (BaseMismatch, SeriesError) as err:
            return [*problems, str(err)]
        if partial and notes is not None:
            notes.append(
                f"{', '.join(partial)}: not checked in "
                f"{', '.join(sorted(set().union(*partial.values())))}, which are "
                f"not at hand ({RL_GIT_ENV} is not set); their other files are checked"
            )
        fresh = export_series(repo, Path(tmp) / "fresh")
        applied = [name for name in names if name not in partial or name in fresh]
        problems += compare_exports(patches_dir, Path(tmp) / "fresh", applied, partial)
    if queue is not None and (queue / ".git").exists():
        problems += _queue_problems(queue, patches_dir, names)
    return problems


def _queue_problems(queue: Path, patches_dir: Path, names: list[str]) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        exported = export_series(queue, Path(tmp))
        problems = compare_exports(
            patches_dir, Path(tmp), sorted(set(names) | set(exported))
        )
    return [f"queue and series differ (run 'export'): {p}" for p in problems]
