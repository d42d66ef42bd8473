"""Launched by tests under torchrun: TRL's own `sft` script (`trl sft`'s, run as its module) with
the arguments given, as `fsdp-offload-cfg estimate` reads its `--config` file (tests/test_trl_cli.py).

Usage: trl_sft_probe.py ARGS... — `trl sft`'s arguments. The Trainer probe
(`trainer_probe_plugin.py`, beside this file) writes PROBE_DIR/rank{r}.json after the training.
"""

from __future__ import annotations

import runpy
import sys

import fsdp_offload_cfg

fsdp_offload_cfg.patch()  # no config yet: the Trainer's fsdp_config becomes the config

import torch  # noqa: E402
import trainer_probe_plugin  # noqa: E402, F401 - reports after Trainer.train (SFTTrainer keeps the Trainer's)

sys.argv = ["sft.py", *sys.argv[1:]]
runpy.run_module("trl.scripts.sft", run_name="__main__")
if torch.distributed.is_initialized():  # TRL's script ends its trainer (transformers >= 5.18), which destroys it
    torch.distributed.barrier()  # no rank tears gloo down while a peer is still talking
    torch.distributed.destroy_process_group()
