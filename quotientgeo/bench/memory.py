r"""``quotientgeo bench memory``: peak memory of every measure against one forward+backward.

The model is a GPT-2-sized decoder (Hugging Face ``GPT2LMHeadModel`` from a configuration,
random weights; default 12 layers, width 768, 12 heads, vocabulary 50257: 124M parameters) on
one batch of ``batch × seq`` random tokens with the language-modelling loss. Contenders:

- ``floor``: one forward pass and ``loss.backward()`` (the gradients stay allocated);
- ``adaptive``, ``geodesic_mix`` (second-order map), ``geodesic_inv`` (second-order map),
  ``geodesic_inv_exact`` (the closed-form inv geodesic): ``n_iter`` Auto-PGD iterations (a
  run peaks at its worst step, and on the CPU the best iterate needs a buffer of its own only at
  a step after two that did not improve it: the default 3 iterations have no such step on this
  model, 30 do);
- ``average``: ``n_samples`` random directions;
- ``hvp_double_backward``, ``hvp_finite_difference`` (only where ``--only`` names them): the
  Riemannian Hessian (:class:`~quotientgeo.curvature.RiemannianHessian`) built and one
  product ``H @ z`` at a random ``z``.

Each is reported as its peak in bytes, and as parameter copies above the floor:
``(peak − floor peak) / parameter bytes``, the parameter bytes counted in the parameters' own
dtype. On the CPU every contender runs in a process of its own (this command again, with
``--contender``): the model is built, the peak resident set size is reset
(``/proc/self/clear_refs``), the contender runs, and its peak (``VmHWM``) above the resident
size at the reset is its peak. glibc is told to return every freed block of 64 KiB or more to
the system (``MALLOC_MMAP_THRESHOLD_``), so that the resident size follows the live tensors.
The contender then runs once more in the same process, for the bytes that torch's allocator
holds at its peak above the start (``allocated``, :func:`allocated_peak`): the tensors alone,
without the allocator's slack or the interpreter, and without the first run's one-time work
(compilation, lazily built tables). On CUDA the contenders run in this process and
``torch.cuda.max_memory_allocated`` above the allocation at the start is the peak, both the
resident and the allocated one. With ``--shard N`` the model is sharded with FSDP2
(``fully_shard`` per transformer block and at the root) over ``N`` processes started by
``torchrun``, each passing the same batch; the peak is the largest of the ranks', and the copies
stay counted in copies of the whole model's parameters (a rank holds ``1/N`` of each).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ..sharpness import Measure
from .options import run_config

RHO = 0.05
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def measures(n_iter: int, n_samples: int) -> dict[str, Measure]:
    """The measured contenders (the floor aside)."""
    return {
        "adaptive": Measure.adaptive(RHO, n_iter=n_iter),
        "geodesic_mix": Measure.geodesic(RHO, metric="mix", n_iter=n_iter),
        "geodesic_inv": Measure.geodesic(
            RHO, metric="inv", perturbation="second_order", n_iter=n_iter
        ),
        "geodesic_inv_exact": Measure.geodesic(
            RHO, metric="inv", perturbation="exact", n_iter=n_iter
        ),
        "average": Measure.average(RHO, n_samples=n_samples),
    }


#: One Hessian-vector product ``H @ z`` of the Riemannian Hessian (:mod:`quotientgeo.curvature`)
#: at a random ``z``, construction (the gradient at the weights) included, per ``product``;
#: run only when ``--only`` names them.
PRODUCTS = {"hvp_double_backward": "double_backward", "hvp_finite_difference": "finite_difference"}

CONTENDERS = ("floor", *measures(1, 1), *PRODUCTS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d", "--width", dest="d", type=int, default=768, help="model width")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary size")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--n-iter", type=int, default=3, help="Auto-PGD iterations")
    parser.add_argument("--n-samples", type=int, default=3, help="samples of average sharpness")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the measures with compile=True (the adaptive rest's Gram pass compiled)",
    )
    parser.add_argument(
        "--only", nargs="+", choices=CONTENDERS, default=None, help="contenders to run"
    )
    parser.add_argument(
        "--shard",
        type=int,
        default=1,
        help="shard the model with FSDP2 over this many processes (torchrun; gloo on the CPU, "
        "nccl on CUDA) and report the largest peak of a rank",
    )
    parser.add_argument(
        "--contender",
        choices=CONTENDERS,
        default=None,
        help="run this one contender in this process and print its peak as JSON",
    )


def build(args: argparse.Namespace):
    """``(model, loss_fn, batch)``: the decoder in ``--dtype`` on ``--device`` and one batch."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as err:  # pragma: no cover - the [transformers] extra
        raise SystemExit(
            "bench memory builds a GPT-2-sized decoder with transformers: "
            "pip install 'quotientgeo[transformers]'"
        ) from err
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=args.layers,
        n_embd=args.d,
        n_head=args.heads,
        vocab_size=args.vocab,
        n_positions=max(args.seq, 8),
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
    )
    # built on its device (a billion random weights initialise in seconds on a GPU);
    # transformers' decorated __init__ reads to type checkers as an unbound method
    with torch.device(args.device):
        model: nn.Module = cast(Any, GPT2LMHeadModel)(config)
    model = model.to(dtype=DTYPES[args.dtype]).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)

    def loss_fn(model, batch):
        return model(input_ids=batch, labels=batch).loss

    return model, loss_fn, ids


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the trainable parameters, each counted once, in their own dtypes."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def contender(name: str, args: argparse.Namespace, model, loss_fn, batch) -> Callable[[], object]:
    if name == "floor":
        return lambda: loss_fn(model, batch).backward()
    if name in PRODUCTS:
        return lambda: hessian_vector_product(model, loss_fn, batch, PRODUCTS[name])
    measure = measures(args.n_iter, args.n_samples)[name]
    return lambda: measure.evaluate(model, loss_fn, [batch], progress=False, compile=args.compile)


