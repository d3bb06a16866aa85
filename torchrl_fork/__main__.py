"""Command line: ``python -m torchrl_fork {import,export,check,build,rebase,pin,docs}``.

Every verb works on one base (``--base``, default ``fork``): ``fork`` is the
torchrl release that the installable fork is built from, ``main`` the upstream
build that the pull-request series targets. ``check`` checks every base.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchrl_fork import DIST_DIR
from torchrl_fork.base import Pin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchrl_fork", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    base = argparse.ArgumentParser(add_help=False)
    base.add_argument("--base", choices=Pin.names(), default="fork")
    imp = verbs.add_parser(
        "import", parents=[base], help="build the queue: base + one commit per patch"
    )
    imp.add_argument("--force", action="store_true", help="discard uncommitted work")
    export = verbs.add_parser(
        "export", parents=[base], help="write the series from the queue"
    )
    export.add_argument("--author", help="'Name <email>' of the sender (main base)")
    export.add_argument(
        "--draft",
        action="store_true",
        help="keep the commits' authors even if they are placeholders",
    )
    check = verbs.add_parser("check", help="verify each base and apply its series")
    check.add_argument("--base", choices=Pin.names(), action="append")
    check.add_argument(
        "--send", action="store_true", help="also require a real upstream author"
    )
    build = verbs.add_parser("build", parents=[base], help="build the fork's wheel")
    build.add_argument("--dest", type=Path, default=DIST_DIR)
    rebase = verbs.add_parser("rebase", help="try the fork series on another build")
    rebase.add_argument("version", help="e.g. 0.15.0, or a nightly version")
    rebase.add_argument("--package", default="torchrl", help="e.g. torchrl-nightly")
    verbs.add_parser(
        "pin", parents=[base], help="pin the sha256 of every supported base wheel"
    )
    verbs.add_parser(
        "docs", help="write the series' keep_keys docs section to docs/ (rst)"
    )
    args = parser.parse_args(argv)

    if args.verb == "import":
        from torchrl_fork.queue import import_queue

        repo = import_queue(Pin.load(args.base), force=args.force)
        print(f"queue ready in {repo}; edit, commit, then 'export --base {args.base}'")
    elif args.verb == "export":
        from torchrl_fork.queue import export_queue, SenderError

        try:
            names = export_queue(
                Pin.load(args.base), author=args.author, draft=args.draft
            )
        except SenderError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print("\n".join(names))
    elif args.verb == "check":
        from torchrl_fork.check import check_series

        failed = False
        for name in args.base or Pin.names():
            pin = Pin.load(name)
            notes = []
            problems = check_series(
                pin, queue=pin.queue_dir, sending=args.send, notes=notes
            )
            for problem in problems:
                print(f"FAIL {name}: {problem}", file=sys.stderr)
            if not problems:
                print(
                    f"{name}: series OK on {pin.label}: base verified, every patch "
                    "applies exactly, headers clean"
                )
            for note in notes:
                print(f"{name}: note: {note}")
            failed |= bool(problems)
        return int(failed)
    elif args.verb == "build":
        from torchrl_fork.build import build_wheel

        print(build_wheel(args.dest, Pin.load(args.base)))
    elif args.verb == "rebase":
        from torchrl_fork.rebase import CONFLICTS, rebase_series

        outcomes = rebase_series(args.version, package=args.package)
        for outcome in outcomes:
            print(outcome)
        return int(any(o.status == CONFLICTS for o in outcomes))
    elif args.verb == "docs":
        from torchrl_fork.docs import write_reference

        print(write_reference())
    elif args.verb == "pin":
        from torchrl_fork.base import pin_wheels

        pin = pin_wheels(Pin.load(args.base))
        pin.save()
        print(f"{args.base}: pinned {len(pin.wheels)} wheels of {pin.label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
