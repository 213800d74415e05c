"""The ``quotientgeo`` console script: ``quotientgeo bench NAME``, ``quotientgeo reproduce NAME``.

A group of subcommands is a module exposing ``COMMANDS``, a dict from the command name to
``(add_arguments, run)``, and optionally ``HELP``, the group's one-line help. The library
brings its own ``bench`` group (:mod:`quotientgeo.bench`: ``memory`` and ``sharpness``); other
distributions add groups, or commands to a group, through entry points of the group
``quotientgeo.commands``, each naming such a module (the entry point's name is the group's).
The studies distribution of the repository (``pip install ./studies`` from a clone) registers
``reproduce`` (the paper's experiments) and the developer benchmarks of ``bench``. This module
only wires them into argparse; it imports nothing of theirs until the command line is parsed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib import metadata
from types import ModuleType

ENTRY_POINTS = "quotientgeo.commands"
"""The entry-point group through which other distributions add subcommands."""

BUILTIN = {"bench": "quotientgeo.bench"}
"""The library's own groups: group name -> module exposing ``COMMANDS``."""

HELP = {
    "bench": "time the library (one run, ratios and peak memory)",
    "reproduce": "reproduce the paper's experiments",
}
"""Help of the known groups; a module's ``HELP`` or docstring gives any other's."""

STUDIES_HINT = (
    "the paper's reproductions and the developer benchmarks are not installed: install the "
    "studies from a clone of the repository, `pip install ./studies`"
)


STUDIES_BENCHMARKS = ("projection", "generic", "sam")
"""The ``bench`` commands that the studies distribution adds."""


def _first_line(doc: str | None) -> str | None:
    """The first line of a docstring, None where there is none."""
    lines = (doc or "").strip().splitlines()
    return lines[0] if lines else None


def command_modules() -> dict[str, list[ModuleType]]:
    """Group name -> the modules contributing commands to it: the library's first, then the
    ``quotientgeo.commands`` entry points' in name order."""
    groups: dict[str, list[ModuleType]] = {
        group: [importlib.import_module(name)] for group, name in BUILTIN.items()
    }
    for ep in sorted(metadata.entry_points(group=ENTRY_POINTS), key=lambda ep: ep.value):
        groups.setdefault(ep.name, []).append(ep.load())
    return groups


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quotientgeo",
        description=_first_line(__doc__),
        epilog=None if "reproduce" in _registered() else f"Note: {STUDIES_HINT}.",
    )
    groups = parser.add_subparsers(dest="group", required=True)
    for group, modules in command_modules().items():
        help_text = HELP.get(group) or _first_line(
            getattr(modules[0], "HELP", None) or modules[0].__doc__
        )
        sub = groups.add_parser(group, help=help_text).add_subparsers(dest="name", required=True)
        for module in modules:
            for name, (add_arguments, run) in getattr(module, "COMMANDS", {}).items():
                command = sub.add_parser(name, help=_first_line(run.__doc__))
                add_arguments(command)
                command.set_defaults(run=run)
    return parser


def _registered() -> set[str]:
    """The group names registered through entry points (nothing imported)."""
    return {ep.name for ep in metadata.entry_points(group=ENTRY_POINTS)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    studies = argv[:1] == ["reproduce"] or (
        argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in STUDIES_BENCHMARKS
    )
    if studies and argv[0] not in _registered():
        print(f"quotientgeo {' '.join(argv[:2])}: {STUDIES_HINT}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
