"""Define a new symmetry from scratch and train on its quotient with a geoopt optimizer.

ReLU networks are positively homogeneous: scaling the incoming weights of a hidden unit by
``a > 0`` and its outgoing weights by ``1 / a`` leaves the network unchanged. Three methods
(Lie-algebra shape, infinitesimal action, metric) define the quotient geometry; the base class
derives projection, Riemannian gradient, Christoffel symbols and exponential maps.
"""

import geoopt
import torch

from quotientgeo import QuotientManifold


class ReLURescale(QuotientManifold):
    """Row i of ``x = [W1 | W2ᵀ]`` is hidden unit i of ``relu(X W1ᵀ) W2ᵀ``.

    Action ``(a W1_i, W2_i / a)``, ``a > 0``; vertical ``ω_i (W1_i, -W2_i)``; invariant metric
    ``Σ_i |η_{1i}|² / |W1_i|² + |η_{2i}|² / |W2_i|²``.
    """

    def __init__(self, d_in: int):
        super().__init__()
        self.d_in = d_in

    def lie_shape(self, x):
        return (x.shape[-2],)  # one scale per hidden unit

    def vertical(self, x, omega):
        return omega[..., None] * torch.cat([x[..., : self.d_in], -x[..., self.d_in :]], -1)

    def metric(self, x, u):
        return u / self.sq_norms(x)

    def metric_inv(self, x, v):  # optional: otherwise conjugate gradients on metric
        return v * self.sq_norms(x)

    def sq_norms(self, x):  # |W1_i|² on the W1 entries of row i, |W2_i|² on its W2 entries
        w1, w2 = x[..., : self.d_in], x[..., self.d_in :]
        sq = lambda t: t.square().sum(-1, keepdim=True).expand_as(t)  # noqa: E731
        return torch.cat([sq(w1), sq(w2)], dim=-1)


torch.manual_seed(0)
d_in, hidden = 5, 16
X = torch.randn(256, d_in, dtype=torch.float64)
Y = torch.relu(X @ torch.randn(4, d_in, dtype=X.dtype).T).sum(-1, keepdim=True)  # teacher
m = ReLURescale(d_in)
x = geoopt.ManifoldParameter(torch.randn(hidden, d_in + 1, dtype=X.dtype) / 2, manifold=m)


def loss_fn(x):
    return (torch.relu(X @ x[:, :d_in].T) @ x[:, d_in:] - Y).square().mean()


opt = geoopt.optim.RiemannianSGD([x], lr=0.05)
for step in range(151):
    opt.zero_grad()
    loss = loss_fn(x)
    loss.backward()
    opt.step()
    if step % 50 == 0:
        print(f"step {step:3d}  loss {loss.item():.5f}")

# Rescale every hidden unit at random: same function, different Euclidean gradient norm,
# same Riemannian gradient norm (the metric and the horizontal space see the quotient).
a = torch.exp(2 * torch.randn(hidden, 1, dtype=X.dtype))
rescaled = x.detach() * torch.cat([a.expand(-1, d_in), 1 / a], dim=-1)
for name, p in [("trained", x.detach()), ("rescaled", rescaled)]:
    p = p.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss_fn(p), p)
    rgrad = m.egrad2rgrad(p, g)
    print(
        f"{name:8s}  loss {loss_fn(p).item():.6f}  |grad|_euclidean {g.norm().item():.4f}  "
        f"|grad|_riemannian {m.norm(p, rgrad).item():.4f}"
    )
