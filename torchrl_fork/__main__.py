"""Command line: ``python -m torchrl_fork {import,export,check,build,rebase}``."""

from __future__ import annotations

import argparse
import sys

from torchrl_fork import DIST_DIR, QUEUE_DIR


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchrl_fork", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    imp = verbs.add_parser(
        "import", help="build the queue: base + one commit per patch"
    )
    imp.add_argument("--force", action="store_true", help="discard uncommitted work")
    verbs.add_parser("export", help="write patches/ and series from the queue")
    verbs.add_parser("check", help="verify the base and apply the series exactly")
    verbs.add_parser("build", help=f"build the fork's wheel into {DIST_DIR.name}/")
    rebase = verbs.add_parser("rebase", help="try the series on another release")
    rebase.add_argument("version", help="e.g. 0.15.0, or a nightly version")
    rebase.add_argument("--package", default="torchrl", help="e.g. torchrl-nightly")
    args = parser.parse_args(argv)

    if args.verb == "import":
        from torchrl_fork.queue import import_queue

        repo = import_queue(force=args.force)
        print(f"queue ready in {repo}; edit, commit, then 'export'")
    elif args.verb == "export":
        from torchrl_fork.queue import export_queue

        for name in export_queue():
            print(name)
    elif args.verb == "check":
        from torchrl_fork.check import check_series

        problems = check_series(queue=QUEUE_DIR)
        for problem in problems:
            print(f"FAIL {problem}", file=sys.stderr)
        if problems:
            return 1
        print("series OK: base verified, every patch applies exactly, headers complete")
    elif args.verb == "build":
        from torchrl_fork.build import build_wheel

        print(build_wheel())
    elif args.verb == "rebase":
        from torchrl_fork.rebase import CONFLICTS, rebase_series

        outcomes = rebase_series(args.version, package=args.package)
        for outcome in outcomes:
            print(outcome)
        return int(any(o.status == CONFLICTS for o in outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
