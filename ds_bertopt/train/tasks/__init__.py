"""Tasks of the shared training loop (:mod:`ds_bertopt.train.loop`): what differs between pretraining and
fine-tuning, and nothing else. A task is an object with:

* ``name``, ``description``, ``shortcuts`` (CLI flag → dotted config key; every field also has its
  ``--section.field`` flag), ``global_loss_normalizer`` (divide by the step's target count over all ranks);
* ``preflight(cfg, topo)`` — its inputs checked on this rank alone (files, model directory, labels);
* ``build(cfg, topo) -> model`` — data and the model, before ``deepspeed.initialize``;
  ``batch_sampler(topo, micro, accum)`` — the plan of the epochs (``PlanBatchSampler``);
* ``collate(indices, epoch=, step=, micro=) -> batch`` (host tensors; runs in DataLoader workers),
  ``tokens(batch)``, ``targets(batch)``, ``loss(engine, batch, normalizer) -> (loss, mean loss)``;
* ``evaluate(engine, topo, seed) -> dict``, ``eval_line``, ``describe_model``, ``save_final``, ``done_line``.
"""

from .finetune import FinetuneTask
from .pretrain import PretrainTask

TASKS = {"pretrain": PretrainTask, "finetune": FinetuneTask}

__all__ = ["FinetuneTask", "PretrainTask", "TASKS"]
