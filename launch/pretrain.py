"""BERT pretraining entry point: ``deepspeed launch/pretrain.py --deepspeed_config ds_configs/bert.json``.

Thin on purpose: argument parsing and the loop live in ``ds_bertopt.train`` (task ``tasks.pretrain``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from ds_bertopt.train.tasks.pretrain import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
