"""A study as a pipeline: a config, then ``collect()``, then ``analyse()``, then ``report()``.

- ``config(args)``: everything that decides the result (sizes, seeds, grids, the measures as
  :class:`~quotientgeo.Measure` values), a frozen dataclass built from the command line;
- ``collect(config, population)``: the expensive part, typed records (dataclasses), one per
  member (model, radius, ...), split over the ranks of a ``torchrun`` launch by the
  :class:`~._common.Population` and cached on disk where training is involved;
- ``analyse(config, records)``: statistics only (Kendall τ, bands, ratios), no training and no
  measuring, so it can be re-run on saved records;
- ``report(config, analysis, out)``: the printed table, the JSON (its fields are the study's
  public output) and the figures. Only rank 0 reports.

:func:`run_study` chains them; each ``quotientgeo reproduce NAME`` module defines a
:class:`Study` and its ``run(args)`` is ``run_study(STUDY, args)``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from . import _common as C

__all__ = ["Study", "add_workers_argument", "run_study", "run_with_workers"]

Config = TypeVar("Config")
Records = TypeVar("Records")
Analysis = TypeVar("Analysis")


class Study(Protocol, Generic[Config, Records, Analysis]):
    """The four steps of a study (module docstring)."""

    name: str

    def config(self, args: argparse.Namespace) -> Config: ...

    def collect(self, config: Config, population: C.Population, out: Path) -> Records: ...

    def analyse(self, config: Config, records: Records) -> Analysis: ...

    def report(self, config: Config, analysis: Analysis, out: Path) -> dict[str, Any]: ...


def run_study(study: Study[Any, Any, Any], args: argparse.Namespace) -> int:
    """``report(analyse(collect(config(args))))`` on rank 0; every rank collects its share."""
    out = C.out_dir(args)
    config = study.config(args)
    with C.Population() as population:
        records = study.collect(config, population, out)
        if population.is_reporter:
            study.report(config, study.analyse(config, records), out)
    return 0


def add_workers_argument(parser: argparse.ArgumentParser) -> None:
    """``--workers N``: local processes sharing a study's work (default 2; ``--quick``: 1)."""
    parser.add_argument(
        "--workers", type=int, default=None, help="local processes sharing the work (2; --quick: 1)"
    )


def run_with_workers(
    entry: Callable[[argparse.Namespace], int],
    study: Study[Any, Any, Any],
    args: argparse.Namespace,
) -> int:
    """:func:`run_study` in ``args.workers`` local processes (a gloo group, as ``torchrun``
    makes), unless this process already is one rank of a launch; ``entry`` is the command's
    module-level ``run``, which every spawned process calls again."""
    workers = args.workers or (1 if args.quick else 2)
    if workers > 1 and not C.under_torchrun():
        return C.spawn(entry, args, workers)
    return run_study(study, args)
