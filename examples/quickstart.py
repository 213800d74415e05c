"""Quickstart: a GL(h) quotient of attention-like factors, in a dozen lines.

Builds the quotient of 12 heads of ``(G, H)`` pairs, projects the gradient of an invariant
loss to the horizontal space, takes a second-order geodesic step, and checks that the
Riemannian gradient norm does not change when the factors are re-parametrised by random
``A ∈ GL(h)`` while the Euclidean one does.
"""

import torch

from quotientgeo import GLQuotient

torch.manual_seed(0)
heads, n, m, h = 12, 33, 33, 8
manifold = GLQuotient(n, metric="mix")
x = manifold.random(heads, n + m, h, dtype=torch.float64)
target = torch.randn(heads, n, m, dtype=torch.float64)


def loss_and_grad(x):
    x = x.detach().requires_grad_()
    G, H = manifold.split(x)
    loss = (G @ H.mT - target).square().sum()
    return loss, torch.autograd.grad(loss, x)[0]


loss, egrad = loss_and_grad(x)
rgrad = manifold.egrad2rgrad(x, egrad)
step = manifold.expmap2(x, -1e-3 * rgrad)
print(f"loss {loss.item():.4f} -> {loss_and_grad(step)[0].item():.4f} after one geodesic step")

print(f"{'cond(A)':>10} {'Euclidean |grad|':>18} {'Riemannian |grad|':>18}")
for log_cond in range(0, 4):
    U, _, V = torch.linalg.svd(torch.randn(heads, h, h, dtype=torch.float64))
    A = U @ torch.diag_embed(torch.logspace(0, log_cond, h, dtype=torch.float64)) @ V
    y = manifold.act(x, A)
    _, egrad_y = loss_and_grad(y)
    rnorm = manifold.norm(y, manifold.egrad2rgrad(y, egrad_y)).square().sum().sqrt()
    print(f"{10**log_cond:>10.0e} {egrad_y.norm().item():>18.6f} {rnorm.item():>18.12f}")