def hessian_vector_product(model, loss_fn, batch, product: str) -> torch.Tensor:
    """``H @ z`` of the Riemannian Hessian of ``loss_fn`` on ``batch`` (``product`` as
    :class:`~quotientgeo.curvature.RiemannianHessian` takes it) at a random whitened ``z``."""
    from ..curvature import RiemannianHessian

    H = RiemannianHessian(model, loss_fn, [batch], product=product)
    z = torch.randn(H.dim, generator=torch.Generator().manual_seed(0)).to(H.dtype)
    return H @ z.to(H.device)


# ---------------------------------------------------------------------- the CPU: one process each
def _status(field: str) -> int:
    """A ``/proc/self/status`` size field (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _sharded(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """``model`` sharded with FSDP2 over the ranks of a process group started here (one
    ``fully_shard`` per transformer block and one at the root)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    backend = "gloo" if args.device == "cpu" else "nccl"
    dist.init_process_group(backend)
    if args.device != "cpu":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        model = model.to(f"cuda:{torch.cuda.current_device()}")
    for block in cast(nn.ModuleList, model.get_submodule("transformer.h")):
        fully_shard(block)
    fully_shard(model)
    return model


def _run_here(args: argparse.Namespace) -> dict[str, int]:
    """Build the model, reset the peak, run ``args.contender``: its peak above the start (the
    largest over the ranks where sharded)."""
    gc.collect()  # nothing of an earlier contender in this process may be freed during this one
    model, loss_fn, batch = build(args)
    if args.shard > 1:
        model = _sharded(model, args)
        batch = batch.to(next(model.parameters()).device)
    fn = contender(args.contender, args, model, loss_fn, batch)
    if args.device == "cpu":
        Path("/proc/self/clear_refs").write_text("5")  # the peak RSS restarts from now
        start = _status("VmRSS")
        fn()
        peak = _status("VmHWM") - start
        model.zero_grad(set_to_none=True)  # the floor's gradients: allocated again, and counted
        gc.collect()
        allocated = allocated_peak(fn)
    else:
        device = torch.device(args.device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        peak = allocated = torch.cuda.max_memory_allocated(device) - start
    out: dict[str, Any] = {
        "peak_bytes": peak,
        "allocated_bytes": allocated,
        "parameter_bytes": parameter_bytes(model),
    }
    if args.shard > 1:
        import torch.distributed as dist

        peaks: list = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, (peak, allocated))
        out["peak_bytes"] = max(p for p, _ in peaks)
        out["allocated_bytes"] = max(a for _, a in peaks)
        out["rank_peaks"] = [p for p, _ in peaks]
        out["rank_allocated"] = [a for _, a in peaks]
        dist.destroy_process_group()
    return out


