"""Exit while a gloo worker thread still has to drop a finished collective: the exit-abort race, forced.

    torchrun --nproc_per_node 2 tests/scripts/exit_race_probe.py [--no-patch]

The collective runs async with its handle dropped, so the worker holds the last reference; the main
thread then keeps the GIL (no blocking call, a 100 s switch interval) until the script ends, so the
worker can only drop it after the interpreter has begun to finalize. Without the plugin's exit guard
torch 2.13 on CPython 3.11 aborts here every time ("terminate called without an active exception").
"""

import sys
import time

if "--no-patch" not in sys.argv:
    import fsdp_offload_cfg

    fsdp_offload_cfg.patch({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}})

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.barrier()
sys.setswitchinterval(100.0)  # a thread waiting for the GIL can no longer force a switch
dist.all_reduce(t, async_op=True)
end = time.perf_counter() + 1.0
while time.perf_counter() < end:  # hold the GIL while the worker completes the collective
    pass
# No print or other blocking call after this point: writing releases the GIL and lets the worker through.
