"""``"bertopt": {"model": {"unpadded": true}}`` under ``Trainer``: the part of
:class:`~ds_bertopt.integrations.hf.BertOptTrainer` that wraps the model and packs its batches.

* A masked-LM model becomes :class:`~.hf_mlm.TrainerUnpaddedMLM` (continued pretraining; the memory kit is refused:
  it is for fine-tuning), its batches packed and masked by :class:`~.hf_mlm.PackedMLMFeatures`.
* A sequence-classification, token-classification or question-answering model is prepared first
  (:func:`ds_bertopt.wtacrs.prepare_model`: LoRA → kit → WTA-CRS) and becomes the task's class of :mod:`.hf_tasks`,
  its batches packed by :class:`~.hf_tasks.PackedTaskFeatures` (inside the example-id collator when the sampled
  linears need it).

Both are wrapped before ``Trainer.__init__``, so DeepSpeed's engine (ZeRO 0–3) is built around the wrapper. Once the
engine has placed the model, the attention kernel is decided and rank 0 logs it; ``save_model`` and checkpoints
write the wrapped Hugging Face (or PEFT) model, and ``resume_from_checkpoint`` loads it back.
"""

from __future__ import annotations

import contextlib

from transformers import TrainerCallback

from ..errors import ConfigError
from ..log import print0
from ..model.families import FAMILIES
from ..model.unpadded import UnpaddedEncoder
from .hf_mlm import TrainerUnpaddedMLM, packing_collator
from ..model.heads import UnpaddedTaskWithLoss
from .hf_tasks import is_task_model, task_packing_collator, wrap_task_model


class _ChooseAttention(TrainerCallback):
    """Once the engine has placed the model (train begin): the attention kernel, decided eagerly, logged by rank 0."""

    def __init__(self, wrapper: UnpaddedEncoder):
        self.wrapper = wrapper

    def on_train_begin(self, args, state, control, **kwargs):
        print0(f"model.unpadded: {self.wrapper.choose_attention()}")


def _packer_for(model: UnpaddedEncoder, collator):
    """The packing collator for ``model`` in place of ``collator`` (inside the example-id collator, if it is one)."""
    from .hf import ExampleIdCollator

    if isinstance(collator, ExampleIdCollator):
        return ExampleIdCollator(_packer_for(model, collator.collator), collator.count_valid_rows)
    if isinstance(model, UnpaddedTaskWithLoss):
        return task_packing_collator(collator, model.task)
    return packing_collator(collator)


class UnpaddedTrainerMixin:
    """The ``model.unpadded`` part of :class:`~ds_bertopt.integrations.hf.BertOptTrainer` (placed before
    ``BertOptTrainerMixin``, whose ``_bertopt`` config and ``_bertopt_prepare`` it extends)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self.model, UnpaddedEncoder):
            self._bertopt_packing = _packer_for(self.model, self.data_collator)
            self.add_callback(_ChooseAttention(self.model))
            what = (
                f"{self.model.task.replace('_', ' ')} batches"
                if isinstance(self.model, UnpaddedTaskWithLoss)
                else self._bertopt_mlm_layout()
            )
            print0(
                f"model.unpadded: {type(self.model.hf).__name__} ({self.model.family.name}) trains on packed, "
                f"padding-free {what}"
            )

    def _bertopt_mlm_layout(self) -> str:
        packing = self._bertopt_packing
        where = (
            f"one sequence per document (examples cut before every {packing.document_start_token}: attention stays "
            "within documents)"
            if packing.document_start is not None
            else "one sequence per example (the tokenizer has no [CLS]/<s> to find document starts by)"
        )
        return f"MLM batches (mlm_probability {packing.packer.mlm_probability}), {where}"

    def _bertopt_prepare(self, model):
        if not self._bertopt.bertopt.model.unpadded or isinstance(model, UnpaddedEncoder):
            return super()._bertopt_prepare(model)
        attention = self._bertopt.bertopt.model.unpadded_attention
        compile_layers = self._bertopt.bertopt.model.compile
        if is_task_model(model):
            model = super()._bertopt_prepare(model)
            return self._bertopt_wrap(wrap_task_model, model, attention, compile=compile_layers)
        wtacrs = self._bertopt.bertopt.wtacrs
        if wtacrs.enabled or wtacrs.kit.any or wtacrs.lora.enabled:
            raise ConfigError(
                "model.unpadded: not with wtacrs for a masked-LM model (its memory kit, WTA-CRS and LoRA are for "
                "fine-tuning); drop one"
            )
        model = super()._bertopt_prepare(model)
        fused_dropout = self._bertopt.bertopt.model.fused_dropout
        return self._bertopt_wrap(
            TrainerUnpaddedMLM, model, attention, fused_dropout=fused_dropout, compile=compile_layers
        )

    @staticmethod
    def _bertopt_wrap(wrap, model, attention: str, **options):
        try:
            return wrap(model, attention=attention, **options)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            supported = ", ".join(f.mlm_class for f in FAMILIES if not f.unpadded_blocker)
            raise ConfigError(
                f"model.unpadded: {type(model).__name__} cannot run unpadded ({exc}); it takes {supported} and "
                "their ForSequenceClassification, ForTokenClassification and ForQuestionAnswering models"
            ) from None

    @contextlib.contextmanager
    def _bertopt_packing_loader(self):
        collator = self.data_collator
        if isinstance(self.model, UnpaddedEncoder):
            self.data_collator = self._bertopt_packing
        try:
            yield
        finally:
            self.data_collator = collator

    def get_train_dataloader(self):
        with self._bertopt_packing_loader():
            return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None):
        with self._bertopt_packing_loader():
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        with self._bertopt_packing_loader():
            return super().get_test_dataloader(test_dataset)

    @contextlib.contextmanager
    def _bertopt_hf_model(self):
        """``self.model`` is the wrapped Hugging Face model for the duration (what is saved and loaded)."""
        wrapper = self.model
        if isinstance(wrapper, UnpaddedEncoder):
            self.model = wrapper.model
        try:
            yield
        finally:
            self.model = wrapper

    def _save(self, output_dir=None, state_dict=None):
        if isinstance(self.model, UnpaddedEncoder) and state_dict is not None:
            prefix = "model."  # the wrapper's state dict (ZeRO-3 gathers it) is the Hugging Face model's, prefixed
            state_dict = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state_dict.items()}
        with self._bertopt_hf_model():
            return super()._save(output_dir, state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if model is None and isinstance(self.model, UnpaddedEncoder):
            model = self.model.model
        with self._bertopt_hf_model():
            return super()._load_from_checkpoint(resume_from_checkpoint, model)


__all__ = ["UnpaddedTrainerMixin"]
