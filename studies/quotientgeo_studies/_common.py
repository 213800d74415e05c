"""Shared plumbing of the reproduction commands: options, output folder, JSON, tables, Kendall τ."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import time
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch.multiprocessing.spawn import spawn as spawn_processes

__all__ = [
    "Population",
    "add_common_arguments",
    "counter",
    "finite_or_none",
    "granulated_tau",
    "kendall",
    "kendall_interval",
    "out_dir",
    "print_table",
    "progress",
    "resampled_tau_b",
    "save_figure",
    "spawn",
    "threads",
    "write_json",
]

DEFAULT_ROOT = Path("quotientgeo-results")


def add_common_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """``--out``, ``--quick``, ``--seed`` and ``--no-progress``, shared by every command."""
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_ROOT / name,
        help=f"output folder for JSON and figures (default: ./{DEFAULT_ROOT / name}/)",
    )
    parser.add_argument("--quick", action="store_true", help="CI-sized smoke run (seconds)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, models and measures")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def out_dir(args: argparse.Namespace) -> Path:
    """Create and return ``args.out``."""
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    return path


def progress(iterable, *, args: argparse.Namespace, desc: str, total: int | None = None):
    """A tqdm bar over ``iterable`` that ``--no-progress`` silences; where the output is not a
    terminal, a line when it starts and one when it ends, with the elapsed time."""
    from quotientgeo.progress import progress_bar

    enabled = not args.no_progress
    return progress_bar(iterable, desc=desc, total=total, enabled=enabled, leave=True, lines=True)


def counter(desc: str, total: int, *, enabled: bool):
    """A tqdm bar of ``total`` steps to ``update`` by hand (for :meth:`Population.map`), off
    when not ``enabled``; where the output is not a terminal, a line when the phase starts and
    one when it ends, with the elapsed time."""
    from quotientgeo.progress import progress_bar

    return progress_bar(None, desc=desc, total=total, enabled=enabled, leave=True, lines=True)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run torch on at most ``n`` intra-op threads (tiny tensors: one thread is fastest)."""
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, min(n, old)))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def finite_pairs(x: Sequence[float], y: Sequence[float]):
    """``x`` and ``y`` as float arrays without the pairs where either is not finite."""
    import numpy as np

    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = np.isfinite(a) & np.isfinite(b)
    return a[keep], b[keep]


