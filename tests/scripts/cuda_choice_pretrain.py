"""``launch/pretrain.py`` with the optimizer a CUDA host builds (DeepSpeed's ``FusedAdam``, its kernel in torch),
started by the ``deepspeed`` launcher in ``tests/test_gpu_paths.py``: bert.json down the path of its first GPU step."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ds_bertopt.testing.gpu_paths import cuda_optimizer_choice  # noqa: E402
from ds_bertopt.train.tasks.pretrain import main  # noqa: E402

if __name__ == "__main__":
    with cuda_optimizer_choice():
        sys.exit(main())
