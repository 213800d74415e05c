"""Geodesic sharpness (or the top Hessian eigenvalue) of a 1.1B-parameter Llama-style decoder in
bfloat16, on one CPU machine.

The model has TinyLlama-1.1B's configuration (22 layers, width 2048, 32 query heads sharing 4
key/value heads, rotary embeddings, vocabulary 32000) with random weights, built in bfloat16.
Discovery finds its symmetries (the rotary subgroup of GL(64) on the query/key pairs,
GL(64) on the grouped value/output pairs); the measure runs on one batch of random tokens.

The script prints the wall time and the peak resident memory of one forward+backward pass
(the floor) and of the measurement, and the measurement's peak above the floor in copies of
the parameters (the maximiser keeps 3: the starting weights, the previous and the best iterate;
the current iterate of the symmetric blocks is parked in their weights once the backward pass
has their gradients). Linux only (it reads ``/proc/self/status``).

With ``--curvature`` it computes instead the largest eigenvalue of the Riemannian Hessian of the
same loss (finite-difference products and the lean Lanczos recurrence of
``hessian_eigenvalues(method="lanczos_lean")``: two vectors of the model's size in float32) and
prints it with its residual bound, the products, the wall time and the process peaks of the
operator and of the solve; it does not start the solve where the machine has too little memory
available. ``--layers`` builds fewer decoder layers of the same width.

    python examples/llama_1b_sharpness.py            # 3 iterations (the quick form)
    python examples/llama_1b_sharpness.py --n-iter 20 --metric inv
    python examples/llama_1b_sharpness.py --curvature --max-iter 20 --layers 2
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import quotientgeo as qg
from quotientgeo.curvature import lanczos_extreme

TINYLLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


#: Vectors of the operator's size the solve adds to the operator's resident memory: ``v_j``,
#: ``v_{j-1}`` (which takes the product's output), and in each product the two bfloat16
#: gradients, half a vector each (3.1 measured with ``--layers 2``).
VECTORS_NEEDED = 3.5

#: ``mallopt``'s parameter number for the mmap threshold (glibc's ``malloc.h``).
M_MMAP_THRESHOLD = -3


def return_freed_memory() -> None:
    """Have glibc return every freed block of 1 MiB or more to the system at once.

    glibc serves a request from its heap unless it is larger than its mmap threshold, which
    starts at 128 KiB and rises (up to 32 MiB) to the size of each large block freed: after the
    first large tensors are freed, this model's parameter-sized tensors (1 to 23 MiB in
    bfloat16) come from the heap, and what they leave when freed stays resident, some 2 GiB
    here. A fixed threshold (``mallopt(M_MMAP_THRESHOLD, …)``, as the ``MALLOC_MMAP_THRESHOLD_``
    environment variable sets it) turns the adjustment off. No effect off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


