"""Meta loading into CUDA shards: the path every GPU user takes, which the gloo tests (CPU shards)
do not run. A CUDA shard cannot take `preadv` straight into it, so the reader reads into host
staging and `copy_`s into the device (`loading/sharded.py`); under `fsdp_offload_params` the shards
are pinned host memory, read into directly. Each rank's local shard of every parameter, and every
buffer, is compared with the same slice of a plain single-process `from_pretrained`.

Two ranks share one GPU, on gloo (NCCL takes one rank per GPU; at one rank the loader steps
aside, since there is nothing to split): the loader's agreements are object collectives and each
rank reads its own slices, so no tensor crosses between ranks. The broadcast strategy's buckets
(CUDA tensors sent point to point) need NCCL and so two GPUs: not run here. Skipped without a
GPU (CI has none); `scripts/gpu_session.sh suite` runs this file first. One case runs the same
probe on CPU shards everywhere, so that the probe a GPU session relies on keeps working.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from fsdp_offload_cfg.testing.dist import free_port
from fsdp_offload_cfg.testing.models import save_llama

pytestmark = pytest.mark.distributed
NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="loads into CUDA shards: needs a GPU")

HERE = Path(__file__).parent
PROBE = HERE / "scripts" / "device_load_probe.py"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cuda_load")
    return {"float32": save_llama(str(root / "fp32")), "bfloat16": save_llama(str(root / "bf16"), torch.bfloat16)}


@pytest.mark.parametrize(("device", "strategy", "saved", "load_dtype", "offload_params"), [
    pytest.param("cuda", "auto", "float32", None, False, marks=NEEDS_GPU),  # host staging, then a copy into the shard
    pytest.param("cuda", "sharded", "float32", None, False, marks=NEEDS_GPU),
    # float32 masters from a bf16 checkpoint: converted by the copy
    pytest.param("cuda", "auto", "bfloat16", "float32", False, marks=NEEDS_GPU),
    # pinned host shards (CPUOffloadPolicy): read straight into them
    pytest.param("cuda", "auto", "float32", None, True, marks=NEEDS_GPU),
    # the probe itself, on CPU shards (the loader's CPU cases are test_loading.py's)
    pytest.param("cpu", "auto", "float32", None, False, marks=pytest.mark.own_code),
])
def test_a_load_into_device_shards_gives_what_a_plain_load_gives(
    checkpoints: dict[str, str], device: str, strategy: str, saved: str, load_dtype: str | None, offload_params: bool,
) -> None:
    out_dir = Path(tempfile.mkdtemp(prefix="probe_", dir=os.environ["TMPDIR"]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # torchrun as a module: its script need not sit beside this Python on a GPU machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(PROBE), checkpoints[saved], "--device", device, "--strategy", strategy, "--out", str(out_dir),
           *(["--dtype", load_dtype] if load_dtype else []), *(["--offload-params"] if offload_params else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=HERE.parent)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    reports = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in reports:
        assert r["meta_after_load"] and r["names_match"], r  # built on meta: the loader, not a plain load
        assert r["wrong"] == [], f"rank {r['rank']}: not the plain load's slice: {r['wrong']}"
        assert r["param_devices"] == (["cpu"] if offload_params or device == "cpu" else ["cuda:0"]), r
        assert r["params_pinned"] == [offload_params], r  # pinned: only the offloaded shards of a GPU run
