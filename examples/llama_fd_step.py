"""How accurate is the finite-difference top Hessian eigenvalue of a bfloat16 Llama?

The step is relative (``RiemannianHessian``'s ``step``: no kind of symmetry blocks and no
parameter of the adaptive rest moves by more than ``step`` of its largest entry); ``None`` is
the default, ``ε^{1/3} / 8`` of the coarser of the coordinates' and the parameters' dtypes.

A small Llama-style decoder (the 1.1B example's architecture: rotary attention with grouped
key/value heads, RMSNorm, SwiGLU; vocabulary 1000) with random weights in bfloat16, one batch of
128 random tokens, the quotient metric "mix". The reference is the top eigenvalue of a float64
copy of the same weights by double backward (tol 1e-10). Each line gives the top eigenvalue
by ``hessian_eigenvalues(method="lanczos_lean", tol=1e-4, max_iter=40)``: by double backward in
bfloat16, then by the finite difference at each relative step, in bfloat16 and in a float32 copy
of the same weights, with its relative error and residual bound.

With ``--products`` it prints instead, per step, the relative error of single products
``A z`` by finite differences (float32 and float64 copies of the weights) against double
backward in float64, along the top eigenvector (where truncation dominates) and along a random
unit vector (where rounding does).

    python examples/llama_fd_step.py --width 128 --layers 2 --seed 0
    python examples/llama_fd_step.py --width 128 --layers 2 --seed 0 --products
"""

from __future__ import annotations

import argparse
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import quotientgeo as qg

STEPS = (1e-4, 3e-4, None, 1e-3, 3e-3, 1e-2, 3e-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--products", action="store_true", help="errors of single products")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the bfloat16 note, Lanczos' unconverged runs
    width, seed = args.width, args.seed
    config = LlamaConfig(
        hidden_size=width,
        intermediate_size=int(width * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=width // 16,
        num_key_value_heads=max(1, width // 64),
        vocab_size=1000,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)

    def build(dtype):
        return LlamaForCausalLM._from_config(
            config, torch_dtype=dtype, attn_implementation="eager"
        ).eval()

    base = build(torch.bfloat16)
    ids = torch.randint(0, 1000, (1, 128), generator=torch.Generator().manual_seed(seed + 1))

    def loss_fn(m, b):
        return m(input_ids=b, labels=b).loss

    def copy(dtype):
        m = build(dtype)
        m.load_state_dict({k: v.to(dtype) for k, v in base.state_dict().items()})
        return m

    if args.products:
        products(copy, loss_fn, [ids])
        return
    kw = dict(metric="mix", k=1, method="lanczos_lean", progress=False)
    ref = qg.hessian_eigenvalues(copy(torch.float64), loss_fn, [ids], tol=1e-10, max_iter=200, **kw)
    lam = ref.values[0]
    print(
        f"width {width} layers {args.layers} seed {seed}: float64 double backward λ_max {lam:.8g}"
    )

    def line(label, r):
        value = r.values[0]
        print(
            f"  {label}: {value:.6g} rel.err {(value - lam) / lam:+.1e} "
            f"bound {r.residual_bound:.1e} it {r.products}",
            flush=True,
        )

    line(
        "bf16 double backward",
        qg.hessian_eigenvalues(base, loss_fn, [ids], tol=1e-4, max_iter=40, **kw),
    )
    f32 = copy(torch.float32)
    for step in STEPS:
        for name, m in (("bf16", base), ("float32", f32)):
            r = qg.hessian_eigenvalues(
                m, loss_fn, [ids], tol=1e-4, max_iter=40, product="finite_difference", step=step,
                **kw,
            )  # fmt: skip
            line(f"step {step}: {name} FD", r)


def products(copy, loss_fn, batches) -> None:
    """Relative errors ``‖A_fd z - A z‖ / ‖A z‖`` of single products per step (module
    docstring)."""
    from scipy.sparse.linalg import eigsh

    exact = qg.RiemannianHessian(copy(torch.float64), loss_fn, batches, metric="mix")
    values, vectors = eigsh(exact.to_scipy(), k=1, which="LA", tol=1e-8)
    probe = torch.randn(exact.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    directions = {"top": torch.from_numpy(vectors[:, 0]), "random": probe / probe.norm()}
    references = {name: exact @ z for name, z in directions.items()}
    print(f"float64 double backward: λ_max {values[0]:.8g}, dimension {exact.dim}")
    models = {"float32": copy(torch.float32), "float64": copy(torch.float64)}
    for step in (1e-5, 3e-5, 1e-4, 3e-4, None, 1e-3, 3e-3, 1e-2):
        cells = []
        for name, model in models.items():
            fd = qg.RiemannianHessian(
                model, loss_fn, batches, metric="mix", product="finite_difference", step=step
            )
            for direction, z in directions.items():
                y = (fd @ z.to(fd.dtype)).double()
                r = references[direction]
                cells.append(f"{name} {direction} {float((y - r).norm() / r.norm()):.1e}")
        print(f"  step {step}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
