"""How accurate is the finite-difference top Hessian eigenvalue of a bfloat16 Llama?

A small Llama-style decoder (the 1.1B example's architecture: rotary attention with grouped
key/value heads, RMSNorm, SwiGLU; vocabulary 1000) with random weights in bfloat16, one batch of
128 random tokens, the quotient metric "mix". The reference is the top eigenvalue of a float64
copy of the same weights by double backward (tol 1e-10). Each line gives the top eigenvalue
by ``hessian_eigenvalues(method="lanczos_lean", tol=1e-4, max_iter=40)``: by double backward in
bfloat16, then by the finite difference at each relative step, in bfloat16 and in a float32 copy
of the same weights, with its relative error and residual bound.

    python examples/llama_fd_step.py --width 128 --layers 2 --seed 0
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


if __name__ == "__main__":
    main()
