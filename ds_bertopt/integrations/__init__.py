"""Integrations of ds_bertopt with other training front ends.

* :mod:`.hf` — Hugging Face ``Trainer`` (and ``accelerate launch``): :class:`~.hf.BertOptTrainer`, a drop-in
  ``Trainer`` that applies the ``"bertopt"`` section (WTA-CRS + memory kit, LoRA, the gradient-norm cache,
  optionally our LAMB / schedules, bucket clipping and the length-aware sampler). See ``docs/hf.md``.

Nothing is imported here, so ``import ds_bertopt.integrations`` does not pull in transformers.
"""