def status(field: str) -> int:
    """A ``/proc/self/status`` size (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def peak_of(fn):
    """``(result, seconds, peak resident bytes of the process)`` while ``fn()`` runs.

    The whole process's peak, not the peak above the resident size at the start: memory that
    glibc kept from earlier work counts in the start and is reused, so an increase over the
    start depends on what ran before; two peaks of the same process compare alike."""
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from now
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0, status("VmHWM")


def available() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes: what the machine can still give."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable")


def curvature(args, model, loss_fn, ids, geometry, floor_peak: int, param_bytes: int) -> None:
    """The top eigenvalue of the Riemannian Hessian: the finite-difference operator, then the
    lean Lanczos recurrence on it, each with its wall time and process peak. Stops before the
    solve where the machine has less memory available than the solver's vectors
    (``VECTORS_NEEDED`` of the operator's size)."""
    hessian, seconds, peak = peak_of(
        lambda: qg.RiemannianHessian(
            model, loss_fn, [ids], symmetries=geometry, product="finite_difference", step=args.step
        )
    )
    vector = hessian.dim * hessian.dtype.itemsize
    resident = status("VmRSS")
    print(
        f"operator ({hessian.dim:,} coordinates, {vector / 2**30:.2f} GiB a {hessian.dtype} "
        f"vector): built in {seconds:.0f} s, process peak {peak / 2**30:.2f} GiB, resident "
        f"{resident / 2**30:.2f} GiB"
    )
    need, free = VECTORS_NEEDED * vector, available()
    if need > free:
        print(
            f"the solve needs about {need / 2**30:.1f} GiB more ({VECTORS_NEEDED} vectors: "
            f"v_j, v_(j-1) and the product's gradients and output); the machine has "
            f"{free / 2**30:.1f} GiB available: not started"
        )
        raise SystemExit(1)
    top, seconds, peak = peak_of(
        lambda: lanczos_extreme(hessian, tol=args.tol, max_iter=args.max_iter, seed=0)
    )
    print(
        f"top Hessian eigenvalue ({args.metric}, finite differences, step "
        f"{'default' if args.step is None else args.step}, lean "
        f"Lanczos): {top.value:.6g} ± {top.residual_bound:.3g} (residual bound, "
        f"{top.residual_bound / abs(top.value):.2g} relative), {top.iterations} products "
        f"({'converged' if top.converged else 'not converged'} at tol {args.tol}), base loss "
        f"{hessian.loss:.4f}, in {seconds:.0f} s, process peak {peak / 2**30:.2f} GiB, "
        f"{(peak - floor_peak) / param_bytes:.2f} parameter copies above the floor"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-iter", type=int, default=3, help="Auto-PGD iterations")
    parser.add_argument("--metric", default="mix", choices=["mix", "inv"])
    parser.add_argument("--rho", type=float, default=0.05)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=22, help="decoder layers (TinyLlama: 22)")
    parser.add_argument("--curvature", action="store_true", help="the top Hessian eigenvalue")
    parser.add_argument("--max-iter", type=int, default=20, help="Lanczos products (--curvature)")
    parser.add_argument("--tol", type=float, default=1e-3, help="Lanczos tolerance (--curvature)")
    parser.add_argument(
        "--step",
        type=float,
        default=None,
        help="finite-difference relative step (default: the operator's, 2.5e-2 for bfloat16)",
    )
    args = parser.parse_args()
    return_freed_memory()

    t0 = time.perf_counter()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(**{**TINYLLAMA_1B, "num_hidden_layers": args.layers})
    model = LlamaForCausalLM._from_config(config, torch_dtype=dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (args.batch, args.seq), generator=generator)
    print(f"{n_params / 1e9:.2f}B parameters in {args.dtype} ({param_bytes / 2**30:.2f} GiB), "
          f"built in {time.perf_counter() - t0:.0f} s")  # fmt: skip

    def loss_fn(model, batch):
        return model(input_ids=batch, labels=batch).loss

    geometry = qg.find_symmetries(model).with_metric(args.metric)
    print(geometry.summary())

    def floor():
        loss_fn(model, ids).backward()
        model.zero_grad(set_to_none=True)

    _, floor_s, floor_peak = peak_of(floor)
    print(f"floor (forward+backward): {floor_s:.0f} s, process peak {floor_peak / 2**30:.2f} GiB")
    if args.curvature:
        curvature(args, model, loss_fn, ids, geometry, floor_peak, param_bytes)
        return
    result, seconds, peak = peak_of(
        lambda: qg.geodesic_sharpness(
            model, loss_fn, [ids], rho=args.rho, symmetries=geometry, n_iter=args.n_iter
        )
    )
    print(
        f"geodesic sharpness ({args.metric}, ρ = {args.rho}, {args.n_iter} iterations): "
        f"{result.value:.4g} (base loss {result.base_losses[0]:.4f}) in {seconds:.0f} s, "
        f"process peak {peak / 2**30:.2f} GiB, {(peak - floor_peak) / param_bytes:.2f} parameter "
        "copies above the floor"
    )


if __name__ == "__main__":
    main()
