"""Baseline without the plugin: a plain gloo script that ends without `destroy_process_group()`.

    torchrun --nproc_per_node 2 benchmarks/exit_scripts/plain_gloo.py
"""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
