"""Shared plumbing of the reproduction commands: options, output folder, JSON, tables, Kendall τ."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Population",
    "add_common_arguments",
    "finite_or_none",
    "kendall",
    "out_dir",
    "print_table",
    "progress",
    "save_figure",
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
    """A tqdm bar over ``iterable`` that ``--no-progress`` silences."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=args.no_progress, dynamic_ncols=True)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run torch on at most ``n`` intra-op threads (tiny tensors: one thread is fastest)."""
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, min(n, old)))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def kendall(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Kendall τ-b of ``x`` and ``y`` and its two-sided p-value (:func:`scipy.stats.kendalltau`)."""
    from scipy.stats import kendalltau

    res = kendalltau(x, y)
    return float(res.statistic), float(res.pvalue)


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
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_available():
            if not dist.is_initialized():
                dist.init_process_group("gloo")
                self._created = True
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        return self

    def __exit__(self, *exc) -> None:
        if self._created:
            torch.distributed.destroy_process_group()

    @property
    def is_reporter(self) -> bool:
        return self.rank == 0

    def mine(self, n: int) -> list[int]:
        """Indices of the members this rank handles."""
        return list(range(self.rank, n, self.world))

    def gather(self, records: dict[int, Any]) -> list[Any]:
        """``{index: record}`` of every rank merged, as a list in population order."""
        if self.world > 1:
            parts: list[Any] = [None] * self.world
            torch.distributed.all_gather_object(parts, records)
            records = {k: v for part in parts for k, v in part.items()}
        return [records[k] for k in sorted(records)]
