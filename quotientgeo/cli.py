"""The ``quotientgeo`` console script: ``quotientgeo bench NAME``, ``quotientgeo reproduce NAME``.

Each command lives next to the code it exercises: benchmarks in :mod:`quotientgeo.bench`,
reproductions in :mod:`quotientgeo.experiments`. Both expose ``COMMANDS``, a dict from the
command name to ``(add_arguments, run)``; this module only wires them into argparse.
"""

from __future__ import annotations

import argparse
import importlib
import sys

GROUPS = {
    "bench": ("quotientgeo.bench", "time the library against baselines (one run, ratios)"),
    "reproduce": ("quotientgeo.experiments", "reproduce the paper's experiments"),
}


def _first_line(doc: str | None) -> str | None:
    """The first line of a docstring, None where there is none."""
    lines = (doc or "").strip().splitlines()
    return lines[0] if lines else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quotientgeo", description=_first_line(__doc__))
    groups = parser.add_subparsers(dest="group", required=True)
    for group, (module_name, help_text) in GROUPS.items():
        commands = getattr(importlib.import_module(module_name), "COMMANDS", {})
        sub = groups.add_parser(group, help=help_text).add_subparsers(dest="name", required=True)
        for name, (add_arguments, run) in commands.items():
            command = sub.add_parser(name, help=_first_line(run.__doc__))
            add_arguments(command)
            command.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
