"""The call shapes of the frameworks built on accelerate, on real gloo ranks with `patch()` first:
`fsdp2_prepare_model` called directly (LlamaFactory's DPO reference model), accelerate's
`disable_/enable_fsdp_ram_efficient_loading()` switch, and transformers' own distributed loads,
`from_pretrained(distributed_config=...)` and `from_pretrained(tp_plan="auto")`. TRL's trainers
are in `test_trl.py`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from test_script_shapes import CONFIG as SCRIPT_CONFIG
from test_script_shapes import IDS

from fsdp_offload_cfg import cli
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.logs import MessageLog

pytestmark = pytest.mark.distributed

# The script shapes' accelerate config, with activation offload on.
CONFIG = {**SCRIPT_CONFIG, "fsdp_config": {**SCRIPT_CONFIG["fsdp_config"], "activation_cpu_offload": True}}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from fsdp_offload_cfg.testing.models import save_llama

    return save_llama(str(tmp_path_factory.mktemp("ckpt") / "llama"))


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, gathered from FSDP2's DTensors (all ranks take part)."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = t.detach().clone()
    return out


def _plain(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    with fsdp_offload_cfg.local_loading():
        model = AutoModelForCausalLM.from_pretrained(path)
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def _differences(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    out = sorted(got.keys() ^ expected.keys())
    return out + [k for k in sorted(got.keys() & expected.keys()) if not torch.equal(got[k], expected[k].to(got[k].dtype))]


def _meta_count(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum((t.to_local() if hasattr(t, "to_local") else t).is_meta for t in tensors)


# --------------------------------------------------------------------------------------------
# fsdp2_prepare_model called directly on a model that came through the loader
# --------------------------------------------------------------------------------------------


def _direct_prepare_worker(rank: int, world_size: int, path: str) -> dict[str, Any]:
    import accelerate.utils
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(CONFIG)
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model  # as LlamaFactory does, at its call site

    accelerator = Accelerator()
    policy = AutoModelForCausalLM.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path)  # DPO's reference model, loaded alike
    out: dict[str, Any] = {"reference_meta_before": _meta_count(reference)}
    policy, optimizer = accelerator.prepare(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3))
    reference.eval()
    reference.requires_grad_(False)
    reference = fsdp2_prepare_model(accelerator, reference)  # LlamaFactory's call
    second = accelerate.utils.fsdp2_prepare_model(accelerator, AutoModelForCausalLM.from_pretrained(path))
    plain = _plain(path)
    for name, model in (("reference", reference), ("second", second)):
        out[f"{name}_meta_after"] = _meta_count(model)
        out[f"{name}_wrong"] = _differences(_full(model), plain)
    with torch.no_grad():
        out["reference_loss"] = reference(IDS, labels=IDS).loss.item()
    loss = policy(IDS, labels=IDS).loss
    loss.backward()
    optimizer.step()
    out["policy_loss"] = loss.item()
    return out


def test_fsdp2_prepare_model_called_directly_fills_a_loader_model(llama: str) -> None:
    """Stock: rank 1 failed with `Cannot copy out of meta tensor` (the direct call bypassed the patch)."""
    results = run_workers(_direct_prepare_worker, 2, llama, timeout=180)
    for r in results:
        assert r["reference_meta_before"] > 0, r  # on meta on every rank (rank 0 included) until prepare
        assert r["reference_meta_after"] == 0 and r["second_meta_after"] == 0, r
        assert r["reference_wrong"] == [] and r["second_wrong"] == [], r
    assert results[0]["reference_loss"] == results[1]["reference_loss"]
    assert results[0]["policy_loss"] == results[1]["policy_loss"] == results[0]["reference_loss"]


# --------------------------------------------------------------------------------------------
# accelerate's disable_/enable_fsdp_ram_efficient_loading() switch
# --------------------------------------------------------------------------------------------


def _switch_worker(rank: int, world_size: int, path: str, when: str) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import disable_fsdp_ram_efficient_loading, enable_fsdp_ram_efficient_loading
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(CONFIG)
    if when == "before_accelerator":
        disable_fsdp_ram_efficient_loading()
    accelerator = Accelerator()
    if when == "after_accelerator":
        disable_fsdp_ram_efficient_loading()
    out: dict[str, Any] = {"plugin": accelerator.state.fsdp_plugin.cpu_ram_efficient_loading}
    model = AutoModelForCausalLM.from_pretrained(path)
    out["meta_after_load"] = _meta_count(model)
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out["meta_after_prepare"] = _meta_count(model)
    out["wrong"] = _differences(_full(model), _plain(path))
    enable_fsdp_ram_efficient_loading()  # back on: the loader takes over again
    again = AutoModelForCausalLM.from_pretrained(path)
    out["meta_after_reenabled_load"] = _meta_count(again)
    again, _ = accelerator.prepare(again, torch.optim.SGD(again.parameters(), lr=0.1))
    out["meta_after_reenabled_prepare"] = _meta_count(again)
    out["reenabled_wrong"] = _differences(_full(again), _plain(path))
    return out


@pytest.mark.parametrize("when", ["before_accelerator", "after_accelerator"])
def test_disable_fsdp_ram_efficient_loading_is_honoured_by_loading_and_prepare(llama: str, when: str) -> None:
    """Stock: loading ignored the switch (meta on rank 1), prepare followed the plugin (no fill),
    and meta parameters reached training."""
    results = run_workers(_switch_worker, 2, llama, when, timeout=180)
    for rank, r in enumerate(results):
        assert r["plugin"] is (when != "before_accelerator"), r  # the plugin reads the switch when built
        assert r["meta_after_load"] == 0, f"rank {rank}: the switch is off, every rank loads in full"
        assert r["meta_after_prepare"] == 0 and r["wrong"] == [], r
        assert r["meta_after_reenabled_prepare"] == 0 and r["reenabled_wrong"] == [], r
    assert all(r["meta_after_reenabled_load"] > 0 for r in results), "switched back on: the ranks build on meta again"


# --------------------------------------------------------------------------------------------
# transformers' own shard-on-read: from_pretrained(distributed_config=...)
# --------------------------------------------------------------------------------------------


def _distributed_config_worker(rank: int, world_size: int, path: str) -> dict[str, Any]:

    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import fsdp_offload_cfg

    messages = MessageLog()

    def step() -> tuple[float, dict[str, torch.Tensor], int]:
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2))
        loss = model(IDS, labels=IDS).loss
        loss.backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        return loss.item(), grads, _meta_count(model)

    with fsdp_offload_cfg.patch(CONFIG):
        loss, grads, meta = step()
        offloaded = fsdp_offload_cfg.offload_stats()["offloaded_bytes"]
    plain_loss, plain_grads, _ = step()
    return {
        "loss": loss, "plain_loss": plain_loss, "meta": meta, "offloaded": offloaded,
        "grads_equal": grads.keys() == plain_grads.keys() and all(torch.equal(grads[n], plain_grads[n]) for n in grads),
        "steps_aside": [m for m in messages if "steps aside" in m],
    }  # fmt: skip


def test_distributed_config_shard_on_read_steps_aside_and_keeps_offload(llama: str) -> None:
    import inspect

    distributed = pytest.importorskip("transformers.distributed")
    if "fsdp_size" not in inspect.signature(distributed.DistributedConfig).parameters:
        pytest.skip("DistributedConfig(fsdp_size=) shard-on-read is transformers 5.19+")
    results = run_workers(_distributed_config_worker, 2, llama, timeout=180)
    for rank, r in enumerate(results):
        assert r["meta"] == 0 and r["offloaded"] > 0, r
        assert r["loss"] == r["plain_loss"] and r["grads_equal"], r
        assert len(r["steps_aside"]) == (1 if rank == 0 else 0), r["steps_aside"]
        assert "activation offload enabled" in (r["steps_aside"] or ["activation offload enabled"])[0]


# --------------------------------------------------------------------------------------------
# transformers' own tensor-parallel load: from_pretrained(tp_plan="auto")
# --------------------------------------------------------------------------------------------


def _tensor_parallel_worker(rank: int, world_size: int, path: str, mode: str) -> dict[str, Any]:
    """accelerate's ND-parallel recipe loads with `tp_plan="auto"` before prepare: each rank's
    slices as DTensors on the tensor-parallel mesh (here the 2 ranks are one tensor-parallel group)."""
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg
    from fsdp_offload_cfg.testing.compare import digest
    from fsdp_offload_cfg.testing.configs import loader_config

    messages = MessageLog()
    fsdp_offload_cfg.patch(loader_config(mode))
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    named = [*model.named_parameters(), *model.named_buffers()]
    local = {n: (t.to_local() if hasattr(t, "to_local") else t) for n, t in named}
    return {
        "tensors": {n: (type(t).__name__, str(getattr(t, "placements", "")),
                        "meta" if local[n].is_meta else digest(local[n])) for n, t in named},
        "loss": model(IDS, labels=IDS).loss.item(),
        "steps_aside": [m for m in messages if "tp_plan" in m],
    }  # fmt: skip


def test_a_tensor_parallel_load_is_transformers_own(tmp_path: Any) -> None:
    """Under the loader, `tp_plan` gave another model: on transformers 5 rank 0 read its own slices
    and rank 1 was left on meta; on 4.57 the plan was dropped (whole tensors, no DTensor). Now
    every rank holds what it holds with the loader off, and rank 0 says the loader stepped aside."""
    from fsdp_offload_cfg.testing.models import save_llama

    path = save_llama(str(tmp_path / "llama"), vocab_size=96)  # divisible by the 2 ranks (the head is split)
    plain = run_workers(_tensor_parallel_worker, 2, path, "loader_off", timeout=120)
    assert any(kind == "DTensor" for kind, _, _ in plain[0]["tensors"].values()), "transformers split the model"
    for mode in ("broadcast", "sharded", "auto"):
        for rank, (got, expected) in enumerate(zip(run_workers(_tensor_parallel_worker, 2, path, mode, timeout=120),
                                                   plain, strict=True)):
            assert got["tensors"] == expected["tensors"], (mode, rank)
            assert got["loss"] == expected["loss"], (mode, rank)
            assert len(got["steps_aside"]) == (1 if rank == 0 else 0), got["steps_aside"]


# --------------------------------------------------------------------------------------------
# accelerate's parallelism_config: hybrid sharding (HSDP), 2 replicas x 2 shards
# --------------------------------------------------------------------------------------------


def _hsdp_worker(rank: int, world_size: int, path: str, mode: str) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg
    from fsdp_offload_cfg.testing.compare import digests
    from fsdp_offload_cfg.testing.configs import loader_config
    from fsdp_offload_cfg.testing.training import train_steps

    messages = MessageLog()
    fsdp_offload_cfg.patch(loader_config(mode, activation_cpu_offload=True))
    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
    model = AutoModelForCausalLM.from_pretrained(path)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    loaded = digests(_full(model))
    return {"loaded": loaded, "placements": {str(p.placements) for p in model.parameters()},
            "losses": train_steps(accelerator, model, optimizer, rank % 2),  # the same batches in each replica group
            "trained": digests(_full(model)), "offloaded": fsdp_offload_cfg.offload_stats()["offloaded_bytes"],
            "split": [m for m in messages if "replicas (HSDP)" in m]}


def test_hsdp_through_parallelism_config_loads_and_trains_as_without_the_loader(llama: str) -> None:
    """`parallelism_config` with `dp_replicate_size: 2, dp_shard_size: 2` (4 ranks as 2 nodes x 2,
    a replica per node): FSDP2 on a 2-D mesh. Each loader mode gives every tensor, loss and
    trained weight the run with the loader off gives, the replicas splitting the reading (one
    rank-0 line says so)."""
    plain = run_workers(_hsdp_worker, 4, llama, "loader_off", timeout=180, local_world_size=2)
    assert plain[0]["placements"] == {"(Replicate(), Shard(dim=0))"} and plain[0]["split"] == []
    for mode in ("broadcast", "sharded", "auto"):
        runs = run_workers(_hsdp_worker, 4, llama, mode, timeout=180, local_world_size=2)
        for rank, (got, expected) in enumerate(zip(runs, plain, strict=True)):
            assert got["loaded"] == expected["loaded"] == plain[0]["loaded"], (mode, rank)
            assert got["losses"] == expected["losses"] and got["trained"] == expected["trained"], (mode, rank)
            assert got["offloaded"] > 0 and got["placements"] == expected["placements"], (mode, rank)
            assert len(got["split"]) == (rank == 0 and mode != "broadcast"), (mode, rank, got["split"])


def _mesh_worker(rank: int, world_size: int, sizes: dict[str, int]) -> str | None:
    from accelerate import Accelerator
    from accelerate.parallelism_config import ParallelismConfig

    import fsdp_offload_cfg
    from fsdp_offload_cfg.testing.configs import loader_config

    fsdp_offload_cfg.patch(loader_config("loader_off"))
    try:
        Accelerator(parallelism_config=ParallelismConfig(**sizes))
    except (ValueError, RuntimeError) as error:  # torch's mesh, or accelerate's own check
        return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.parametrize("processes", [2, 4, -1])
def test_validate_warns_of_parallelism_sizes_the_processes_do_not_fill(tmp_path: Path, processes: int,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`dp_replicate_size: 2, dp_shard_size: 2` with `num_processes: 2` passed `validate`, then the
    launch stopped every rank at `Accelerator()`. The file now draws a warning naming both numbers;
    where they agree (a `--set num_processes` included), or the launch decides the number (-1), it
    draws none. That accelerate does
    stop there is checked on 2 real ranks (`test_hsdp_...` runs the sizes that agree)."""
    config = tmp_path / "fsdp2.yaml"
    config.write_text(f"distributed_type: FSDP\nnum_processes: {processes}\nfsdp_config:\n  fsdp_version: 2\n"
                      "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
                      "  parallelism_config_dp_shard_size: 2\n")
    assert cli.main(["validate", str(config)]) == 0
    warned = "parallelism_config: dp_replicate_size 2 x dp_shard_size 2 = 4 processes, but num_processes is 2: " \
             "accelerate stops every rank at Accelerator()"
    assert (warned in capsys.readouterr().out) == (processes == 2)
    if processes == 2:
        assert cli.main(["validate", str(config), "--set", "num_processes=4"]) == 0  # what the user typed wins
        assert "parallelism_config:" not in capsys.readouterr().out
        stopped = run_workers(_mesh_worker, 2, {"dp_replicate_size": 2, "dp_shard_size": 2}, timeout=120)
        assert all(stopped), stopped


