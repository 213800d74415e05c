"""``quotientgeo bench projection``: horizontal projection of a BERT-base-sized stack of heads.

Contenders: a per-head loop of Gram matrices and ``scipy.linalg.solve_sylvester`` (what a user
writes without this library) against the batched ``GLQuotient`` projections, inv and mix, with
a fresh and with a cached base point (``m.at(x)``), and the mix projection of the rotary
subgroup (``RotaryGLQuotient``, closed form). ``--pieces`` also times every step of the
inv projection from scratch. All timings come from :func:`quotientgeo.bench.timing.interleaved`.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np
import torch

from quotientgeo.bench.timing import interleaved, median_ratio, medians
from quotientgeo.linalg import cholesky, gram, mT, solve_sylvester, sylvester_basis
from quotientgeo.manifolds import GLQuotient, RotaryGLQuotient


def allocator_setting() -> str:
    """Environment settings that change how large host tensors are allocated (or "default").

    Under glibc's defaults a fresh CPU tensor above the ``mmap`` threshold (at most 32 MB) is a
    new mapping whose first write page-faults; these settings avoid that (docs/benchmarks.md).
    """
    names = (
        "THP_MEM_ALLOC_ENABLE",
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TRIM_THRESHOLD_",
        "LD_PRELOAD",
    )
    found = [f"{name}={os.environ[name]}" for name in names if name in os.environ]
    return " ".join(found) or "default"


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def _scipy_projection_loop(x: np.ndarray, u: np.ndarray, n: int) -> np.ndarray:
    """What a user writes today: per head, Gram matrices and ``scipy.linalg.solve_sylvester``."""
    from scipy.linalg import solve_sylvester

    out = np.empty_like(u)
    for i in range(x.shape[0]):
        G, H, uG, uH = x[i, :n], x[i, n:], u[i, :n], u[i, n:]
        P, Q = G.T @ G, H.T @ H
        A = P @ Q
        Lam = solve_sylvester(A, A, P @ H.T @ uH - uG.T @ G @ Q).T
        out[i, :n] = uG + G @ Lam
        out[i, n:] = uH - H @ Lam.T
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", type=int, default=144, help="number of heads (batch)")
    parser.add_argument("--n", type=int, default=769, help="rows of G (and of H)")
    parser.add_argument("--h", type=int, default=64, help="head width")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument(
        "--rotary-dims",
        type=int,
        default=None,
        help="rotated coordinates of the rotary contender (default: all h)",
    )
    parser.add_argument(
        "--rounds", type=int, default=9, help="interleaved rounds (medians are reported)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--pieces", action="store_true", help="also time the pieces of the inv projection"
    )


CACHED_FLOOR_STEPS = (
    "right-hand side B (two reductions)",
    "solve in the eigenbasis",
    "shift u + x W into a reused tensor",
)


def _projection_pieces(m: GLQuotient, x: torch.Tensor, u: torch.Tensor, rounds: int):
    """Seconds of each step of the inv projection from scratch, and of a fresh allocation."""
    G, H = m.split(x)
    uG, uH = m.split(u)
    P, Q = gram(G), gram(H)
    L = cholesky(P)
    basis = sylvester_basis(P, Q, L)
    B = P @ (mT(H) @ uH) - mT(mT(G) @ uG) @ Q
    Lam = mT(solve_sylvester(basis, B))
    reused = torch.empty_like(u)
    a = torch.randn(2048, 2048, dtype=u.dtype)
    samples = interleaved(
        {
            "Gram matrices P, Q": lambda: (gram(G), gram(H)),
            "Cholesky of P and Q": lambda: (cholesky(P), cholesky(Q)),
            "Sylvester eigenbasis (eigh)": lambda: sylvester_basis(P, Q, L),
            "right-hand side B (two reductions)": lambda: P @ (mT(H) @ uH) - mT(mT(G) @ uG) @ Q,
            "solve in the eigenbasis": lambda: solve_sylvester(basis, B),
            "shift u + x W": lambda: m._blockwise(x, Lam, -mT(Lam), add=u),
            "shift u + x W into a reused tensor": lambda: m._blockwise(
                x, Lam, -mT(Lam), add=reused.copy_(u), into=True
            ),
            "first write of a fresh tensor of u's size": lambda: torch.empty_like(u).fill_(0),
            "write of a reused tensor of u's size": lambda: reused.fill_(0),
            "reference: one 2048 x 2048 matmul (17.2 GFLOP)": lambda: a @ a,
        },
        rounds=rounds,
    )
    return medians(samples)


def run(args: argparse.Namespace) -> int:
    """Horizontal projection of a BERT-base-sized stack: scipy loop vs batched inv/mix."""
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.heads, 2 * args.n, args.h, generator=gen, dtype=dtype)
    u = torch.randn(args.heads, 2 * args.n, args.h, generator=gen, dtype=dtype)
    inv, mix = GLQuotient(args.n, "inv"), GLQuotient(args.n, "mix")
    rotary = RotaryGLQuotient(args.n, "mix", rotary_dims=args.rotary_dims)
    x_np, u_np = x.numpy(), u.numpy()
    result: dict[str, Any] = {
        "heads": args.heads,
        "n": args.n,
        "m": args.n,
        "h": args.h,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "allocator": allocator_setting(),
        "rotary_dims": args.rotary_dims,
    }
    # caches fill in the untimed warm-up round
    inv_at, mix_at, rotary_at = inv.at(x), mix.at(x), rotary.at(x)
    samples = interleaved(
        {
            "scipy_loop_s": lambda: _scipy_projection_loop(x_np, u_np, args.n),
            "inv_s": lambda: inv.proju(x, u),
            "mix_s": lambda: mix.proju(x, u),
            "inv_cached_s": lambda: inv.proju(inv_at, u),
            "mix_cached_s": lambda: mix.proju(mix_at, u),
            "rotary_mix_s": lambda: rotary.proju(x, u),
            "rotary_mix_cached_s": lambda: rotary.proju(rotary_at, u),
        },
        rounds=args.rounds,
        # OpenBLAS worker threads keep spinning for a while after numpy's last call and
        # would steal the cores from the torch contender that runs next
        settle={"scipy_loop_s": 0.5},
    )
    result.update(medians(samples))
    result["speedup"] = median_ratio(samples["scipy_loop_s"], samples["inv_cached_s"])
    result["speedup_uncached"] = median_ratio(samples["scipy_loop_s"], samples["inv_s"])
    result["inv_cached_over_mix_cached"] = median_ratio(
        samples["inv_cached_s"], samples["mix_cached_s"]
    )
    result["rotary_mix_over_mix"] = median_ratio(samples["rotary_mix_s"], samples["mix_s"])
    result["rotary_mix_cached_over_mix_cached"] = median_ratio(
        samples["rotary_mix_cached_s"], samples["mix_cached_s"]
    )
    projected = inv.proju(inv_at, u)
    agreement = projected - torch.from_numpy(_scipy_projection_loop(x_np, u_np, args.n))
    result["max_rel_diff_vs_scipy"] = (agreement.norm() / projected.norm()).item()
    if args.pieces:
        pieces = result["pieces_s"] = _projection_pieces(inv, x, u, args.rounds)
        # what a cached projection would cost if writing its result never page-faulted
        result["cached_floor_s"] = sum(pieces[step] for step in CACHED_FLOOR_STEPS)
        result["scipy_over_cached_floor"] = result["scipy_loop_s"] / result["cached_floor_s"]
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"horizontal projection, {args.heads} heads, n = m = {args.n}, h = {args.h}, "
        f"{args.dtype}, {result['threads']} threads, allocator: {result['allocator']}"
    )
    print_table(
        [
            ("scipy loop (Gram + solve_sylvester per head)", f"{result['scipy_loop_s']:.4f} s"),
            ("inv, batched", f"{result['inv_s']:.4f} s"),
            ("mix, batched", f"{result['mix_s']:.4f} s"),
            ("inv, cached base point", f"{result['inv_cached_s']:.4f} s"),
            ("mix, cached base point", f"{result['mix_cached_s']:.4f} s"),
            ("rotary subgroup, mix, batched", f"{result['rotary_mix_s']:.4f} s"),
            ("rotary subgroup, mix, cached base point", f"{result['rotary_mix_cached_s']:.4f} s"),
            ("scipy / inv  (target >= 4)", f"{result['speedup_uncached']:.1f}x"),
            ("scipy / inv cached  (target >= 8)", f"{result['speedup']:.1f}x"),
            ("inv cached / mix cached  (<= 1.3)", f"{result['inv_cached_over_mix_cached']:.2f}"),
            ("rotary mix / mix", f"{result['rotary_mix_over_mix']:.2f}"),
            (
                "rotary mix cached / mix cached",
                f"{result['rotary_mix_cached_over_mix_cached']:.2f}",
            ),
            ("relative difference to scipy", f"{result['max_rel_diff_vs_scipy']:.1e}"),
        ]
    )
    if args.pieces:
        print("\npieces of the inv projection from scratch:")
        print_table([(name, f"{sec:.4f} s") for name, sec in result["pieces_s"].items()])
        print(
            f"cached projection without page faults ({' + '.join(CACHED_FLOOR_STEPS)}): "
            f"{result['cached_floor_s']:.4f} s; scipy / that: "
            f"{result['scipy_over_cached_floor']:.1f}x"
        )
    return 0