def kendall(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Kendall τ-b of ``x`` and ``y`` and its two-sided p-value (:func:`scipy.stats.kendalltau`),
    over the pairs where both are finite."""
    from scipy.stats import kendalltau

    # scipy's result is a (statistic, p-value) pair of floats that its annotations do not type
    statistic, pvalue = cast("tuple[float, float]", kendalltau(*finite_pairs(x, y)))
    return float(statistic), float(pvalue)


def granulated_tau(
    values: Sequence[float],
    gaps: Sequence[float],
    members: Sequence[Mapping[str, Hashable]],
    axes: Sequence[str],
) -> dict[str, float]:
    """The granulated Kendall coefficient of Jiang et al. (ICLR 2020, "Fantastic
    generalization measures"): per axis ``a``, the mean over groups of members that agree on
    every other key of ``members`` (every other axis, and a seed if one is listed) of Kendall τ
    between ``values`` and ``gaps`` within the group; ``Ψ`` (key ``"psi"``) is the mean over
    ``axes``. Groups where τ is undefined (fewer than two finite pairs, or one side constant)
    are left out; an axis with no defined group is NaN (and so is Ψ)."""
    out: dict[str, float] = {}
    for axis in axes:
        groups: dict[tuple, list[int]] = {}
        for i, member in enumerate(members):
            rest = tuple(sorted((k, v) for k, v in member.items() if k != axis))
            groups.setdefault(rest, []).append(i)
        taus = []
        for idx in groups.values():
            x, y = finite_pairs([values[i] for i in idx], [gaps[i] for i in idx])
            if len(x) >= 2 and len(set(x.tolist())) > 1 and len(set(y.tolist())) > 1:
                taus.append(kendall(x.tolist(), y.tolist())[0])
        out[axis] = sum(taus) / len(taus) if taus else math.nan
    out["psi"] = sum(out[a] for a in axes) / len(axes) if axes else math.nan
    return out


def resampled_tau_b(x, y, indices):
    """Kendall τ-b of ``(x[i], y[i])`` for every row ``i`` of ``indices`` (bootstrap resamples,
    ``(..., m)``): the statistic of :func:`scipy.stats.kendalltau` on each, to the bit.

    ``τ_b = Σ s_x s_y / sqrt(n₀ - t_x) / sqrt(n₀ - t_y)`` over the ``n₀ = m(m-1)/2`` pairs of a
    resample, ``s = sign`` of the pair's difference, ``t_x``, ``t_y`` the pairs tied in ``x``,
    in ``y`` (a point drawn twice is tied with itself), clipped to ``[-1, 1]`` in scipy's order
    of operations; NaN where one side is constant. A sum over a resample's pairs is a quadratic
    form of its multiplicities ``c`` (how often it draws each point): ``Σ_{a,b} S[i_a, i_b] =
    cᵀ S c``, one matrix product for all resamples instead of a sort per resample.
    """
    import numpy as np

    x, y, indices = np.asarray(x), np.asarray(y), np.asarray(indices)
    n, m = len(x), indices.shape[-1]
    rows = indices.reshape(-1, m)
    flat = (rows + n * np.arange(len(rows))[:, None]).ravel()
    counts = np.bincount(flat, minlength=len(rows) * n).reshape(len(rows), n).astype(float)
    sx, sy = np.sign(x[:, None] - x[None, :]), np.sign(y[:, None] - y[None, :])

    def pairs(matrix):  # Σ over the ordered pairs a ≠ b of the resample (exact integers)
        both = ((counts @ matrix) * counts).sum(axis=1) - counts @ np.diagonal(matrix)
        return np.rint(both).astype(np.int64) // 2

    concordance, tied_x, tied_y = pairs(sx * sy), pairs(sx == 0), pairs(sy == 0)
    total = m * (m - 1) // 2
    with np.errstate(divide="ignore", invalid="ignore"):
        tau = np.clip(concordance / np.sqrt(total - tied_x) / np.sqrt(total - tied_y), -1.0, 1.0)
    tau = np.where((tied_x == total) | (tied_y == total), np.nan, tau)
    return tau.reshape(indices.shape[:-1])


def kendall_interval(
    x: Sequence[float],
    y: Sequence[float],
    *,
    confidence: float = 0.9,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of Kendall τ-b over models: pairs ``(x_i, y_i)`` resampled
    with replacement (:func:`scipy.stats.bootstrap`, ``paired=True``) among the finite pairs;
    resamples on which τ is undefined (one side constant) are left out of the percentiles. The
    resamples are drawn as indices of the pairs, as ``paired=True`` draws them, and their τ are
    computed together (:func:`resampled_tau_b`: the values of one
    :func:`scipy.stats.kendalltau` per resample; 2000 resamples of 3 to 120 pairs about 90
    times faster)."""
    import numpy as np
    from scipy.stats import DegenerateDataWarning, bootstrap

    a, b = finite_pairs(x, y)
    with warnings.catch_warnings():  # scipy warns of NaN resamples, which nanpercentile drops
        warnings.simplefilter("ignore", DegenerateDataWarning)
        res = bootstrap(
            (np.arange(len(a)),),
            lambda i, axis=-1: resampled_tau_b(a, b, np.moveaxis(i, axis, -1)),
            vectorized=True,
            n_resamples=resamples,
            method="percentile",
            rng=np.random.default_rng(seed),
        )
    tail = 50 * (1 - confidence)
    lo, hi = np.nanpercentile(res.bootstrap_distribution, [tail, 100 - tail])
    return float(lo), float(hi)


def finite_or_none(value: Any) -> Any:
    """``value`` as a float, or ``None`` when it is not finite (JSON has no NaN)."""
    value = float(value)
    return value if math.isfinite(value) else None


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` plus run metadata to ``path`` (strict JSON: NaN is an error)."""
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }
    path.write_text(json.dumps({**payload, "meta": meta}, indent=2, allow_nan=False) + "\n")
    return path


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Print (and return) a plain-text table; floats get 3 significant decimals."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "—" if not math.isfinite(v) else f"{v:+.3f}" if abs(v) < 10 else f"{v:.3g}"
        return "—" if v is None else str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def save_figure(fig, path: Path) -> Path:
    """Save a matplotlib figure as PNG and close it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


class Population:
    """A population of models spread over the ranks of a ``torchrun`` launch.

    Under ``torchrun`` (``WORLD_SIZE > 1``) the default process group is initialised here
    (gloo; destroyed on exit if created here): rank ``r`` handles the members
    ``r, r + world, …`` (:meth:`mine`), :meth:`gather` brings every member's record to every
    rank in population order, and only rank 0 reports (:attr:`is_reporter`). Without
    ``torchrun`` it is one rank holding everything.
    """

    def __init__(self):
        self.rank, self.world, self._created = 0, 1, False

    def __enter__(self) -> Population:
        dist = torch.distributed
        if under_torchrun() and dist.is_available():
            if not dist.is_initialized():
                dist.init_process_group("gloo")
                self._created = True
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        return self

    def __exit__(self, *exc) -> None:
        if self._created:
            if exc[0] is None:  # ranks meet before the teardown: torch 2.6's gloo can hang in it
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()

    @property
    def is_reporter(self) -> bool:
        return self.rank == 0

    def mine(self, n: int) -> list[int]:
        """Indices of the members this rank handles."""
        return list(range(self.rank, n, self.world))

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any], *, bar=None) -> list[Any]:
        """``[fn(item) for item in items]`` with the items split over the ranks (:meth:`mine`)
        and the results gathered on every rank; ``bar`` (a tqdm bar) advances per local item."""
        records = {}
        for k in self.mine(len(items)):
            records[k] = fn(items[k])
            if bar is not None:
                bar.update(1)
        return self.gather(records)

    def gather(self, records: dict[int, Any]) -> list[Any]:
        """``{index: record}`` of every rank merged, as a list in population order."""
        if self.world > 1:
            parts: list[Any] = [None] * self.world
            torch.distributed.all_gather_object(parts, records)
            records = {k: v for part in parts for k, v in part.items()}
        return [records[k] for k in sorted(records)]


def under_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` (or :func:`spawn`) launch."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def spawn(run: Callable[[argparse.Namespace], int], args: argparse.Namespace, workers: int) -> int:
    """Run ``run(args)`` in ``workers`` local processes that form a gloo process group, as
    ``torchrun --standalone --nproc_per_node workers`` would (a :class:`Population` splits the
    work; rank 0 reports). Returns 0, or raises if a worker failed."""
    import socket

    with socket.socket() as sock:  # a free port on the loopback interface
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spawn_processes(_worker, args=(run, args, workers, port), nprocs=workers)
    return 0


def _worker(rank: int, run, args: argparse.Namespace, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    run(args)
