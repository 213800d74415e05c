"""The Hugging Face integration: SAMTrainer against a hand-written GeodesicSAM loop, the
sharpness callback and the plain-loop tracker against direct ``Measure.evaluate`` calls.

Tiny random BERT and GPT-2 sequence classifiers built from configs (nothing downloaded), in
float64 with dropout off, trained on the CPU:

- three SAMTrainer steps equal three steps of ``GeodesicSAM.first_step``/``second_step`` with
  the same AdamW, the same linear schedule and the same clipping, bit for bit;
- with gradient accumulation, one step over ``k`` micro-batches equals the hand-written step
  whose perturbation comes from the accumulated gradient (bit for bit), and the SAMTrainer
  step on one batch of ``k·b`` samples (to rounding), and differs from perturbing each
  micro-batch on its own;
- the logged values equal ``Measure.evaluate`` on the model at those steps, and the
  parameters after training are the same with and without the callback or tracker;
- bad ``sam=`` arguments raise when the trainer is built.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
    Trainer,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

from quotientgeo import Measure, SharpnessTracker  # noqa: E402
from quotientgeo.integrations.transformers import (  # noqa: E402
    SAMTrainer,
    SharpnessCallback,
    model_loss,
)
from quotientgeo.optim import GeodesicSAM  # noqa: E402

DT = torch.float64
VOCAB, SEQ = 30, 6
LR, CLIP = 3e-3, 0.5


def bert() -> torch.nn.Module:
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=24, max_position_embeddings=16, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def gpt2() -> torch.nn.Module:
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=16, num_labels=3,
        pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2ForSequenceClassification(config)


FAMILIES = {"bert": bert, "gpt2": gpt2}


def model_of(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return FAMILIES[family]().to(DT)


def samples(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=gen)  # no pad token (0) inside
    labels = torch.randint(0, 3, (n,), generator=gen)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def collate(chunk: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in chunk]) for k in chunk[0]}


def arguments(
    tmp_path, steps: int, batch: int, accumulation: int = 1, logging_steps: int = 1, **kw
) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no",
        max_steps=steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation, learning_rate=LR, weight_decay=0.0,
        optim="adamw_torch", lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=CLIP,
        train_sampling_strategy="sequential", logging_steps=logging_steps, disable_tqdm=True,
        seed=0, **kw,
    )  # fmt: skip


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


SAM = dict(rho=0.05, variant="geodesic", metric="inv")


def hand_loop(model, data, steps, batch, accumulation=1, sam=SAM):
    """GeodesicSAM with AdamW, the linear schedule and clipping, written out; the loss of a
    micro-batch scaled by 1/accumulation; the perturbation from the accumulated gradient."""
    opt = GeodesicSAM(model, torch.optim.AdamW, lr=LR, weight_decay=0.0, **sam)
    schedule = get_linear_schedule_with_warmup(opt.base_optimizer, 0, steps)
    model.train()
    micro = [collate(data[i : i + batch]) for i in range(0, len(data), batch)]
    for step in range(steps):
        window = micro[step * accumulation : (step + 1) * accumulation]
        for b in window:
            (model(**b).loss / accumulation).backward()
        opt.first_step(zero_grad=True)
        for b in window:
            (model(**b).loss / accumulation).backward()
        opt.restore()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.base_optimizer.step()
        schedule.step()
        opt.zero_grad()
    return params_of(model)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_three_steps_equal_the_hand_written_loop(family, tmp_path):
    model, data = model_of(family), samples(12)
    reference = hand_loop(copy.deepcopy(model), data, steps=3, batch=4)
    trainer = SAMTrainer(
        model=model, args=arguments(tmp_path, steps=3, batch=4), train_dataset=data, sam=SAM
    )
    trainer.train()
    assert_same(params_of(model), reference)
    start = params_of(model_of(family))
    assert any(not torch.equal(start[n], reference[n]) for n in start)  # it trained
    # the Trainer's optimizer is the plain AdamW; its groups carry rho; LR followed the schedule
    assert type(trainer.optimizer.optimizer) is torch.optim.AdamW  # accelerate's wrapper
    assert trainer.sam_optimizer is not None
    assert trainer.sam_optimizer.param_groups is trainer.sam_optimizer.base_optimizer.param_groups
    assert all(g["rho"] == SAM["rho"] for g in trainer.sam_optimizer.param_groups)
    logged = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert logged == pytest.approx([LR, LR * 2 / 3, LR / 3])


def test_sam_variant_equals_the_hand_written_loop(tmp_path):
    model, data = model_of("bert"), samples(8)
    sam = dict(rho=0.1, variant="sam")
    reference = hand_loop(copy.deepcopy(model), data, steps=2, batch=4, sam=sam)
    args = arguments(tmp_path, steps=2, batch=4)
    SAMTrainer(model=model, args=args, train_dataset=data, sam=sam).train()
    assert_same(params_of(model), reference)


def test_bf16_autocast_runs_both_passes(tmp_path):
    """bf16 mixed precision (accelerate's autocast around the forward): the float32 weights
    take the hand-written loop's steps with both passes under ``torch.autocast``, bit for bit."""
    torch.manual_seed(0)
    model, data = bert(), samples(8)  # float32 weights
    reference = copy.deepcopy(model)
    opt = GeodesicSAM(reference, torch.optim.AdamW, lr=LR, weight_decay=0.0, **SAM)
    schedule = get_linear_schedule_with_warmup(opt.base_optimizer, 0, 2)
    reference.train()
    for i in (0, 4):
        b = collate(data[i : i + 4])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = reference(**b).loss
        loss.backward()
        opt.first_step(zero_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = reference(**b).loss
        loss.backward()
        opt.restore()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        opt.base_optimizer.step()
        schedule.step()
        opt.zero_grad()
    args = arguments(tmp_path, steps=2, batch=4, bf16=True)
    trainer = SAMTrainer(model=model, args=args, train_dataset=data, sam=SAM)
    trainer.train()
    assert trainer.accelerator.mixed_precision == "bf16"
    assert next(model.parameters()).dtype == torch.float32
    assert_same(params_of(model), params_of(reference))


@pytest.mark.parametrize(("factor", "first_steps"), [(1.0, 2), (1e3, 0)])
def test_fp16_overflow_skips_the_step_with_the_weights_restored(factor, first_steps, tmp_path):
    """An overflow under a loss scaler: the scaler skips the step and halves its scale, the
    weights stay as they were. With the loss as it is, the float32 gradients at ``w`` are
    finite (max about 2.8e37 at scale 2^127) and only the second pass overflows: first_step
    runs and the weights are put back. With the loss times 1e3 the gradient at ``w`` overflows:
    no first_step and no second pass. (``accelerate`` makes a GradScaler for fp16 on GPUs
    only; here one is put in by hand.)"""
    torch.manual_seed(0)
    model, data = bert(), samples(8)  # float32
    start = params_of(model)

    def loss(outputs, labels, num_items_in_batch=None):
        return factor * torch.nn.functional.cross_entropy(outputs.logits, labels)

    trainer = SAMTrainer(
        model=model, args=arguments(tmp_path, 2, 4), train_dataset=data, sam=SAM,
        compute_loss_func=loss,
    )  # fmt: skip
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    trainer.create_optimizer()
    sam = trainer.sam_optimizer
    calls = []
    first_step = sam.first_step
    sam.first_step = lambda *a, **k: calls.append(1) or first_step(*a, **k)
    trainer.train()
    assert len(calls) == first_steps
    assert trainer.accelerator.scaler.get_scale() == 2.0**125  # halved at each skipped step
    assert_same(params_of(model), start)


def test_gradient_accumulation_perturbs_with_the_accumulated_gradient(tmp_path):
    """k micro-batches: the hand-written step from the accumulated gradient (bit for bit), the
    step of one batch of k·b samples (to rounding), not k per-micro-batch perturbations."""
    model, data = model_of("bert"), samples(16)
    reference = hand_loop(copy.deepcopy(model), data, steps=2, batch=4, accumulation=2)
    trainer = SAMTrainer(
        model=copy.deepcopy(model),
        args=arguments(tmp_path / "a", steps=2, batch=4, accumulation=2),
        train_dataset=data,
        sam=SAM,
    )
    # BERT's classification loss is a mean that ignores the Trainer's num_items_in_batch; the
    # Trainer then sums the micro-batch means unless told the loss is not scaled: it divides
    # each by k (the Trainer's own convention, which SAMTrainer follows in both passes)
    trainer.loss_is_scaled_for_ga = False
    trainer.train()
    accumulated = params_of(trainer.model)
    assert_same(accumulated, reference)

    big = SAMTrainer(
        model=copy.deepcopy(model),
        args=arguments(tmp_path / "b", steps=2, batch=8),
        train_dataset=data,
        sam=SAM,
    )
    big.train()
    for name, p in params_of(big.model).items():
        torch.testing.assert_close(accumulated[name], p, rtol=1e-10, atol=1e-12, msg=name)

    # perturbing each micro-batch with its own gradient takes a different step
    per_micro = copy.deepcopy(model)
    opt = GeodesicSAM(per_micro, torch.optim.AdamW, lr=LR, weight_decay=0.0, **SAM)
    schedule = get_linear_schedule_with_warmup(opt.base_optimizer, 0, 2)
    micro = [collate(data[i : i + 4]) for i in range(0, 16, 4)]
    for step in range(2):
        grads = None
        for b in micro[2 * step : 2 * step + 2]:
            (per_micro(**b).loss / 2).backward()
            opt.first_step(zero_grad=True)
            (per_micro(**b).loss / 2).backward()
            opt.restore()
            now = [p.grad.clone() for p in per_micro.parameters()]
            grads = now if grads is None else [a + g for a, g in zip(grads, now, strict=True)]
            opt.zero_grad()
        for p, g in zip(per_micro.parameters(), grads, strict=True):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(per_micro.parameters(), CLIP)
        opt.base_optimizer.step()
        schedule.step()
        opt.zero_grad()
    differs = params_of(per_micro)
    assert max((differs[n] - accumulated[n]).abs().max().item() for n in differs) > 1e-8


def _ddp_worker(rank: int, port: int, out: str) -> None:
    """One rank of a 2-process gloo run of SAMTrainer (the environment torchrun would set)."""
    import os

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
    )  # fmt: skip
    torch.set_num_threads(1)
    from pathlib import Path

    model = model_of("bert")
    args = arguments(Path(out) / f"rank{rank}", 2, 2, 2, average_tokens_across_devices=False)
    trainer = SAMTrainer(model=model, args=args, train_dataset=samples(16), sam=SAM)
    trainer.loss_is_scaled_for_ga = False  # each micro-batch mean divided by k (see above)
    trainer.train()
    wrapped = type(trainer.model_wrapped).__name__
    torch.save({"params": params_of(model), "wrapped": wrapped}, f"{out}/rank{rank}.pt")


WORLD = 2


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_ddp_takes_the_step_of_the_global_batch(tmp_path):
    """2 ranks, each accumulating 2 micro-batches of 2 samples: every rank holds the same
    weights, those of one process on batches of 8 (to rounding: DDP averages the ranks'
    accumulated gradients), so the perturbation came from the global gradient."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.spawn(
        _ddp_worker, args=(port, str(tmp_path)), nprocs=WORLD, join=False
    )
    for _ in range(240):  # bounded: a hang fails the test
        if ctx.join(timeout=0.5):
            break
    else:
        for p in ctx.processes:
            p.kill()
        pytest.fail("the 2-process SAMTrainer run did not finish in 120 s")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert [r["wrapped"] for r in ranks] == ["DistributedDataParallel"] * WORLD
    assert_same(ranks[0]["params"], ranks[1]["params"])

    model = model_of("bert")
    SAMTrainer(
        model=model, args=arguments(tmp_path / "one", 2, 8), train_dataset=samples(16), sam=SAM
    ).train()
    for name, p in params_of(model).items():
        torch.testing.assert_close(ranks[0]["params"][name], p, rtol=1e-10, atol=1e-12, msg=name)


def test_weight_decay_groups_are_the_trainers(tmp_path):
    model = model_of("bert")
    args = arguments(tmp_path, steps=1, batch=4)
    args.weight_decay = 0.1
    trainer = SAMTrainer(model=model, args=args, train_dataset=samples(4), sam=SAM)
    trainer.create_optimizer()
    groups = trainer.sam_optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    assert no_decay and all("bias" in n or "LayerNorm" in n for n in no_decay)


@pytest.mark.parametrize(
    ("sam", "error", "match"),
    [
        (dict(rho=0.05, lr=1e-3), TypeError, "unknown arguments \\['lr'\\]"),
        (dict(rho=-1.0), ValueError, "rho"),
        (dict(variant="adam"), ValueError, "variant"),
        (dict(perturbation="third_order"), ValueError, "perturbation"),
        (dict(metric="flat"), ValueError, "metric"),
        (dict(compile="yes"), TypeError, "compile"),
        ([("rho", 0.05)], TypeError, "dict of GeodesicSAM arguments"),
    ],
)
def test_bad_sam_arguments_raise_when_the_trainer_is_built(sam, error, match, tmp_path):
    with pytest.raises(error, match=match):
        SAMTrainer(
            model=model_of("bert"), args=arguments(tmp_path, 1, 4), train_dataset=samples(4),
            sam=sam,
        )  # fmt: skip


# ---------------------------------------------------------------- sharpness during training
MEASURES = {
    "geodesic": Measure.geodesic(0.05, metric="inv", n_iter=3),
    "adaptive": Measure.adaptive(0.05, n_iter=3),
    "average": Measure.average(0.05, n_samples=3),
    "relative_flatness": Measure.relative_flatness("classifier"),
}


class Snapshots(transformers.TrainerCallback):
    """Copies of the model at the start and after every ``every``-th step (reads only)."""

    def __init__(self, every: int):
        self.every, self.models = every, {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.models[state.global_step] = copy.deepcopy(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0:
            self.models[state.global_step] = copy.deepcopy(model)


@pytest.mark.parametrize("kind", ["geodesic", "adaptive", "average", "relative_flatness"])
@pytest.mark.parametrize("trainer_class", [Trainer, SAMTrainer])
def test_callback_logs_direct_values_and_leaves_training_unchanged(kind, trainer_class, tmp_path):
    """Every kind of measure through the same callback, with no case of its own."""
    measure, data = MEASURES[kind], samples(16)
    batches = [collate(data[:4]), collate(data[4:8])]
    extra = {"sam": SAM} if trainer_class is SAMTrainer else {}

    snapshots = Snapshots(every=2)
    plain = trainer_class(
        model=model_of("bert"), args=arguments(tmp_path / "p", 4, 4), train_dataset=data,
        callbacks=[snapshots], **extra,
    )  # fmt: skip
    plain.train()
    expected = [
        (step, measure.evaluate(m, model_loss, batches, progress=False).value)
        for step, m in sorted(snapshots.models.items())
    ]
    assert [step for step, _ in expected] == [0, 2, 4]

    logged_model = model_of("bert")
    trainer = trainer_class(
        model=logged_model, args=arguments(tmp_path / "l", 4, 4), train_dataset=data, **extra
    )
    callback = SharpnessCallback(trainer, measure, batches, every=2)
    trainer.add_callback(callback)
    trainer.train()

    assert_same(params_of(logged_model), params_of(plain.model))
    name = f"sharpness/{measure.name}"
    logged = [(h["step"], h[name]) for h in trainer.state.log_history if name in h]
    assert logged == expected
    assert [(t.step, t.value) for t in callback.tracker.history] == logged


@pytest.mark.parametrize("logging_steps", [2, 3, 1])
def test_callback_keeps_the_trainers_own_log_entries(logging_steps, tmp_path):
    """The loss, grad_norm and learning_rate entries of a Trainer without the callback are all
    there with the same values, whether the sharpness steps (every 2) are the logging steps
    or not; the sharpness entries come at steps 0, 2, 4, 6."""
    data, steps = samples(24), 6

    def trained(name: str, callback: bool) -> Trainer:
        trainer = Trainer(
            model=model_of("bert"), train_dataset=data,
            args=arguments(tmp_path / name, steps, 4, logging_steps=logging_steps),
        )  # fmt: skip
        if callback:
            measure = MEASURES["adaptive"]
            trainer.add_callback(SharpnessCallback(trainer, measure, [collate(data[:4])], every=2))
        trainer.train()
        return trainer

    plain, logged = trained("plain", False), trained("logged", True)

    def own_entries(trainer: Trainer) -> list[dict]:
        return [h for h in trainer.state.log_history if "loss" in h]

    expected = own_entries(plain)
    assert [h["step"] for h in expected] == list(range(logging_steps, steps + 1, logging_steps))
    assert own_entries(logged) == expected
    train_loss = [h["train_loss"] for h in plain.state.log_history if "train_loss" in h]
    assert [h["train_loss"] for h in logged.state.log_history if "train_loss" in h] == train_loss

    name = f"sharpness/{MEASURES['adaptive'].name}"
    sharpness = [h for h in logged.state.log_history if name in h]
    assert [h["step"] for h in sharpness] == [0, 2, 4, 6]
    assert all(set(h) == {name, "epoch", "step"} for h in sharpness)
    (callback,) = [c for c in logged.callback_handler.callbacks if isinstance(c, SharpnessCallback)]
    assert [h[name] for h in sharpness] == [t.value for t in callback.tracker.history]


def test_callback_must_log_to_its_own_trainer(tmp_path):
    data = samples(4)
    first = Trainer(
        model=model_of("bert"), args=arguments(tmp_path / "a", 1, 4), train_dataset=data
    )
    second = Trainer(
        model=model_of("bert"), args=arguments(tmp_path / "b", 1, 4), train_dataset=data
    )
    second.add_callback(SharpnessCallback(first, MEASURES["adaptive"], [collate(data)], every=1))
    with pytest.raises(RuntimeError, match=r"trainer\.add_callback"):
        second.train()


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_tracker_in_a_plain_loop(family):
    """The tracker's values equal direct calls at those steps; training is unchanged by it."""
    data = samples(12)
    micro = [collate(data[i : i + 4]) for i in range(0, 12, 4)]
    measure = MEASURES["geodesic"]

    def train(track: SharpnessTracker | None):
        model = model_of(family)
        opt = GeodesicSAM(model, torch.optim.AdamW, lr=LR, **SAM)
        direct = {}
        model.train()
        for step in range(1, 4):
            b = micro[step - 1]
            model(**b).loss.backward()
            opt.first_step(zero_grad=True)
            model(**b).loss.backward()
            opt.second_step(zero_grad=True)
            if track is not None:
                track(model, step)
            elif step % 2 == 0:
                direct[step] = measure.evaluate(model, model_loss, micro[:2], progress=False).value
        return params_of(model), direct

    tracker = SharpnessTracker(measure, model_loss, micro[:2], every=2)
    tracked, _ = train(tracker)
    untracked, direct = train(None)
    assert_same(tracked, untracked)
    assert [(t.step, t.value) for t in tracker.history] == list(direct.items()) == [(2, direct[2])]
    assert tracker.name == "sharpness/geodesic"


def test_tracker_rejects_bad_arguments():
    with pytest.raises(TypeError, match="Measure"):
        SharpnessTracker("geodesic", model_loss, [{}], every=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every"):
        SharpnessTracker(MEASURES["adaptive"], model_loss, [{}], every=0)
    with pytest.raises(ValueError, match="empty"):
        SharpnessTracker(MEASURES["adaptive"], model_loss, [], every=1)


def test_quotientgeo_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, quotientgeo; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_tracker_takes_relative_flatness():
    model, data = model_of("bert"), samples(8)
    batches = [collate(data[:4]), collate(data[4:])]
    flatness = Measure.relative_flatness("classifier")
    tracker = SharpnessTracker(flatness, model_loss, batches, every=3)
    assert tracker(model, 1) is None
    tracked = tracker(model, 3)
    assert tracked is not None and tracker.name == "sharpness/relative_flatness"
    assert tracked.value == flatness.evaluate(model, model_loss, batches, progress=False).value


def test_restore_puts_the_weights_back_bit_exactly():
    model, data = model_of("gpt2"), samples(4)
    opt = GeodesicSAM(model, torch.optim.AdamW, lr=LR, **SAM)
    with pytest.raises(RuntimeError, match="restore needs a first_step"):
        opt.restore()
    before = params_of(model)
    model(**collate(data)).loss.backward()
    opt.first_step(zero_grad=True)
    assert any(not torch.equal(p, before[n]) for n, p in params_of(model).items())
    opt.restore()
    assert_same(params_of(model), before)
    with pytest.raises(RuntimeError, match="second_step needs a first_step"):
        opt.second_step()


def test_fsdp_and_deepspeed_are_refused_with_the_reason(tmp_path, monkeypatch):
    """The Trainer enables FSDP through accelerate on GPUs only, where SAMTrainer is untested:
    it refuses, and the message points at GeodesicSAM on a fully_shard model."""
    original = SAMTrainer.create_accelerator_and_postprocess

    def sharded(self):
        original(self)
        self.is_fsdp_enabled = True

    monkeypatch.setattr(SAMTrainer, "create_accelerator_and_postprocess", sharded)
    with pytest.raises(ValueError, match="does not support FSDP yet") as info:
        SAMTrainer(
            model=model_of("bert"), args=arguments(tmp_path, 1, 2), train_dataset=samples(4),
            sam=SAM,
        )  # fmt: skip
    assert "GeodesicSAM itself steps a model sharded with FSDP2" in str(info.value)
