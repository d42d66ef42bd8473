"""The pieces `benchmarks/load_memory.py` needs to measure loading at the size users load (an 8B
checkpoint on 8 ranks): the checkpoint written file by file (`write_llama_checkpoint`), and a
launch stopped whole before the host runs out of memory (`run_guarded`), so that a method that
does not fit says so in its row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fsdp_offload_cfg.testing.host_memory import meminfo_bytes, run_guarded
from fsdp_offload_cfg.testing.models import write_llama_checkpoint


def test_a_checkpoint_written_file_by_file_loads_as_save_pretrained_would_write_it(tmp_path: Path):
    """At least 4 files of at most a quarter each, the index's total the tensors' bytes, every key
    the model has (no missing or unexpected key, no tensor left to initialise), each tensor the
    one its seed draws."""
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    path = write_llama_checkpoint(str(tmp_path / "ckpt"), "100m", torch.bfloat16, min_files=4)
    files = sorted(Path(path).glob("model-*.safetensors"))
    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118 - not iterable
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert len(files) >= 4 and files[-1].name.endswith(f"-of-{len(files):05d}.safetensors")
    assert all(sum(t.numel() * 2 for k, t in tensors.items() if index["weight_map"][k] == f.name) <= -(-total // 4)
               for f in files)  # fmt: skip
    assert index["metadata"]["total_size"] == total and set(index["weight_map"]) == set(tensors)

    model, info = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert set(model.state_dict()) == set(tensors)
    names = list(model.state_dict())
    name = "model.layers.3.mlp.down_proj.weight"
    drawn = torch.empty_like(tensors[name]).uniform_(-0.03, 0.03, generator=torch.Generator().manual_seed(names.index(name)))
    assert torch.equal(model.get_parameter(name).detach(), drawn) and torch.equal(tensors[name], drawn)


def _gone(pid: int) -> bool:
    """Dead: no such process, or a zombie left for a parent (init) that may never reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_launch_that_runs_the_host_low_on_memory_is_stopped_whole_and_says_so(tmp_path: Path):
    """The launcher and the process it started (a rank, in a session of its own as torchrun
    starts ranks) both stopped; the reason names it and what the ranks held."""
    started = tmp_path / "child.pid"
    script = ("import subprocess, time; p = subprocess.Popen(['sleep', '60'], start_new_session=True); "
              f"open({str(started)!r}, 'w').write(str(p.pid)); time.sleep(60)")  # fmt: skip
    low_once_started = lambda: 0 if started.exists() and started.read_text() else meminfo_bytes("MemAvailable")  # noqa: E731
    begun = time.monotonic()
    why = run_guarded([sys.executable, "-c", script], dict(os.environ), tmp_path / "log", timeout=50,
                      min_available=1, available=low_once_started)  # fmt: skip
    assert why is not None and why.startswith("does not fit: stopped after") and "the ranks held" in why
    assert time.monotonic() - begun < 30
    child = int(started.read_text())
    deadline = time.monotonic() + 5  # SIGKILL is delivered at once
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child)


def test_a_launch_past_its_time_is_stopped_and_one_that_ends_is_left_alone(tmp_path: Path):
    assert run_guarded(["sleep", "30"], dict(os.environ), tmp_path / "a", timeout=0.5, min_available=0) == (
        "stopped after 0 s (hung?)"
    )  # fmt: skip
    assert run_guarded([sys.executable, "-c", "print('done')"], dict(os.environ), tmp_path / "b", timeout=30,
                       min_available=0) is None  # fmt: skip
    assert (tmp_path / "b").read_text().strip() == "done"


@pytest.mark.distributed
@pytest.mark.own_code
def test_the_benchmark_loads_the_checkpoint_it_writes_file_by_file(tmp_path: Path):
    """`load_memory.py --model 8b` (the GPU machine's `load8b` part) writes its checkpoint with
    `write_llama_checkpoint` and names each rank's model class from its `config.json`: a
    checkpoint without `architectures` there left every row "no result" (KeyError on every rank).
    The same script, end to end, at 100M on 2 ranks with a reference model beside it (`--reference`,
    as TRL's DPO loads one): a row with a loss and a weight sum, and the estimate's host peak
    within 20% of the peak RSS measured (before the estimate counted the reference model, half of it)."""
    script = Path(__file__).parents[1] / "benchmarks" / "load_memory.py"
    run = subprocess.run([sys.executable, str(script), "--model", "100m", "--ranks", "2", "--repeat", "1",
                          "--methods", "sharded", "--model-dir", str(tmp_path), "--reference"],
                         capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no result" not in run.stdout, run.stdout[-3000:]
    header = next(line for line in run.stdout.splitlines() if line.startswith("| checkpoint | method | ranks | rank 0"))
    row = next(line for line in run.stdout.splitlines() if line.startswith("| bf16-files | sharded | 2 |"))
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))
    assert float(cells["loss"]) > 0 and float(cells["weight sum"]) != 0
    estimate_vs_measured = [float(part.split("(")[1].rstrip("x)")) for part in
                            cells["estimate GiB: rank 0 / other ranks (x measured RSS)"].split(" / ")]
    assert all(0.8 <= ratio <= 1.2 for ratio in estimate_vs_measured), cells
