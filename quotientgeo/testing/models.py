"""A tiny transformer classifier, its loss and random data, and a tiny Hugging Face BERT, for
tests, examples and docs."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor

__all__ = ["TinyTransformerClassifier", "cross_entropy", "random_batches", "tiny_bert"]


class TinyTransformerClassifier(nn.Module):
    """``nn.TransformerEncoder`` (``layers`` × ``heads`` heads of width ``d / heads``, feed-forward
    width ``dim_feedforward``, default ``2d``), mean pooling over the sequence and a linear
    head: inputs ``(batch, seq, d)``, logits ``(batch, classes)``."""

    def __init__(
        self,
        d: int = 32,
        heads: int = 4,
        layers: int = 2,
        classes: int = 3,
        *,
        dim_feedforward: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d, heads, dim_feedforward or 2 * d, dropout=dropout, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x).mean(dim=1))


def cross_entropy(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """``loss_fn(model, (x, y))`` of a classifier: mean cross-entropy."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def random_batches(
    n: int,
    *,
    batch: int = 16,
    seq: int = 8,
    d: int = 32,
    classes: int = 3,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> list[tuple[Tensor, Tensor]]:
    """``n`` batches of Gaussian inputs ``(batch, seq, d)`` and uniform labels."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, seq, d, generator=gen, dtype=dtype),
            torch.randint(0, classes, (batch,), generator=gen),
        )
        for _ in range(n)
    ]


def tiny_bert(dtype: torch.dtype = torch.float64, **overrides) -> nn.Module:
    """A 2-layer, 4-head, width-16 ``transformers.BertModel`` (eager attention, vocabulary 40,
    at most 12 positions) in eval mode, initialised from seed 0 and cast to ``dtype``.

    Needs Hugging Face transformers (raises ``ImportError`` without it); ``overrides`` go
    to ``BertConfig``.
    """
    import transformers

    settings: dict[str, Any] = dict(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=24,
        max_position_embeddings=12,
        attn_implementation="eager",
    )
    config = transformers.BertConfig(**{**settings, **overrides})
    torch.manual_seed(0)
    model = cast(nn.Module, transformers.BertModel(config))
    return model.to(dtype).eval()
