"""Launched by tests under torchrun: LlamaFactory's training, as `llamafactory-cli train CONFIG`
runs it on each rank (`run_exp`, which reads CONFIG from the command line), with `patch()` first
and the Trainer probe (`trainer_probe_plugin.py`, beside this file), which writes
PROBE_DIR/rank{r}.json after the training (tests/clients/test_llamafactory.py).

Usage: llamafactory_probe.py CONFIG
"""

from __future__ import annotations

import fsdp_offload_cfg

fsdp_offload_cfg.patch()  # no config yet: the Trainer's fsdp_config becomes the config

import trainer_probe_plugin  # noqa: E402, F401 - reports after Trainer.train (LlamaFactory's trainers keep it)
from llamafactory.train.tuner import run_exp  # noqa: E402

run_exp()
