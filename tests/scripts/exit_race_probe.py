"""Exit while a gloo worker thread still has to drop a finished collective: the exit-abort race, forced.

    torchrun --nproc_per_node 2 tests/scripts/exit_race_probe.py [--no-patch]

The collective runs async with its handle dropped, so the worker holds the last reference; the main
thread then keeps the GIL (no blocking call, a 100 s switch interval) until the script ends, so the
worker can only drop it after the interpreter has begun to finalize. Without the plugin's exit guard
torch 2.13 on CPython 3.11 aborts here every time ("terminate called without an active exception").

The two modes differ only in the `patch()` call. Everything `patch()` imports is imported first,
and the exit handlers those imports register are cleared. Some of them release the GIL (by
chance, about 4 launches in 10 here), and that would let the worker through without the guard.
"""

import atexit
import sys
import time

import accelerate.accelerator  # what patch() would import, imported in both modes
import accelerate.state  # noqa: F401
import torch
import torch.distributed as dist
import transformers.modeling_utils
import transformers.training_args  # noqa: F401

import fsdp_offload_cfg

atexit._clear()  # only what patch() registers may run at exit (see the docstring)
if "--no-patch" not in sys.argv:
    fsdp_offload_cfg.patch({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}})

dist.init_process_group("gloo")
t = torch.ones(1)
dist.barrier()
sys.setswitchinterval(100.0)  # a thread waiting for the GIL can no longer force a switch
dist.all_reduce(t, async_op=True)
end = time.perf_counter() + 1.0
while time.perf_counter() < end:  # hold the GIL while the worker completes the collective
    pass
# No print or other blocking call after this point: writing releases the GIL and lets the worker through.
