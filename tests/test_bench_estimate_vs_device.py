"""`benchmarks/estimate_vs_device.py` on the CPU, before a GPU's minutes go to it: the
`--loss-head trl-fused` rows (the `trlhead` part of scripts/gpu_session.sh) train through TRL's
fused LM head under the plugin. The CPU has no device allocator: the figures are the GPU's to
measure; here the run must train and say what it ran."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_the_trl_fused_head_rows_train_through_the_plugin():
    pytest.importorskip("trl.trainer.utils", reason="TRL's fused LM head needs trl").add_fused_lm_head  # noqa: B018
    script = Path(__file__).parents[1] / "benchmarks" / "estimate_vs_device.py"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--layers", "1", "--hidden", "32",
                           "--seq", "16", "--vocab", "200", "--settings", "plain", "--loss-head", "trl-fused"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss head trl-fused" in proc.stdout, proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| plain |"))
    loss = float(row.rstrip(" |").rsplit("|", 1)[-1])
    assert abs(loss - math.log(200)) < 0.5, row  # an untrained model's cross-entropy over 200 tokens
