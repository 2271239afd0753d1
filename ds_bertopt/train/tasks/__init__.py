"""Tasks of the shared training loop (:mod:`ds_bertopt.train.loop`): what differs between pretraining and
fine-tuning, and nothing else. A task is an object with:

* ``name``, ``title`` (for messages), ``description``, ``shortcuts`` (CLI alias → dotted config key, on top of
  the loop's ``COMMON_SHORTCUTS``), ``global_loss_normalizer`` (divide by the step's target count over all ranks);
* ``reads`` — the config keys it reads (dotted prefixes under ``bertopt``: a section, or one key); any other key
  the config sets is refused by the pre-flight, with ``unread_hints[section]`` saying where it belongs;
* ``preflight(cfg, topo, training=True)`` — its inputs checked on this rank alone (files, model directory, labels;
  ``training=False``: for ``ds-bertopt config``, which may check a config before an earlier phase wrote its inputs);
  ``skips_padding(cfg)`` — whether its model's kernels skip padding (``packed_node_balance`` assumes they do);
* ``build(cfg, topo) -> model`` — data and the model, before ``deepspeed.initialize``; afterwards ``lengths``
  (one per training sample) is what the loop's ``PlanBatchSampler`` plans the epochs from, and ``fingerprint``
  (a :class:`~ds_bertopt.data.identity.DataFingerprint`) what the ranks compare and checkpoints keep;
* ``collate(indices, epoch=, step=, micro=) -> batch`` (host tensors plus the ints ``num_tokens`` and
  ``num_targets``; runs in DataLoader workers), ``loss(engine, batch, normalizer) -> (loss, mean loss)``;
* ``evaluate(engine, topo, seed) -> dict``, ``eval_line``, ``describe_model``, ``save_final``, ``done_line``;
  optionally ``target_metric``, the key of ``evaluate``'s result that ``train.target_eval_accuracy`` compares
  (default ``eval_accuracy``).
"""

import importlib

_MODULES = {"PretrainTask": "pretrain", "FinetuneTask": "finetune"}
"""Each task is imported when first named, so a run imports only its own (fine-tuning's imports cost seconds of
a pretraining start)."""


def __getattr__(name: str):
    if name == "TASKS":
        return {"pretrain": __getattr__("PretrainTask"), "finetune": __getattr__("FinetuneTask")}
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FinetuneTask", "PretrainTask", "TASKS"]
