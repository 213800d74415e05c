"""Command-line options shared by the benchmarks that time a transformer classifier."""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from ..sharpness.apgd import checkpoints


def add_model_arguments(
    parser: argparse.ArgumentParser,
    *,
    layers: int,
    d: int,
    heads: int,
    seq: int,
    batch: int,
    rounds: int,
) -> None:
    """``--json --layers --d --heads --seq --batch --rounds --device --threads``."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--d", type=int, default=d, help="model width")
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds (medians)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")


def run_config(args: argparse.Namespace, *names: str) -> dict[str, object]:
    """The options ``names`` of ``args`` and the machine they ran on (for the JSON output)."""
    return {
        **{name: getattr(args, name) for name in names},
        "device": str(args.device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }


def window_checkpoints(short: int, long: int) -> dict[str, int]:
    """Auto-PGD's checkpoints in runs of ``short`` and ``long`` iterations, whose difference is
    a benchmark's window; a note on stderr where they differ (a restart at a checkpoint costs
    a forward pass, which the window then counts as the extra iterations' cost)."""
    counts = {"short": len(checkpoints(short)), "long": len(checkpoints(long))}
    if counts["short"] != counts["long"]:
        print(
            f"note: the runs of {short} and {long} iterations have {counts['short']} and "
            f"{counts['long']} Auto-PGD checkpoints: their restarts' extra forward passes "
            "count against the extra iterations",
            file=sys.stderr,
        )
    return counts
