"""A study as a pipeline: a config, then ``collect()``, then ``analyse()``, then ``report()``.

A study is one config and three functions, bundled in a :class:`Study` value (no class of its
own): each ``quotientgeo reproduce NAME`` module defines

- ``Config``, a frozen dataclass of everything that decides the result (sizes, seeds, grids,
  the measures as :class:`~quotientgeo.Measure` values), and ``config(args)``, which builds it
  from the command line;
- ``collect(config, population, out)``: the expensive part, typed records (dataclasses), one
  per member (model, radius, ...), split over the ranks of a ``torchrun`` launch by the
  :class:`~._common.Population` and cached under ``out`` where training is involved;
- ``analyse(config, records)``: statistics only (Kendall τ, bands, ratios), no training and no
  measuring, so it can be re-run on saved records;
- ``report(config, analysis, out)``: the printed table, the JSON (its fields are the study's
  public output) and the figures. Only rank 0 reports.

and ``STUDY = Study(config, collect, analyse, report)``; its ``run(args)`` is
``run_study(STUDY, args)`` (or :func:`run_with_workers`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from . import _common as C

__all__ = ["Study", "add_workers_argument", "run_study", "run_with_workers"]

Config = TypeVar("Config")
Records = TypeVar("Records")
Analysis = TypeVar("Analysis")


@dataclass(frozen=True)
class Study(Generic[Config, Records, Analysis]):
    """A study's config and three steps (module docstring): plain functions of its module."""

    config: Callable[[argparse.Namespace], Config]
    collect: Callable[[Config, C.Population, Path], Records]
    analyse: Callable[[Config, Records], Analysis]
    report: Callable[[Config, Analysis, Path], dict[str, Any]]


def run_study(
    study: Study[Any, Any, Any] | Sequence[Study[Any, Any, Any]], args: argparse.Namespace
) -> int:
    """``report(analyse(collect(config(args))))`` on rank 0; every rank collects its share.
    The analysis is a phase of its own (a bar, or its start and end lines in a log). Several
    studies run one after the other in one process group."""
    out = C.out_dir(args)
    studies = [study] if isinstance(study, Study) else list(study)
    with C.Population() as population:
        for one in studies:
            config = one.config(args)
            records = one.collect(config, population, out)
            if population.is_reporter:
                with C.counter("analysing", 1, enabled=not args.no_progress) as bar:
                    analysis = one.analyse(config, records)
                    bar.update(1)
                one.report(config, analysis, out)
    return 0


def add_workers_argument(parser: argparse.ArgumentParser) -> None:
    """``--workers N``: local processes sharing a study's work (default 2; ``--quick``: 1)."""
    parser.add_argument(
        "--workers", type=int, default=None, help="local processes sharing the work (2; --quick: 1)"
    )


def run_with_workers(
    entry: Callable[[argparse.Namespace], int],
    study: Study[Any, Any, Any] | Sequence[Study[Any, Any, Any]],
    args: argparse.Namespace,
) -> int:
    """:func:`run_study` in ``args.workers`` local processes (a gloo group, as ``torchrun``
    makes), unless this process already is one rank of a launch; ``entry`` is the command's
    module-level ``run``, which every spawned process calls again. Several studies run one
    after the other in the same processes."""
    workers = args.workers or (1 if args.quick else 2)
    if workers > 1 and not C.under_torchrun():
        return C.spawn(entry, args, workers)
    return run_study(study, args)
