"""Reading and writing a chunk through its kept strided layout (``BlockChunk.read``/``write_``
by :class:`~quotientgeo.geometry.transfer.StackedLayout`) against the generic
:func:`~quotientgeo.geometry.transfer.gather_blocks` and :func:`write_blocks_`, bit for bit:
over today's families (grouped and multi-query heads, bias rows, fused projections, products),
random tensors, tensors that are views into one allocation (nonzero storage offsets, as the
weights that GeodesicSAM keeps), and a parameter whose strides change between calls (the
layout is found again, or the generic path taken)."""

from __future__ import annotations

import pytest
import torch
from tiny_families import FAMILIES, make

from quotientgeo.geometry import find_symmetries
from quotientgeo.geometry import perturbation as pt
from quotientgeo.geometry.transfer import gather_blocks, write_blocks_

# blocks that no layout takes: interleaved fused rows (BLOOM, GPT-NeoX, Falcon's new decoder
# architecture), a product kind or blocks of one layer (Whisper, Falcon with ALiBi)
GENERIC_ONLY = {"whisper", "bloom", "gpt_neox", "falcon_new_decoder", "falcon_alibi"}


def random_tensors(space: pt.Perturbations, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
        for name, t in space.local().items()
    }


def in_one_allocation(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(zip(tensors, pt.clone_together(list(tensors.values())), strict=True))


def check_chunks(space: pt.Perturbations, tensors: dict[str, torch.Tensor], seed: int) -> int:
    """Every chunk read and written both ways; the number of chunks that took a layout."""
    gen, dtype, laid = torch.Generator().manual_seed(seed), space.dtype, 0
    for chunk in space.all_chunks():
        expected = gather_blocks(chunk.plan, chunk.kind, chunk.blocks, tensors, dtype)
        got = chunk.read(tensors, dtype)
        assert got.dtype == expected.dtype and torch.equal(got, expected)
        points = torch.randn(expected.shape, generator=gen, dtype=torch.float64).to(dtype)
        a = {name: t.clone() for name, t in tensors.items()}
        b = {name: t.clone() for name, t in tensors.items()}
        chunk.write_(a, points)
        write_blocks_(chunk.plan, chunk.kind, chunk.blocks, points, b)
        assert all(torch.equal(a[name], b[name]) for name in tensors)
        laid += any(layout is not None for layout in chunk._layouts.values())
    return laid


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_layout_reads_and_writes_as_the_generic_path(family, metric):
    torch.manual_seed(0)
    model, _ = make(family)
    space = pt.Perturbations(find_symmetries(model, metric=metric), "second_order")
    for seed in range(2):
        tensors = random_tensors(space, seed)
        laid = check_chunks(space, tensors, seed)
        check_chunks(space, in_one_allocation(tensors), seed + 10)
    # where layers are congruent the layout is taken, not only found
    assert (laid == 0) == (family in GENERIC_ONLY)


@pytest.mark.filterwarnings("ignore:the model has torch.bfloat16 parameters")
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_half_precision_parameters_read_generically_and_write_through_the_layout(family):
    """bfloat16 parameters, float32 points: reads convert (the generic path), writes cast
    through the layout, each as the generic path does."""
    model, _ = make(family)
    space = pt.Perturbations(
        find_symmetries(model.to(torch.bfloat16), metric="mix"), "second_order"
    )
    assert space.dtype == torch.float32
    tensors = random_tensors(space, 7)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert check_chunks(space, tensors, 7) >= 1
    for chunk in space.all_chunks():
        assert all(layout is None or not layout.same_dtype for layout in chunk._layouts.values())


def test_changed_strides_find_the_layout_again():
    """A parameter made non-contiguous between two reads (same shape, other strides) is read
    and written right: by a layout of its own, or by the generic path."""
    model, _ = make("gpt2")
    space = pt.Perturbations(find_symmetries(model, metric="mix"), "second_order")
    tensors = random_tensors(space, 3)
    check_chunks(space, tensors, 3)
    name = next(n for chunk in space.all_chunks() for n in chunk.params if tensors[n].dim() == 2)
    t = tensors[name]
    tensors[name] = t.mT.contiguous().mT  # same values, transposed strides
    assert not tensors[name].is_contiguous()
    check_chunks(space, tensors, 4)
    check_chunks(space, in_one_allocation(tensors), 5)


def test_layout_rejects_points_of_another_shape():
    model, _ = make("gpt2")
    space = pt.Perturbations(find_symmetries(model, metric="mix"), "second_order")
    tensors = random_tensors(space, 6)
    chunk = next(iter(space.all_chunks()))
    chunk.read(tensors, space.dtype)
    layout = next(v for v in chunk._layouts.values() if v is not None)
    with pytest.raises(ValueError, match="contiguous of shape"):
        layout.read(tensors, torch.empty(3, 2, dtype=space.dtype))
    points = chunk.read(tensors, space.dtype)
    with pytest.raises(ValueError, match="contiguous of shape"):
        layout.write_(points.mT.contiguous().mT, tensors)
