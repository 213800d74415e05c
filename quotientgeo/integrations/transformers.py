r"""Geodesic SAM in the Hugging Face ``Trainer``, and sharpness logged while it trains.

Needs ``transformers`` (and its ``accelerate``): ``pip install "quotientgeo[transformers]"``.
``import quotientgeo`` does not import this module.

- :class:`SAMTrainer`: a ``transformers.Trainer`` whose every optimizer step is a
  :class:`~quotientgeo.optim.GeodesicSAM` step (SAM, ASAM or geodesic SAM): the gradient at
  ``w`` (over all micro-batches of the step), the move to ``w̃ = γ_ξ(1)``, the gradient at
  ``w̃``, the weights put back, then the Trainer's own clipping, optimizer step and scheduler.
- :class:`SharpnessCallback`: a ``transformers.TrainerCallback`` that evaluates a
  :class:`~quotientgeo.Measure` every ``N`` steps on fixed batches and logs it with
  ``Trainer.log`` (so into ``trainer.state.log_history``, and TensorBoard or W&B when
  ``report_to`` names them).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl

from ..optim import GeodesicSAM
from ..options import Perturbation, checked_metric, option
from ..sharpness import Measure, SharpnessTracker
from ..validation import positive_real

Tensor = torch.Tensor

__all__ = ["SAMTrainer", "SharpnessCallback", "model_loss"]

# GeodesicSAM's own keyword arguments; the base optimizer's come from the TrainingArguments
SAM_ARGUMENTS: tuple[str, ...] = tuple(
    name
    for name, p in inspect.signature(GeodesicSAM.__init__).parameters.items()
    if name not in ("self", "model", "base_optimizer") and p.kind is not p.VAR_KEYWORD
)


def model_loss(model: nn.Module, batch: Mapping[str, Any]) -> Tensor:
    """The loss a Hugging Face model returns for a batch with labels: ``model(**batch).loss``,
    the batch's tensors moved to the model's device first."""
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
    return model(**inputs).loss


def _checked_sam_arguments(sam: Mapping[str, Any] | None) -> dict[str, Any]:
    """``sam`` as a dict of GeodesicSAM keyword arguments, its values checked as GeodesicSAM
    checks them (so a bad value fails when the Trainer is built, not at its first step)."""
    if sam is None:
        return {}
    if not isinstance(sam, Mapping):
        raise TypeError(f"sam must be a dict of GeodesicSAM arguments, got {type(sam).__name__}")
    unknown = sorted(set(sam) - set(SAM_ARGUMENTS))
    if unknown:
        raise TypeError(
            f"sam got unknown arguments {unknown}; it takes GeodesicSAM's {list(SAM_ARGUMENTS)}. "
            "The base optimizer and its learning rate, weight decay, betas... come from the "
            "TrainingArguments (optim, learning_rate, weight_decay, ...) or optimizers=."
        )
    sam = dict(sam)
    if "rho" in sam:
        positive_real("rho", sam["rho"])
    if "variant" in sam and sam["variant"] not in ("sam", "asam", "geodesic"):
        raise ValueError(f"variant must be 'sam', 'asam' or 'geodesic', got {sam['variant']!r}")
    if "perturbation" in sam:
        option(Perturbation, "perturbation", sam["perturbation"])
    if "metric" in sam:
        checked_metric(sam["metric"])
    if "compile" in sam and not isinstance(sam["compile"], bool):
        raise TypeError(f"compile must be True or False, got {sam['compile']!r}")
    return sam


def _prebuilt(optimizer: torch.optim.Optimizer) -> Callable[..., torch.optim.Optimizer]:
    """A ``base_optimizer`` for :class:`GeodesicSAM` that returns the Trainer's optimizer (its
    param groups, weight decay split included) with the radius ``rho`` added to each group."""

    def build(groups: list[dict[str, Any]], **_: Any) -> torch.optim.Optimizer:
        rho = groups[0]["rho"]
        for group in optimizer.param_groups:
            group["rho"] = rho
        return optimizer

    return build


class SAMTrainer(Trainer):
    r"""A ``transformers.Trainer`` that trains with SAM, ASAM or geodesic SAM.

    ``SAMTrainer(model, args, ..., sam=dict(rho=0.05, variant="geodesic", metric="inv"))``:
    ``sam`` holds the keyword arguments of :class:`~quotientgeo.optim.GeodesicSAM` (``rho``,
    ``variant``, ``metric``, ``perturbation``, ``symmetries``, ``eps``, ``compile``; ``None``:
    its defaults); every other argument is the Trainer's. An unknown key raises ``TypeError``,
    a bad value ``ValueError``, when the trainer is built.

    **The optimizer.** The Trainer builds its optimizer as usual (``args.optim``, learning
    rate, betas, the weight-decay and no-decay param groups, or the one given in
    ``optimizers=``); :meth:`create_optimizer` then wraps it in a
    :class:`~quotientgeo.optim.GeodesicSAM` kept in :attr:`sam_optimizer`, which shares its
    param groups (``rho`` is added to each). ``trainer.optimizer`` stays the plain optimizer,
    so the LR scheduler, checkpoints (``optimizer.pt``), mixed-precision loss scaling and the
    ``accelerate`` wrapper see the optimizer they expect.

    **One optimizer step** (:meth:`training_step`, over the ``k`` micro-batches
    ``B_1..B_k`` of a step, ``k = gradient_accumulation_steps``):

    1. each micro-batch's loss and backward at ``w`` as in the Trainer, so ``.grad`` holds
       ``g = Σ_i ∇L_{B_i}(w) / k``, the gradient of the whole step's batch;
    2. after the last micro-batch: :meth:`~quotientgeo.optim.GeodesicSAM.first_step` moves the
       weights to ``w̃ = γ_ξ(1)``, ``ξ = ρ grad L / ||grad L||_w`` from that ``g``; the
       gradients are zeroed;
    3. the loss and backward of every micro-batch again, at ``w̃`` (the Trainer's loss, loss
       scaling and autocast: the Trainer's own ``training_step``);
    4. :meth:`~quotientgeo.optim.GeodesicSAM.restore` puts ``w`` back bit-exactly;
    5. the Trainer clips the gradient (now ``∇L(w̃)``), steps the optimizer, steps the
       scheduler and zeroes the gradients, as always.

    So gradient accumulation is exact: ``k`` micro-batches of size ``b`` take the step of one
    batch of size ``k·b`` (the perturbation comes from the accumulated gradient, not one per
    micro-batch), at two forward-backward passes per micro-batch; the ``k`` micro-batches are
    the ones the Trainer already holds for the step. The logged ``loss`` is the loss at ``w``;
    ``total_flos`` counts the first pass only. Callbacks (``on_step_end``, ``on_log``, ...)
    always see ``w``.

    **Clipping** acts on ``∇L(w̃)``, the gradient the optimizer uses; the perturbation is
    normalised, so clipping the first gradient would not change it. **The LR scheduler**
    steps once per optimizer step, on the shared param groups. **Mixed precision**:
    ``bf16``/``fp16`` autocast runs both passes (``accelerate`` wraps the forward); the
    direction of ``ξ`` does not depend on the ``fp16`` loss scale; when the ``fp16`` gradient
    at ``w`` is not finite, steps 2-4 are skipped and the loss scaler skips the step as it
    does without SAM. **Distributed** (DDP, one process per GPU): the gradient at ``w`` is
    all-reduced by DDP in the last micro-batch's backward, so every rank moves to the same
    ``w̃`` (the perturbation of the global batch, as on one device); the second pass syncs
    only in its last micro-batch's backward, as the Trainer does. FSDP and DeepSpeed raise
    ``ValueError``: accelerate enables FSDP on GPUs only, where this class is not tested yet
    (:class:`~quotientgeo.optim.GeodesicSAM` itself steps a model sharded with FSDP2), and
    DeepSpeed steps the weights itself.
    """

    def __init__(self, *args: Any, sam: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.sam_arguments: dict[str, Any] = _checked_sam_arguments(sam)
        self.sam_optimizer: GeodesicSAM | None = None
        self._window: list[Any] = []
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled:
            raise ValueError(
                "SAMTrainer does not support DeepSpeed, which shards the weights and steps them "
                "itself; use DistributedDataParallel (one process per device)"
            )
        if self.is_fsdp_enabled:
            raise ValueError(
                "SAMTrainer does not support FSDP yet: accelerate enables it on GPUs only, and "
                "it has not been tested there. GeodesicSAM itself steps a model sharded with "
                "FSDP2 (torch.distributed.fsdp.fully_shard): use it in a training loop of your "
                "own, or DistributedDataParallel with SAMTrainer"
            )

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, wrapped in :attr:`sam_optimizer` (class docstring)."""
        optimizer = super().create_optimizer(model)
        self._window = []  # a step cut short by an interrupted train() is not continued
        base = getattr(optimizer, "optimizer", optimizer)  # under accelerate's wrapper
        if self.sam_optimizer is None or self.sam_optimizer.base_optimizer is not base:
            if not isinstance(self.model, nn.Module):
                raise RuntimeError("SAMTrainer.create_optimizer needs the trainer's model")
            self.sam_optimizer = GeodesicSAM(self.model, _prebuilt(base), **self.sam_arguments)
        return optimizer

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: Tensor | int | None = None,
    ) -> Tensor:
        """The Trainer's step at ``w``; after the step's last micro-batch, the move to ``w̃``,
        every micro-batch again at ``w̃`` and the weights put back (class docstring)."""
        sam = self.sam_optimizer
        if sam is None:
            raise RuntimeError("SAMTrainer.training_step before create_optimizer")
        # accelerate's wrapper and checkpoint resumption load a state dict into the optimizer,
        # which replaces its param groups: share them again (as GeodesicSAM.load_state_dict does)
        sam.param_groups = sam.base_optimizer.param_groups
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._window.append(inputs)
        if not self.accelerator.sync_gradients:
            return loss
        window, self._window = self._window, []
        if self.accelerator.scaler is not None and not _finite_gradients(sam):
            return loss  # fp16 overflow: the loss scaler skips this step
        sam.first_step(zero_grad=True)
        try:
            for i, batch in enumerate(window):
                last = i == len(window) - 1
                with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                    super().training_step(model, batch, num_items_in_batch)
        finally:
            sam.restore()
        return loss