def allocated_peak(fn: Callable[[], object]) -> int:
    """The most bytes that torch's CPU allocator holds while ``fn()`` runs, above what it held
    at the start: the CPU's counterpart of ``torch.cuda.max_memory_allocated``, as the running
    sum of the allocator's events that ``torch.profiler`` records (``profile_memory=True``),
    in the order they happened. The allocator reports no free of a block allocated before the
    start, so a contender that frees such a block is overstated, never understated."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events()  # pyright: ignore[reportOptionalMemberAccess]
    # (start, bytes) of each allocation (> 0) and free (< 0); the stubs lack ``nbytes``
    sizes = sorted(
        (e.start_ns(), e.nbytes())  # pyright: ignore[reportAttributeAccessIssue]
        for e in events
        if e.name() == "[memory]"
    )
    held = peak = 0
    for _, nbytes in sizes:
        held += nbytes
        peak = max(peak, held)
    return peak


def _run_child(name: str, argv: list[str], shard: int) -> dict[str, int]:
    """``name`` in a fresh process (this command with ``--contender name``), or in ``shard``
    processes started by ``torchrun``."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    command = [sys.executable]
    if shard > 1:
        command += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(shard)]
        argv = [*argv, "--shard", str(shard)]
    command += ["-m", "quotientgeo.cli", "bench", "memory", *argv]
    done = subprocess.run(
        [*command, "--contender", name], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"contender {name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _forwarded(args: argparse.Namespace) -> list[str]:
    """The options of this run, for the child processes (``--width``: torchrun would take
    ``--d`` for an abbreviation of one of its own options)."""
    argv = [
        "--layers", str(args.layers), "--width", str(args.d), "--heads", str(args.heads),
        "--vocab", str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch),
        "--dtype", args.dtype, "--n-iter", str(args.n_iter), "--n-samples", str(args.n_samples),
        "--device", args.device,
    ]  # fmt: skip
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.compile:
        argv.append("--compile")
    return argv


def run(args: argparse.Namespace) -> int:
    """Peak memory of every measure and of one forward+backward, in bytes and parameter copies."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.contender is not None:
        result = _run_here(args)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result))
        return 0
    default = [n for n in CONTENDERS[1:] if n not in PRODUCTS]
    names = [
        "floor",
        *(default if args.only is None else [n for n in CONTENDERS if n in args.only]),
    ]
    peaks: dict[str, dict[str, int]] = {}
    if args.device == "cpu":
        if not Path("/proc/self/clear_refs").exists():
            raise SystemExit("bench memory on the CPU reads /proc (Linux)")
        argv = _forwarded(args)
        for name in names:
            peaks[name] = _run_child(name, argv, args.shard)
    elif args.shard > 1:
        raise SystemExit("--shard on CUDA: run this command under torchrun with --contender")
    else:
        for name in names:
            args.contender = name
            peaks[name] = _run_here(args)
            torch.cuda.empty_cache()
        args.contender = None
    param_bytes = peaks["floor"]["parameter_bytes"]
    floor = peaks["floor"]["peak_bytes"]
    floor_allocated = peaks["floor"]["allocated_bytes"]
    rows = {
        name: {
            "peak_bytes": p["peak_bytes"],
            "above_floor_bytes": p["peak_bytes"] - floor,
            "copies_above_floor": (p["peak_bytes"] - floor) / param_bytes,
            "allocated_bytes": p["allocated_bytes"],
            "allocated_copies_above_floor": (p["allocated_bytes"] - floor_allocated) / param_bytes,
        }
        for name, p in peaks.items()
    }
    if args.shard > 1:
        for name, p in peaks.items():
            rows[name]["rank_peak_bytes"] = p["rank_peaks"]
            rows[name]["rank_allocated_bytes"] = p["rank_allocated"]
    out = {
        "parameter_bytes": param_bytes,
        "peaks": rows,
        "config": run_config(
            args,
            "layers",
            "d",
            "heads",
            "vocab",
            "seq",
            "batch",
            "dtype",
            "n_iter",
            "n_samples",
            "shard",
            "compile",
        ),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    cfg = out["config"]
    sharded = f", sharded over {args.shard} processes (largest rank)" if args.shard > 1 else ""
    print(
        f"peak memory, GPT-2-sized decoder ({cfg['layers']} layers, d={cfg['d']}, "
        f"{cfg['heads']} heads, {cfg['dtype']}, {param_bytes / 2**20:.0f} MiB of parameters), "
        f"batch {cfg['batch']}×{cfg['seq']}, {cfg['device']}{sharded}"
    )
    for name, row in rows.items():
        copies = ""
        if name != "floor":
            copies = (
                f"  {row['copies_above_floor']:+.3f} copies"
                f" (allocated {row['allocated_copies_above_floor']:+.3f})"
            )
        print(f"{name:>19}: {row['peak_bytes'] / 2**20:9.1f} MiB{copies}")
    return 0
