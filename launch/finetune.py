"""BERT fine-tuning entry point: ``deepspeed launch/finetune.py --deepspeed_config ds_configs/finetune_zero2.json
--model_name_or_path DIR --train_file train.csv --validation_file dev.csv``.

Thin on purpose: argument parsing and the loop live in ``ds_bertopt.train`` (task ``tasks.finetune``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from ds_bertopt.train.tasks.finetune import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
