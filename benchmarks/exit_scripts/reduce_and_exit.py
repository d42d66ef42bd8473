"""The smallest script: `patch()`, `Accelerator()`, one reduce, exit.

    accelerate launch --config_file examples/fsdp2_cpu.yaml benchmarks/exit_scripts/reduce_and_exit.py
"""

import fsdp_offload_cfg

fsdp_offload_cfg.patch()

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

accelerator = Accelerator()
total = accelerator.reduce(torch.ones(1), reduction="sum")
