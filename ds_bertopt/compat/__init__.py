"""The one place ds_bertopt reaches into DeepSpeed's and transformers' internals (:mod:`.deepspeed`,
:mod:`.transformers`): each reach a named hook with the releases it was read in and a start-up check."""
