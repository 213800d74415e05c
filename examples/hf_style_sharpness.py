"""Geodesic sharpness of a Hugging Face-style model (a tiny BERT built from a config).

``find_symmetries`` maps BERT's ``query``/``key``/``value`` + ``attention.output.dense`` onto one
GL(h) pair per head for QK and for VO; every other weight stays in the adaptive geometry.
Nothing is downloaded: the model is randomly initialised from a small config and briefly
fitted to a synthetic sequence-classification task so that it sits near a minimum.

    python examples/hf_style_sharpness.py
"""

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForSequenceClassification

from quotientgeo import adaptive_sharpness, find_symmetries, geodesic_sharpness

torch.manual_seed(0)
config = BertConfig(
    vocab_size=50,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=16,
    num_labels=2,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
model = BertForSequenceClassification(config)

# synthetic task: is token 7 in the sequence?
ids = torch.randint(0, 50, (256, 12))
labels = (ids == 7).any(1).long()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
for _ in range(100):
    loss = F.cross_entropy(model(input_ids=ids).logits, labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
model.eval()


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(input_ids=x).logits, y)


print(find_symmetries(model).summary())
batches = [(ids[:128], labels[:128]), (ids[128:], labels[128:])]
kw = dict(rho=0.1, n_iter=20, progress=False)
print(f"adaptive sharpness      {adaptive_sharpness(model, loss_fn, batches, **kw).value:.4g}")
for metric in ("inv", "mix"):
    result = geodesic_sharpness(model, loss_fn, batches, metric=metric, **kw)
    print(f"geodesic sharpness {metric}  {result.value:.4g}  ({result.wall_time:.1f} s)")