# --------------------------------------------------------------------------------------------
# accelerate's ignored_modules: modules left unsharded, whole on every rank
# --------------------------------------------------------------------------------------------


def _ignored_worker(rank: int, world_size: int, path: str, mode: str) -> dict[str, Any]:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg
    from fsdp_offload_cfg.testing.compare import digests
    from fsdp_offload_cfg.testing.configs import loader_config
    from fsdp_offload_cfg.testing.training import train_steps

    messages = MessageLog(level=logging.WARNING)
    fsdp_offload_cfg.patch(loader_config(mode, fsdp_ignored_modules=r"model\.layers\.0"))
    accelerator = Accelerator()
    model = AutoModelForCausalLM.from_pretrained(path)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    loaded = digests(_full(model))
    return {"loaded": loaded, "losses": train_steps(accelerator, model, optimizer, rank),
            "warned": [m for m in messages if "fsdp_ignored_modules does nothing under FSDP2" in m],
            "trained": digests(_full(model)),
            "kinds": sorted({type(p).__name__ for n, p in model.named_parameters() if ".layers.0." in n})}


def test_ignored_modules_load_and_train_as_without_the_loader(llama: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`fsdp_ignored_modules` leaves the modules it names unsharded. Under the loader they were on
    meta when accelerate moved them to the device (`module.to`), and every rank stopped with
    "Cannot copy out of meta tensor". Each mode now gives every tensor, loss and trained weight of
    the run with the loader off, the named layer whole (no DTensor) on every rank. An accelerate
    that shards the layer anyway (1.10) took the key without a word: `validate` and rank 0 say so."""
    import accelerate

    plain = run_workers(_ignored_worker, 2, llama, "loader_off", timeout=120)
    sharded_anyway = plain[0]["kinds"] != ["Parameter"]
    # the installed accelerate's own behaviour, against what validate and the run say about it
    assert [bool(run["warned"]) for run in plain] == [sharded_anyway, False], [run["warned"] for run in plain]
    config = tmp_path / "fsdp2.yaml"
    config.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_ignored_modules: lm_head\n")
    assert cli.main(["validate", str(config)]) == 0
    said = "fsdp_config.fsdp_ignored_modules does nothing under FSDP2 with the installed accelerate"
    assert (said in capsys.readouterr().out) == sharded_anyway
    if sharded_anyway:
        pytest.skip(f"accelerate {accelerate.__version__} shards the modules ignored_modules names under FSDP2")
    for mode in ("broadcast", "sharded", "auto"):
        runs = run_workers(_ignored_worker, 2, llama, mode, timeout=120)
        for rank, (got, expected) in enumerate(zip(runs, plain, strict=True)):
            assert got["loaded"] == expected["loaded"], (mode, rank)
            assert got["losses"] == expected["losses"] and got["trained"] == expected["trained"], (mode, rank)
            assert got["kinds"] == ["Parameter"], (mode, rank, got["kinds"])
