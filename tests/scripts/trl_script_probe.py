"""Launched by tests under torchrun: one of TRL's own scripts (`trl sft`'s, `trl dpo`'s, run as
its module) with the arguments given, as `fsdp-offload-cfg estimate -- trl VERB` reads them
(tests/test_trl_cli.py).

Usage: trl_script_probe.py VERB ARGS... — `trl VERB`'s arguments. The Trainer probe
(`trainer_probe_plugin.py`, beside this file) writes PROBE_DIR/rank{r}.json after the training.
"""

from __future__ import annotations

import runpy
import sys

import fsdp_offload_cfg

fsdp_offload_cfg.patch()  # no config yet: the Trainer's fsdp_config becomes the config

import torch  # noqa: E402
import trainer_probe_plugin  # noqa: E402, F401 - reports after Trainer.train (TRL's trainers keep the Trainer's)

verb = sys.argv[1]
sys.argv = [f"{verb}.py", *sys.argv[2:]]
runpy.run_module(f"trl.scripts.{verb}", run_name="__main__")
if torch.distributed.is_initialized():  # TRL's script ends its trainer (transformers >= 5.18), which destroys it
    torch.distributed.barrier()  # no rank tears gloo down while a peer is still talking
    torch.distributed.destroy_process_group()
