"""Define a new symmetry from scratch, train on its quotient with geoopt, measure sharpness.

ReLU networks are positively homogeneous: scaling the incoming weights of a hidden unit by
``1 / a`` (``a > 0``) and its outgoing weights by ``a`` leaves the network unchanged. Three
methods (Lie-algebra shape, infinitesimal action, metric) define the quotient geometry; the
base class derives projection, Riemannian gradient, Christoffel symbols and exponential maps.
The same manifold is then declared on an ``nn.Module`` with ``ParameterGeometry.add`` and
measured by ``geodesic_sharpness``.
"""

import geoopt
import torch
from torch import nn

from quotientgeo import ParameterGeometry, QuotientManifold, Source, geodesic_sharpness
from quotientgeo.testing import moved_along_orbits


class ReLURescale(QuotientManifold):
    """Column i of ``x = [W1ᵀ; W2]`` ((d_in + d_out) × hidden) is hidden unit i of
    ``relu(X W1ᵀ) W2ᵀ``.

    Action ``(W1_i / a, a W2_i)``; vertical ``ω_i (-W1_i, W2_i)``; invariant metric
    ``Σ_i |η_{1i}|² / |W1_i|² + |η_{2i}|² / |W2_i|²``. Primitives receive the point ``p``
    (``p.x`` its tensor).
    """

    def __init__(self, d_in: int):
        super().__init__()
        self.d_in = d_in

    def lie_shape(self, p):
        return (p.x.shape[-1],)  # one scale per hidden unit

    def vertical(self, p, omega):
        w1, w2 = p.x[..., : self.d_in, :], p.x[..., self.d_in :, :]
        return omega[..., None, :] * torch.cat([-w1, w2], dim=-2)

    def metric(self, p, u):
        return u / self.sq_norms(p.x)

    def metric_inv(self, p, v):  # optional: otherwise conjugate gradients on metric
        return v * self.sq_norms(p.x)

    def act(self, x, a):  # a > 0 of shape (..., hidden)
        a = a[..., None, :]
        return torch.cat([x[..., : self.d_in, :] / a, x[..., self.d_in :, :] * a], dim=-2)

    def sq_norms(self, x):  # |W1_i|² on the W1 entries of unit i, |W2_i|² on its W2 entries
        w1, w2 = x[..., : self.d_in, :], x[..., self.d_in :, :]
        sq = lambda t: t.square().sum(-2, keepdim=True).expand_as(t)  # noqa: E731
        return torch.cat([sq(w1), sq(w2)], dim=-2)


torch.manual_seed(0)
d_in, hidden = 5, 16
X = torch.randn(256, d_in, dtype=torch.float64)
Y = torch.relu(X @ torch.randn(4, d_in, dtype=X.dtype).T).sum(-1, keepdim=True)  # teacher
m = ReLURescale(d_in)

# 1. Train on the quotient: the point is [W1ᵀ; W2], a geoopt ManifoldParameter.
x = geoopt.ManifoldParameter(torch.randn(d_in + 1, hidden, dtype=X.dtype) / 2, manifold=m)


def loss_fn(x):
    return (torch.relu(X @ x[:d_in]) @ x[d_in:].T - Y).square().mean()


opt = geoopt.optim.RiemannianSGD([x], lr=0.05)
for step in range(151):
    opt.zero_grad()
    loss = loss_fn(x)
    loss.backward()
    opt.step()
    if step % 50 == 0:
        print(f"step {step:3d}  loss {loss.item():.5f}")

# 2. The same symmetry on an nn.Module: fc1's rows and fc2's columns are the hidden units.
model = nn.Sequential(nn.Linear(d_in, hidden, bias=False), nn.ReLU(), nn.Linear(hidden, 1))
model.double()
with torch.no_grad():
    model[0].weight.copy_(x[:d_in].T)
    model[2].weight.copy_(x[d_in:])
    model[2].bias.zero_()


def units(module):
    geometry = ParameterGeometry(module)
    return geometry.add(m, "0.weight", Source("2.weight", axis=1), label="hidden units")


def mse(module, batch):
    return (module(batch[0]) - batch[1]).square().mean()


rescaled = moved_along_orbits(model, scale=1.0, seed=1, symmetries=units)  # a in [1/2, 2]
for name, net in [("trained", model), ("rescaled", rescaled)]:
    value = geodesic_sharpness(net, mse, [(X, Y)], rho=0.1, symmetries=units(net), progress=False)
    print(f"{name:8s}  geodesic sharpness {value.value:.6f}")

# 3. Same function, different Euclidean gradient norm, same Riemannian gradient norm (the
# metric and the horizontal space see the quotient).
for name, p in [
    ("trained", x.detach()),
    ("rescaled", m.act(x.detach(), torch.rand(hidden, dtype=X.dtype) + 0.5)),
]:
    p = p.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss_fn(p), p)
    rgrad = m.egrad2rgrad(p, g)
    print(
        f"{name:8s}  loss {loss_fn(p).item():.6f}  |grad|_euclidean {g.norm().item():.4f}  "
        f"|grad|_riemannian {m.norm(p, rgrad).item():.4f}"
    )