def _finite_gradients(sam: GeodesicSAM) -> bool:
    grads = [p.grad for p in sam.geometry.params.values() if p.grad is not None]
    if not grads:
        return True
    return bool(torch.stack([g.isfinite().all() for g in grads]).all())


class SharpnessCallback(TrainerCallback):
    """Log a sharpness measure every ``every`` optimizer steps of a ``Trainer``.

    ``trainer.add_callback(SharpnessCallback(trainer, Measure.geodesic(0.05, n_iter=10),
    batches, every=50))``: at the start of training (step 0) and after every optimizer step
    whose number is a multiple of ``every``, the measure is evaluated on ``batches`` (at the
    weights ``w``, outside autocast, the model restored bit-exactly) and logged with
    ``trainer.log({name: value})``: it lands in ``trainer.state.log_history`` (an entry of its
    own, ``{name: value, "epoch": ..., "step": ...}``) and in every reporting integration
    ``report_to`` names (TensorBoard, W&B, ...). The evaluations are also kept in
    :attr:`tracker` (``tracker.history``). The trainer is passed in because a
    ``TrainerCallback`` has no other way to log through it.

    **The Trainer's own logs are kept.** The Trainer logs ``loss``, ``grad_norm`` and
    ``learning_rate`` right after ``on_step_end``, and only if ``control.should_log`` is
    still set (its ``DefaultFlowCallback`` sets it in ``on_step_end`` on every
    ``logging_steps``-th step). ``trainer.log`` ends in the callbacks' ``on_log``, before
    which the Trainer clears ``control.should_log``: called as is from ``on_step_end``, it
    would cancel the Trainer's log of that step, and that step's loss would be averaged into
    the next logged one. So the callback sets ``control.should_log`` back to what it was
    before its own log; the Trainer's log entries (and their values) are then those of a
    Trainer without the callback. Merging the value into the Trainer's next entry in
    ``on_log`` instead would miss ``log_history`` (the Trainer appends a copy of the entry
    before ``on_log``) and the integrations called before this callback, and would file the
    value under a later step when ``every`` is not a multiple of ``logging_steps``.

    Args:
        trainer: the ``Trainer`` the callback is added to (any ``Trainer``, not only
            :class:`SAMTrainer`).
        measure: a :class:`~quotientgeo.Measure` (geodesic, adaptive or average sharpness,
            relative flatness).
        batches: fixed measurement batches, e.g. a few collated batches of the training set.
        loss_fn: ``loss_fn(model, batch) -> scalar``; default :func:`model_loss`
            (``model(**batch).loss``).
        every: measure every that many optimizer steps.
        name: the log key; default ``"sharpness/<measure.name>"``.

    Under DDP every rank runs the callback and the measure splits the batches over the ranks
    (:meth:`Measure.evaluate <quotientgeo.Measure.evaluate>`'s ``distributed="batches"``).
    """

    def __init__(
        self,
        trainer: Trainer,
        measure: Measure,
        batches: Iterable,
        *,
        loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
        every: int,
        name: str | None = None,
    ) -> None:
        if not isinstance(trainer, Trainer):
            raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
        self.trainer = trainer
        self.tracker = SharpnessTracker(
            measure, model_loss if loss_fn is None else loss_fn, batches, every=every, name=name
        )

    def _log(self, model: nn.Module | None, step: int, control: TrainerControl) -> TrainerControl:
        """Measure at ``step`` if due and log the value; returns the Trainer's control with
        ``should_log`` as it was before (class docstring)."""
        model = self.trainer.model if model is None else model
        if not isinstance(model, nn.Module):
            raise RuntimeError("SharpnessCallback found no model to measure")
        if self not in self.trainer.callback_handler.callbacks:
            raise RuntimeError(
                "this SharpnessCallback runs in a Trainer other than the one it logs to: add it "
                "with trainer.add_callback(SharpnessCallback(trainer, ...))"
            )
        tracked = self.tracker(model, step)
        if tracked is None:
            return control
        trainer_logs_this_step = control.should_log
        self.trainer.log({self.tracker.name: tracked.value})
        # Trainer.log replaces trainer.control by what the on_log callbacks return (the same
        # object, its should_log cleared, unless a callback returns another)
        control = self.trainer.control
        control.should_log = control.should_log or trainer_logs_this_step
        return control

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        return self._log(model, state.global_step, control)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        return self._log(model, state.global_step, control)
