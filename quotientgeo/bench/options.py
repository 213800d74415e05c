"""Command-line options shared by the benchmarks that time a transformer classifier."""

from __future__ import annotations

import argparse
import platform

import torch


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
