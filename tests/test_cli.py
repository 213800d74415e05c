"""The ``quotientgeo`` command: the library's own ``bench`` group, groups and commands added by
other distributions through the ``quotientgeo.commands`` entry points, and a clear message
where the studies (``pip install ./studies``) are not installed."""

from __future__ import annotations

import sys
import types
from importlib import metadata

import pytest

from quotientgeo import cli


def _entry_points(monkeypatch, eps: list[metadata.EntryPoint]) -> None:
    def entry_points(*, group: str):
        return [ep for ep in eps if ep.group == group]

    monkeypatch.setattr(cli.metadata, "entry_points", entry_points)


@pytest.fixture
def plugin(monkeypatch):
    """A module registered as ``reproduce`` and one adding ``extra`` to ``bench``."""
    calls = []

    def run(args):
        """Run the fake study."""
        calls.append(args.size)
        return 0

    def add_arguments(parser):
        parser.add_argument("--size", type=int, default=1)

    studies = types.ModuleType("fake_studies")
    studies.COMMANDS = {"fake": (add_arguments, run)}  # type: ignore[attr-defined]
    bench = types.ModuleType("fake_studies_bench")
    bench.COMMANDS = {"extra": (add_arguments, run)}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_studies", studies)
    monkeypatch.setitem(sys.modules, "fake_studies_bench", bench)
    _entry_points(
        monkeypatch,
        [
            metadata.EntryPoint("reproduce", "fake_studies", cli.ENTRY_POINTS),
            metadata.EntryPoint("bench", "fake_studies_bench", cli.ENTRY_POINTS),
        ],
    )
    return calls


def test_entry_points_add_groups_and_commands(plugin):
    assert cli.main(["reproduce", "fake", "--size", "3"]) == 0
    assert cli.main(["bench", "extra"]) == 0
    assert plugin == [3, 1]
    bench = cli.command_modules()["bench"]
    assert bench[0].__name__ == "quotientgeo.bench"  # the library's own commands come first
    assert set(bench[0].COMMANDS) == {"cost", "memory", "sharpness"}


def test_without_the_studies_reproduce_says_how_to_install_them(monkeypatch, capsys):
    _entry_points(monkeypatch, [])
    assert cli.main(["reproduce", "diagonal"]) == 2
    assert "pip install ./studies" in capsys.readouterr().err
    assert cli.main(["bench", "sam"]) == 2
    assert "pip install ./studies" in capsys.readouterr().err
    assert "pip install ./studies" in " ".join(cli.build_parser().format_help().split())
    with pytest.raises(SystemExit):  # the library's own benchmarks stay
        cli.main(["bench", "memory", "--help"])
    assert "--only" in capsys.readouterr().out
