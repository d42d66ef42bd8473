"""Writing the trained model: `trainer.save_model(dir)` under a sharded state dict (patch
`trainer-final-model`) and `model.save_pretrained(dir)` of a model sharded with FSDP2 (patch
`save-pretrained-sharded`).

transformers writes a model from `save_model` under FSDP only with `FULL_STATE_DICT`; under
`SHARDED_STATE_DICT`, accelerate's default for FSDP2, it wrote nothing at all, silently: `trl sft`
and the other TRL scripts end with `trainer.save_model(output_dir)`, so a run with FSDP2's
defaults and `save_strategy: "no"` kept no model. Now it writes what `FULL_STATE_DICT` writes, and
the checkpoints stay sharded.

transformers 5 gathers weights for `save_pretrained` only for a model it sharded itself: a model
accelerate sharded stopped with "Attempted to access the data pointer on an invalid python
storage" on every rank. Now it writes what accelerate's recipe (`state_dict=get_state_dict`) writes.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

from fsdp_offload_cfg.testing.configs import loader_config
from fsdp_offload_cfg.testing.dist import run_workers

pytestmark = pytest.mark.distributed


def _trainer(path: str, out: str, mode: str, state_dict_type: str, lora: bool, **args: Any) -> Any:
    import numpy as np
    from datasets import Dataset

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(loader_config(mode, fsdp_state_dict_type=state_dict_type))
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    ids = np.random.default_rng(0).integers(1, 97, (8, 12)).tolist()
    model = AutoModelForCausalLM.from_pretrained(path)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, learning_rate=5e-2, report_to=[], seed=0,
                             use_cpu=True, **args)  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}))


def _save_worker(rank: int, world_size: int, path: str, out: str, mode: str, state_dict_type: str,
                 lora: bool, final_sharded: bool = False) -> int:  # fmt: skip
    """Trains 2 steps (a sharded checkpoint at step 2), saves the final model; returns how often
    this rank called the Trainer's writer `_save`."""
    trainer = _trainer(path, out, mode, state_dict_type, lora, max_steps=2, save_strategy="steps", save_steps=2)
    if final_sharded:  # what axolotl's TrainingArguments carry for its `final_state_dict_type`
        trainer.args.fsdp_config = {**(trainer.args.fsdp_config or {}), "final_state_dict_type": "SHARDED_STATE_DICT"}
    trainer.train()
    writes, save = [], trainer._save
    trainer._save = lambda *a, **k: writes.append(a) or save(*a, **k)
    trainer.save_model(os.path.join(out, "final"))
    return len(writes)


def _files(folder: str) -> dict[str, Any]:
    """Every file under `folder`: a safetensors file's tensors, any other file's size."""
    from safetensors.torch import load_file

    found: dict[str, Any] = {}
    for root, _, names in os.walk(folder):
        for name in names:
            file = os.path.join(root, name)
            found[os.path.relpath(file, folder)] = load_file(file) if name.endswith(".safetensors") else None
    return found


@pytest.mark.parametrize("mode, lora", [("loader_off", False), ("sharded", False), ("loader_off", True)])
def test_save_model_under_a_sharded_state_dict_writes_what_full_state_dict_writes(tmp_path: Any, mode: str,
                                                                                   lora: bool) -> None:  # fmt: skip
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_offload_cfg.testing.models import save_llama

    path = save_llama(str(tmp_path / "llama"))
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        writes = run_workers(_save_worker, 2, path, str(tmp_path / kind), mode, kind, lora, timeout=240)
        # ours calls the writer on rank 0 only: transformers 5.16's `_save` writes on any rank that
        # calls it, and rank 1, holding an empty state dict, raced rank 0 with an empty adapter file
        assert kind == "FULL_STATE_DICT" or writes == [1, 0], writes
    sharded = _files(str(tmp_path / "SHARDED_STATE_DICT" / "final"))
    full = _files(str(tmp_path / "FULL_STATE_DICT" / "final"))
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    assert weights in sharded and sharded.keys() == full.keys(), (sorted(sharded), sorted(full))
    for name, tensors in full.items():
        if tensors is not None:
            assert tensors.keys() == sharded[name].keys()
            assert all(torch.equal(t, sharded[name][k]) for k, t in tensors.items()), name
    checkpoint = os.listdir(tmp_path / "SHARDED_STATE_DICT" / "checkpoint-2")
    assert "pytorch_model_fsdp_0" in checkpoint and "model.safetensors" not in checkpoint, checkpoint  # still sharded
    if not lora:
        saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "SHARDED_STATE_DICT" / "final"),
                                                     output_loading_info=True)[1]  # fmt: skip
        assert not any(saved.values()), saved


def test_a_final_model_asked_to_stay_sharded_is_left_to_the_framework(tmp_path: Any) -> None:
    """axolotl's `final_state_dict_type: SHARDED_STATE_DICT` (a model too large to gather on rank 0's
    host): axolotl merges the last checkpoint itself after `save_model`, so nothing is gathered."""
    from fsdp_offload_cfg.testing.models import save_llama

    path = save_llama(str(tmp_path / "llama"))
    run_workers(_save_worker, 2, path, str(tmp_path / "out"), "loader_off", "SHARDED_STATE_DICT", False, True,
                timeout=240)  # fmt: skip
    assert not (tmp_path / "out" / "final").exists()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _rank0_alone_worker(rank: int, world_size: int, path: str, out: str) -> list[str]:
    import torch.distributed as dist

    trainer = _trainer(path, out, "loader_off", "SHARDED_STATE_DICT", False, max_steps=1, save_strategy="no")
    trainer.train()
    records = _Records()
    logging.getLogger("fsdp_offload_cfg").addHandler(records)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:  # the pattern of scripts written for DDP
        trainer.save_model(os.path.join(out, "final"))
        store.set("rank 0 saved", "1")
    else:
        store.wait(["rank 0 saved"])
    return records.messages


def test_save_model_on_rank_0_alone_writes_nothing_and_warns_instead_of_waiting_in_a_gather(tmp_path: Any) -> None:
    from fsdp_offload_cfg.testing.models import save_llama

    out = tmp_path / "out"
    rank0, rank1 = run_workers(_rank0_alone_worker, 2, save_llama(str(tmp_path / "llama")), str(out), pg_timeout=3,
                               timeout=180)  # fmt: skip
    warning = [m for m in rank0 if "wrote no model" in m]
    assert len(warning) == 1 and "on every rank" in warning[0], rank0
    assert "rank 1 did not come within the process-group timeout (3s)" in warning[0], warning
    assert not (out / "final").exists() and rank1 == []


def _meeting_worker(rank: int, world_size: int) -> list[Any]:
    import torch.distributed as dist

    from fsdp_offload_cfg.ranks import every_rank_comes

    store = dist.distributed_c10d._get_default_store()
    met = [every_rank_comes("test", "meet")]  # all come
    if rank == 0:
        met.append(every_rank_comes("test", "meet"))  # alone: gives up after the process-group timeout
        store.set("rank 0 gave up", "1")
    else:
        store.wait(["rank 0 gave up"])
        met.append(every_rank_comes("test", "meet"))  # too late: skips with rank 0, not into a collective alone
    return met


def test_every_rank_comes_agrees_on_go_and_a_late_rank_skips_with_the_others() -> None:
    rank0, rank1 = run_workers(_meeting_worker, 2, pg_timeout=2, timeout=120)
    assert rank0 == [(True, [], ""), (False, [1], "rank 1 did not come within the process-group timeout (2s)")]
    assert rank1 == [(True, [], ""), (False, [], "this rank came after the others had stopped waiting for it")]


def _gone_worker(rank: int, world_size: int) -> Any:
    import time

    from fsdp_offload_cfg.ranks import every_rank_comes, remember_failed_step, say_this_rank_is_gone

    met = every_rank_comes("test", "meet")  # all come
    if rank == 1:  # what patch()'s excepthook does with an error nobody caught, as the process ends
        try:
            try:
                raise ImportError("flash_attn is not installed on this node")
            except ImportError as failed:
                remember_failed_step("load /ckpt", failed)
                raise RuntimeError("the framework's own wrapper") from failed
        except RuntimeError as error:
            say_this_rank_is_gone(error)
        return met
    start = time.monotonic()
    return met, every_rank_comes("test", "meet"), time.monotonic() - start


def test_a_meeting_does_not_wait_for_a_rank_that_is_gone() -> None:
    """A rank whose process an uncaught error ends leaves a note: the meeting stops on it at once
    (a save on every rank, the start of prepare), naming it, instead of after the timeout. The
    note names the step the loader marked on the error, also where a framework wrapped it."""
    rank0, rank1 = run_workers(_gone_worker, 2, pg_timeout=60, timeout=120)
    met, (everyone, absent, why), seconds = rank0
    assert met == rank1 == (True, [], "") and (everyone, absent) == (False, [1]) and seconds < 30, rank0
    assert why.startswith("rank 1 failed to load /ckpt: ImportError: flash_attn is not installed on this node"), why


def _frozen_store_worker(rank: int, world_size: int) -> Any:
    import os
    import signal
    import threading
    import time

    import torch.distributed as dist

    from fsdp_offload_cfg import ranks

    store = dist.distributed_c10d._get_default_store()
    if rank == 0:  # hosts the store; rank 1 stops this process, with it the store, then resumes it
        store.set("rank 0's pid", str(os.getpid()))
        while not store.check(["fsdp_offload_cfg/gone/rank1"]):  # resumed: rank 1's note arrived
            time.sleep(0.05)
        return None
    pid = int(store.get("rank 0's pid"))
    os.kill(pid, signal.SIGSTOP)  # a store host that no longer answers (a hung node, a network cut)
    resume = threading.Timer(30.0, os.kill, (pid, signal.SIGCONT))  # without the bound: the note waits for this
    resume.start()
    start = time.monotonic()
    try:
        ranks.say_this_rank_is_gone(RuntimeError("the script's own error"))
        return time.monotonic() - start
    finally:
        resume.cancel()
        os.kill(pid, signal.SIGCONT)


def test_the_note_of_a_rank_that_is_gone_does_not_hold_its_exit_when_the_store_does_not_answer() -> None:
    """Leaving the note awaits no reply from the store: a process that is ending anyway must not
    stay for a store host that no longer answers (before: its `add` waited until the host
    answered again, here the 30 s until rank 0 resumes, despite the store timeout of 10 s then
    set for it), and the note still arrives when the host resumes."""
    rank0, seconds = run_workers(_frozen_store_worker, 2, timeout=120)
    assert rank0 is None and seconds < 15, seconds


def _accelerate_loop(path: str, mode: str, lora: bool = False) -> tuple[Any, Any]:
    """A model prepared by accelerate (FSDP2) and trained one step."""
    import torch

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(loader_config(mode))
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    accelerator = Accelerator(cpu=True)
    model = AutoModelForCausalLM.from_pretrained(path)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.arange(24).reshape(2, 12) % 90 + 3
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    return accelerator, model


def _save_pretrained_worker(rank: int, world_size: int, path: str, out: str, mode: str, lora: bool) -> None:
    accelerator, model = _accelerate_loop(path, mode, lora)
    model = accelerator.unwrap_model(model)
    model.save_pretrained(os.path.join(out, "every_rank"))  # the default is_main_process=True, on every rank
    model.save_pretrained(os.path.join(out, "main"), is_main_process=accelerator.is_main_process)
    model.save_pretrained(os.path.join(out, "recipe"), is_main_process=accelerator.is_main_process,
                          state_dict=accelerator.get_state_dict(model))  # accelerate's documented way  # fmt: skip


@pytest.mark.parametrize("model, mode, lora", [("llama", "sharded", False), ("qwen2_tied", "loader_off", False),
                                               ("llama", "sharded", True), ("deepseek_v3", "loader_off", False)])  # fmt: skip
def test_save_pretrained_of_a_sharded_model_writes_what_accelerates_recipe_writes(tmp_path: Any, model: str,
                                                                                   mode: str, lora: bool) -> None:  # fmt: skip
    """transformers' `save_pretrained`, and PEFT's for a LoRA model (which stopped the same way).
    DeepSeek-V3: transformers 5 saves its fused experts as one tensor per expert, built anew in
    the save from a layer's gathered experts."""
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_offload_cfg.testing import models

    path = getattr(models, f"save_{model}")(str(tmp_path / model))
    run_workers(_save_pretrained_worker, 2, path, str(tmp_path / "out"), mode, lora, timeout=180)
    recipe = _files(str(tmp_path / "out" / "recipe"))
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    assert name in recipe, sorted(recipe)
    # the names a plain save writes: a tied weight once, where the recipe, whose gathered weights
    # share no storage, also writes its tied copy (lm_head.weight)
    names = recipe[name].keys() if lora else _files(path)[name].keys()
    for way in ("every_rank", "main"):
        saved = _files(str(tmp_path / "out" / way))
        assert saved.keys() == recipe.keys(), (way, sorted(saved), sorted(recipe))
        assert saved[name].keys() == names, (way, sorted(saved[name]), sorted(names))
        assert all(torch.equal(t, recipe[name][k]) for k, t in saved[name].items()), way
    if not lora:
        info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out" / "every_rank"), output_loading_info=True)[1]
        assert not any(info.values()), info


def _save_alone_worker(rank: int, world_size: int, path: str, out: str, way: str) -> str:
    import torch.distributed as dist

    accelerator, model = _accelerate_loop(path, "loader_off")
    store = dist.distributed_c10d._get_default_store()
    message = ""
    if accelerator.is_main_process:  # the habit of scripts written for DDP
        try:
            if way == "save_pretrained":
                accelerator.unwrap_model(model).save_pretrained(out)
            else:
                accelerator.save_model(model, out)
        except RuntimeError as exc:
            message = str(exc)
        store.set("rank 0 tried", "1")
    else:
        store.wait(["rank 0 tried"])
    return message


@pytest.mark.parametrize("way", ["save_pretrained", "save_model"])
def test_a_save_on_rank_0_alone_raises_saying_to_call_it_on_every_rank(tmp_path: Any, way: str) -> None:
    """The weights are gathered, a collective: stock `accelerator.save_model` on rank 0 alone
    waited in the gather until the watchdog killed the job."""
    from fsdp_offload_cfg.testing.models import save_llama

    message, _ = run_workers(_save_alone_worker, 2, save_llama(str(tmp_path / "llama")),
                             str(tmp_path / "out"), way, pg_timeout=3, timeout=180)  # fmt: skip
    assert way in message and "rank 1 did not" in message, message
    how = "is_main_process=accelerator.is_main_process" if way == "save_pretrained" else "the same arguments"
    assert f"every rank with {how}" in message, message


def _distributed_checkpoint_worker(rank: int, world_size: int, path: str, out: str) -> str:
    accelerator, model = _accelerate_loop(path, "loader_off")
    try:
        accelerator.unwrap_model(model).save_pretrained(out, distributed_checkpoint=True)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_save_pretrained_with_distributed_checkpoint_of_a_model_accelerate_sharded_says_what_works(
        tmp_path: Any) -> None:  # fmt: skip
    """transformers' `distributed_checkpoint=True` (in 5.16 and 5.24; not in 4.57 or 5.6) saves only a model transformers sharded
    itself: for one accelerate sharded it stopped with "requires an FSDP- or TP-sharded model" (it
    is one) after writing config.json. Every rank now says why and what to use instead, and
    nothing is written."""
    import inspect

    from transformers import PreTrainedModel

    from fsdp_offload_cfg.testing.models import save_llama

    if "distributed_checkpoint" not in inspect.signature(PreTrainedModel.save_pretrained).parameters:
        pytest.skip("this transformers' save_pretrained has no distributed_checkpoint (4.57 and 5.6 have none)")
    out = tmp_path / "out"
    messages = run_workers(_distributed_checkpoint_worker, 2, save_llama(str(tmp_path / "llama")), str(out),
                           timeout=180)  # fmt: skip
    for message in messages:
        assert "sharded by accelerate (FSDP2)" in message and "accelerator.save_state(dir)" in message, message
        assert "call save_pretrained(dir) on every rank without distributed_checkpoint" in message, message
    assert not out.exists() or not os.listdir(out), os.listdir(out)


def _fsdp1_worker(rank: int, world_size: int, path: str, out: str, state_dict_type: str) -> dict[str, Any]:
    """FSDP1 on the CPU, trained 2 steps with a checkpoint at step 2, then `save_model`; returns
    the trained weights as `summon_full_params` gathers them, without any offload."""
    import numpy as np
    from datasets import Dataset
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: N817 - the name its docs use

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch({"distributed_type": "FSDP", "mixed_precision": "no", "fsdp_config": {
        "fsdp_version": 1, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_use_orig_params": True,
        "fsdp_sync_module_states": False, "fsdp_cpu_ram_efficient_loading": False,
        "fsdp_state_dict_type": state_dict_type}})  # fmt: skip
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    ids = np.random.default_rng(0).integers(1, 97, (8, 12)).tolist()
    args = TrainingArguments(output_dir=out, max_steps=2, per_device_train_batch_size=2, learning_rate=5e-2,
                             report_to=[], seed=0, use_cpu=True, save_strategy="steps", save_steps=2)  # fmt: skip
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(path), args=args,
                      train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}))  # fmt: skip
    trainer.train()
    with FSDP.summon_full_params(trainer.model_wrapped, writeback=False):
        trained = {name.replace("_fsdp_wrapped_module.", ""): p.detach().clone().numpy()
                   for name, p in trainer.model_wrapped.named_parameters()}  # fmt: skip (numpy: pickled by value)
    trainer.save_model(os.path.join(out, "final"))
    return trained


@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_fsdp1_on_the_cpu_saves_the_trained_model(tmp_path: Any, state_dict_type: str) -> None:
    """FSDP1 gathers a full state dict with `offload_to_cpu`; on the CPU torch freed the storage it
    had just "moved" there and rank 0 died of SIGSEGV at the first full save (patch
    `cpu-fsdp1-state-dict`), a checkpoint's under `FULL_STATE_DICT`, the final one under both."""
    import torch
    from safetensors.torch import load_file

    from fsdp_offload_cfg.testing.models import save_llama

    out = tmp_path / "out"
    trained, _ = run_workers(_fsdp1_worker, 2, save_llama(str(tmp_path / "llama")), str(out), state_dict_type,
                             timeout=180)  # fmt: skip
    saved = load_file(out / "final" / "model.safetensors")
    assert saved.keys() == trained.keys(), (sorted(saved), sorted(trained))
    assert all(torch.equal(saved[k], torch.from_numpy(trained[k])) for k in saved)
    checkpoint = os.listdir(out / "checkpoint-2")
    assert ("model.safetensors" in checkpoint) == (state_dict_type == "FULL_STATE_DICT"), checkpoint


# A base whose weights dwarf its adapters: 2 x 65536 x 128 float32 embedding rows are 64 MiB, the
# LoRA adapters (r=4 on q_proj, v_proj of 2 layers) 16 KiB.
_BIG_BASE = dict(vocab_size=65536, hidden_size=128, intermediate_size=256)
_BASE_BYTES = 2 * 65536 * 128 * 4


def _rank0_growth(save: Any) -> int:
    """How far this process's resident memory rose above where it stood, during `save()`: the
    kernel's own high-water mark (VmHWM, reset through /proc/self/clear_refs)."""
    import gc
    from pathlib import Path

    from fsdp_offload_cfg.testing.host_memory import status_bytes

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = status_bytes("VmRSS")
    save()
    return status_bytes("VmHWM") - before


def _lora_save_worker(rank: int, world_size: int, path: str, out: str, way: str) -> int:
    """One LoRA step, then the final save `way` takes (PEFT's `save_pretrained`, or the Trainer's
    `save_model` under a sharded state dict); then accelerate's recipe, which gathers the whole
    model, into `recipe`. Returns this rank's memory growth during the first save."""
    if way.startswith("trainer"):  # the Trainer's final save under FSDP2's default, or under FULL_STATE_DICT
        state_dict_type = "FULL_STATE_DICT" if way == "trainer_full" else "SHARDED_STATE_DICT"
        trainer = _trainer(path, out, "sharded", state_dict_type, True, max_steps=1, save_strategy="no")
        trainer.train()
        accelerator, model = trainer.accelerator, trainer.model
        grown = _rank0_growth(lambda: trainer.save_model(os.path.join(out, way)))
    else:
        accelerator, model = _accelerate_loop(path, "sharded", lora=True)
        model = accelerator.unwrap_model(model)
        grown = _rank0_growth(lambda: model.save_pretrained(os.path.join(out, way)))
    model.save_pretrained(os.path.join(out, "recipe"), is_main_process=accelerator.is_main_process,
                          state_dict=accelerator.get_state_dict(model))  # fmt: skip
    return grown


@pytest.mark.parametrize("way", ["save_pretrained", "trainer", "trainer_full"])
def test_a_lora_model_saves_its_adapters_without_gathering_its_base_on_rank_0(tmp_path: Any, way: str) -> None:
    """PEFT writes a LoRA model's adapters only, but the save gathered the whole model on rank 0's
    host first (as accelerate's `get_state_dict` does): a 70B base, 140 GB, to write 100 MB. Now
    only what PEFT writes is gathered: rank 0 grows by far less than the base, and writes the
    same adapters as the recipe that gathers everything. `trainer_full`: the Trainer's own
    gather under `FULL_STATE_DICT` (LlamaFactory's FSDP configs), which it makes at every
    checkpoint too."""
    import torch

    from fsdp_offload_cfg.testing.models import save_llama

    path = save_llama(str(tmp_path / "llama"), **_BIG_BASE)
    out = tmp_path / "out"
    rank0, _ = run_workers(_lora_save_worker, 2, path, str(out), way, timeout=240)
    saved, recipe = _files(str(out / way)), _files(str(out / "recipe"))
    name = "adapter_model.safetensors"
    assert saved[name].keys() == recipe[name].keys() and saved[name], sorted(saved[name])
    assert all(torch.equal(t, recipe[name][k]) for k, t in saved[name].items())
    assert rank0 < _BASE_BYTES / 4, f"rank 0 grew by {rank0 / 2**20:.1f} MiB to save 16 KiB of adapters"


def _apart_worker(rank: int, world_size: int, path: str, out: str) -> list[str]:
    """The ranks asking PEFT for different entries, as PEFT's "auto" may when its Hub check that
    the embeddings were resized answers one rank and not another: here, rank 1 asks for the
    embedding layers too."""
    from safetensors import safe_open

    accelerator, model = _accelerate_loop(path, "sharded", lora=True)
    accelerator.unwrap_model(model).save_pretrained(out, save_embedding_layers=rank == 1)
    accelerator.wait_for_everyone()
    with safe_open(os.path.join(out, "adapter_model.safetensors"), framework="pt") as f:
        return sorted(f.keys())


def test_ranks_that_would_pick_apart_gather_what_rank_0_picked(tmp_path: Any) -> None:
    from fsdp_offload_cfg.testing.models import save_llama

    rank0, rank1 = run_workers(_apart_worker, 2, save_llama(str(tmp_path / "llama")), str(tmp_path / "out"),
                               pg_timeout=20, timeout=180)  # fmt: skip
    assert rank0 == rank1 and rank0 and all("lora_" in k for k in rank0), rank0


def _whole_modules_worker(rank: int, world_size: int, path: str, out: str) -> None:
    """One step of LoRA with a layer trained whole (`modules_to_save`) and new token rows
    (`trainable_token_indices`), then `save_pretrained` on every rank; then the recipe's gather,
    written by rank 0 alone (stock PEFT raises on the other ranks too, given the empty dict
    accelerate's gather leaves there)."""
    import torch
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(loader_config("broadcast"))
    accelerator = Accelerator(cpu=True)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                           LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"],
                                      trainable_token_indices=[1, 2]))  # fmt: skip
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.arange(24).reshape(2, 12) % 90 + 1
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(os.path.join(out, "every_rank"))
    whole = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped.save_pretrained(os.path.join(out, "recipe"), state_dict=whole)


def test_a_lora_model_with_layers_trained_whole_saves_from_every_rank(tmp_path: Any) -> None:
    """PEFT's `save_pretrained` picks the entries it writes on every rank, writing or not; a
    `modules_to_save` or trainable-tokens wrapper raised KeyError on ranks other than 0, whose
    state dict (the gather's, empty there) lacked its entries, and rank 0 was left alone in the
    next collective. Those ranks now pick from stand-ins; rank 0 writes what the recipe writes,
    the whole layer and the new token rows included."""
    import torch
    from safetensors.torch import load_file

    from fsdp_offload_cfg.testing.models import save_llama

    out = tmp_path / "out"
    run_workers(_whole_modules_worker, 2, save_llama(str(tmp_path / "llama")), str(out), pg_timeout=30, timeout=180)
    saved, recipe = (load_file(out / way / "adapter_model.safetensors") for way in ("every_rank", "recipe"))
    assert saved.keys() == recipe.keys(), (sorted(saved), sorted(recipe))
    assert "base_model.model.lm_head.weight" in saved, sorted(saved)  # the layer trained whole
    assert "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta" in saved, sorted(saved)
    assert all(torch.equal(t, recipe[k]) for k, t in saved.items())


# Wide enough that gathering the model whole shows against gathering one weight at a time: 16
# layers of 1 MiB weights, the largest two (the embeddings) 4 MiB each, 80 MiB in all.
_WIDE = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=16)


def _malloc_gives_back_what_is_freed() -> None:
    """Every allocation of 64 KiB or more its own mapping, unmapped when freed: the resident
    high-water mark then follows what the process holds, not what glibc kept of earlier frees
    (the recipe's whole-model gather otherwise reuses the memory training freed, and shows as a
    fraction of the model)."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def _full_save_worker(rank: int, world_size: int, path: str, out: str, way: str) -> tuple[int, list[str]]:
    """One step of a full fine-tune, then the final save `way` takes (transformers'
    `save_pretrained` in 20 MB files, the Trainer's `save_model` under a sharded state dict or
    under `FULL_STATE_DICT`); then accelerate's recipe, which gathers the whole model, into
    `recipe`, in the same files. Returns this rank's memory growth during the first save, and
    what the plugin logged of the write."""
    from fsdp_offload_cfg._logging import get_logger

    _malloc_gives_back_what_is_freed()
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    get_logger("fsdp_offload_cfg.streamed_save").addHandler(handler)
    if way.startswith("trainer"):
        state_dict_type = "FULL_STATE_DICT" if way == "trainer_full" else "SHARDED_STATE_DICT"
        trainer = _trainer(path, out, "sharded", state_dict_type, False, max_steps=1, save_strategy="no")
        trainer.train()
        accelerator, model, files = trainer.accelerator, trainer.model, {}
        grown = _rank0_growth(lambda: trainer.save_model(os.path.join(out, way)))
    else:
        accelerator, model = _accelerate_loop(path, "sharded")
        model, files = accelerator.unwrap_model(model), {"max_shard_size": "20MB"}
        grown = _rank0_growth(lambda: model.save_pretrained(os.path.join(out, way), **files))
    model.save_pretrained(os.path.join(out, "recipe"), is_main_process=accelerator.is_main_process,
                          state_dict=accelerator.get_state_dict(model), **files)  # fmt: skip
    return grown, said


def _save_wide_moe(path: str) -> str:
    """A Qwen3-MoE whose experts are most of its 103 MiB: 16 layers of 16 experts, each layer's
    6 MiB (transformers 5 holds them fused, two tensors a layer, and writes one per expert).
    Saving a layer at a time holds 11-16 MiB on rank 0 (the layer gathered, its experts built,
    gloo's staging; the spread is the torch and transformers versions'): 16 layers keep that
    well under a quarter of the model."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(7)
    config = Qwen3MoeConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=16,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
                            num_experts_per_tok=2, moe_intermediate_size=256, max_position_embeddings=64,
                            tie_word_embeddings=False)  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("model, way", [("llama", "save_pretrained"), ("llama", "trainer"), ("llama", "trainer_full"),
                                        ("moe", "save_pretrained")])  # fmt: skip
def test_a_full_model_saves_with_rank_0_holding_one_weight_at_a_time(tmp_path: Any, model: str, way: str) -> None:
    """accelerate's recipe and the Trainer's saves gathered the whole model on rank 0's host before
    transformers wrote a byte (an 8B model: 15 GiB there, where training held 1/8 of it per rank).
    Now each weight is gathered as its bytes are written: rank 0 grows by far less than the model,
    and writes the recipe's files byte for byte (a tied weight aside, below). A MoE: transformers 5
    writes each expert's weights, which it builds from a layer's fused experts in the save; those
    are built on rank 0 from the layer's gathered tensor as they are written, one layer at a time
    (before, such a model was gathered whole)."""
    import json

    from fsdp_offload_cfg.testing.models import save_llama

    path = save_llama(str(tmp_path / "llama"), **_WIDE) if model == "llama" else _save_wide_moe(str(tmp_path / model))
    out = tmp_path / "out"
    (rank0, said), (_, rank1_said) = run_workers(_full_save_worker, 2, path, str(out), way, timeout=300)
    weights = sorted(p.name for p in (out / "recipe").iterdir() if p.suffix in (".safetensors", ".json"))
    assert (len(weights) > 3) == (way == "save_pretrained"), weights  # 20 MB files and their index, or one file
    for name in weights:
        saved, recipe = (out / way / name).read_bytes(), (out / "recipe" / name).read_bytes()
        assert (json.loads(saved) == json.loads(recipe)) if name.endswith(".json") else saved == recipe, name
    model_bytes = sum((out / "recipe" / name).stat().st_size for name in weights if name.endswith(".safetensors"))
    assert rank0 < model_bytes / 4, f"rank 0 grew by {rank0 / 2**20:.1f} MiB to save {model_bytes / 2**20:.0f} MiB"
    files = sum(name.endswith(".safetensors") for name in weights)
    assert said[0].startswith(f"writing {files} file(s), ") and "gathered to rank 0 as it is written" in said[0], said
    assert sum(line.startswith("wrote model") for line in said) == files and not rank1_said, (said, rank1_said)


def _save_model_worker(rank: int, world_size: int, path: str, out: str, mode: str, lora: bool) -> tuple[int, list[str]]:
    """One training step, then `accelerator.save_model` in 20 MB files into `ours`; then stock's
    `save_model` (the function the patch wraps), which gathers the whole model, into `stock`.
    Returns rank 0's memory growth during the first save, and what the plugin logged of it."""
    from fsdp_offload_cfg._logging import get_logger

    _malloc_gives_back_what_is_freed()
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    get_logger("fsdp_offload_cfg.streamed_save").addHandler(handler)
    accelerator, model = _accelerate_loop(path, mode, lora)
    grown = _rank0_growth(lambda: accelerator.save_model(model, os.path.join(out, "ours"), max_shard_size="20MB"))
    patched = type(accelerator).save_model
    stock = getattr(patched, "__wrapped__", patched)  # the function itself where nothing patched it
    stock(accelerator, model, os.path.join(out, "stock"), max_shard_size="20MB")
    return grown, said


@pytest.mark.parametrize("model, mode, lora", [("wide", "sharded", False), ("qwen2_tied", "loader_off", True)])
def test_accelerators_save_model_writes_stocks_files_with_rank_0_holding_one_weight_at_a_time(
        tmp_path: Any, model: str, mode: str, lora: bool) -> None:  # fmt: skip
    """`accelerator.save_model(model, dir)` gathered the whole model onto rank 0's host before
    writing, as the recipe does. Now each weight is gathered as its bytes are written: every file
    is stock's byte for byte (the split and index of a 20 MB `max_shard_size`; a tied weight under
    both its names, which accelerate writes; a LoRA model's base and adapters, all of it), and
    rank 0 grows by far less than the model."""
    from fsdp_offload_cfg.testing.models import save_llama, save_qwen2_tied

    path = save_llama(str(tmp_path / "llama"), **_WIDE) if model == "wide" else save_qwen2_tied(str(tmp_path / model))
    out = tmp_path / "out"
    (rank0, said), _ = run_workers(_save_model_worker, 2, path, str(out), mode, lora, timeout=300)
    names = sorted(p.name for p in (out / "stock").iterdir())
    assert names == sorted(p.name for p in (out / "ours").iterdir()), names
    assert (len(names) > 3) == (model == "wide"), names  # 20 MB files and their index, or one file
    for name in names:
        assert (out / "ours" / name).read_bytes() == (out / "stock" / name).read_bytes(), name
    written = _files(str(out / "ours"))
    keys = {key for tensors in written.values() if tensors for key in tensors}
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= {key.removeprefix("base_model.model.") for key in keys}
    assert any("lora_A" in key for key in keys) == lora, sorted(keys)
    if model == "wide":
        model_bytes = sum((out / "stock" / name).stat().st_size for name in names if name.endswith(".safetensors"))
        assert rank0 < model_bytes / 4, f"rank 0 grew by {rank0 / 2**20:.1f} MiB to save {model_bytes / 2**20:.0f} MiB"
    assert said and "gathered to rank 0 as it is written" in said[0], said


def _failing_save_worker(rank: int, world_size: int, path: str, out: str, where: str) -> str:
    """`save_pretrained` on every rank, failing on rank 0 alone: where it writes the weights
    (`write`: a folder stands at the file's path) or in the save itself (`save`: writing the
    config raises)."""
    import contextlib
    from unittest import mock

    accelerator, model = _accelerate_loop(path, "loader_off")
    model = accelerator.unwrap_model(model)
    target = os.path.join(out, "model")
    if rank == 0 and where == "write":
        os.makedirs(os.path.join(target, "model.safetensors"))
    failing = mock.patch.object(type(model.config), "save_pretrained", side_effect=OSError("no space left on device"))
    with failing if rank == 0 and where == "save" else contextlib.nullcontext():
        try:
            model.save_pretrained(target)
        except Exception as error:  # noqa: BLE001 - what each rank raised is the result
            return f"{type(error).__name__}: {error}"
    return "saved"


@pytest.mark.parametrize("where", ["write", "save"])
def test_a_save_that_fails_on_rank_0_stops_every_rank_saying_where(tmp_path: Any, where: str) -> None:
    """The weights are gathered after transformers' save returns, every rank in each gather: a
    rank 0 that failed, in the save or in writing, would leave the others waiting in the next
    gather until the process-group timeout. Every rank agrees first, and stops naming rank 0's
    error."""
    from fsdp_offload_cfg.testing.models import save_llama

    rank0, rank1 = run_workers(_failing_save_worker, 2, save_llama(str(tmp_path / "llama")), str(tmp_path / "out"),
                               where, pg_timeout=60, timeout=120)  # fmt: skip
    error = "IsADirectoryError" if where == "write" else "OSError: no space left on device"
    assert rank0.startswith(error), rank0
    assert rank1.startswith("RuntimeError") and f"rank 0: {error}" in rank1, rank1


def _fully_sharded_save_worker(rank: int, world_size: int, cls: str, path: str, out: str,
                               mesh_shape: tuple[int, ...]) -> list[int]:  # fmt: skip
    """The model (transformers' class `cls`) at `path` sharded by FSDP2 (every decoder and encoder layer, then the root) on a
    mesh of `mesh_shape` (`(2, 2)`: as accelerate shards for `dp_replicate_size=2,
    dp_shard_size=2`), saved untrained on every rank. Returns how many tensors each file this rank
    wrote through transformers' writer held (transformers 4.x writes on every rank, main or not)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(loader_config("loader_off"))
    import transformers
    from transformers import modeling_utils

    model = getattr(transformers, cls).from_pretrained(path)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp_replicate", "dp_shard")[-len(mesh_shape):])
    for module in model.modules():
        if type(module).__name__.endswith(("DecoderLayer", "EncoderLayer")):
            fully_shard(module, mesh=mesh)
    write, written = modeling_utils.safe_save_file, []
    modeling_utils.safe_save_file = lambda tensors, *a, **k: written.append(len(tensors)) or write(tensors, *a, **k)
    fully_shard(model, mesh=mesh).save_pretrained(out)
    return written


def _saved_as_loaded(path: str, out: str) -> None:
    import torch

    saved, loaded = _files(out)["model.safetensors"], _files(path)["model.safetensors"]
    assert saved.keys() == loaded.keys(), sorted(set(saved) ^ set(loaded))
    assert all(torch.equal(t, loaded[k]) for k, t in saved.items())


@pytest.mark.parametrize("model, cls", [("llava", "LlavaForConditionalGeneration"),
                                        ("qwen2_vl", "Qwen2VLForConditionalGeneration")])  # fmt: skip
def test_a_vision_language_model_saves_what_it_loaded(tmp_path: Any, model: str, cls: str) -> None:
    """transformers renames a VLM's keys on save (4.57: `_checkpoint_conversion_mapping`, before
    its tied-weight check, which stopped on the renamed stand-ins; 5: reverting its load-time
    renames)."""
    from fsdp_offload_cfg.testing import models

    path = getattr(models, f"save_{model}")(str(tmp_path / model))
    written = run_workers(_fully_sharded_save_worker, 2, cls, path, str(tmp_path / "out"), (2,), timeout=180)
    assert not any(written[1]), written  # a weight rank 1 wrote would race rank 0's in the same file
    _saved_as_loaded(path, str(tmp_path / "out"))


def test_a_model_sharded_on_a_2d_mesh_saves_what_it_loaded(tmp_path: Any) -> None:
    """Under HSDP a weight is sharded on one mesh dimension and replicated on the other, which a
    gather of row blocks to rank 0 does not cover: each weight is gathered whole on every rank
    (`full_tensor`), still one at a time."""
    from fsdp_offload_cfg.testing.models import save_llama

    path = save_llama(str(tmp_path / "llama"))
    written = run_workers(_fully_sharded_save_worker, 4, "LlamaForCausalLM", path, str(tmp_path / "out"), (2, 2),
                          timeout=180)  # fmt: skip
    assert not any(n for rank in written[1:] for n in rank), written
    _saved_as_loaded(path, str(tmp_path / "out"))


def _own_writer_worker(rank: int, world_size: int, path: str, out: str) -> None:
    """The final save of a Trainer whose own `_save` computes on the state dict (halves every
    weight), as a framework's writer may."""
    import torch

    trainer = _trainer(path, out, "sharded", "SHARDED_STATE_DICT", False, max_steps=1, save_strategy="no")

    class HalvingTrainer(type(trainer)):  # type: ignore[misc]
        def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
            halves = {name: value.to(torch.float16) for name, value in (state_dict or {}).items()}
            super()._save(output_dir, state_dict=halves)

    trainer.__class__ = HalvingTrainer
    trainer.train()
    trainer.save_model(os.path.join(out, "halved"))
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.save_pretrained(os.path.join(out, "recipe"), is_main_process=trainer.accelerator.is_main_process,
                          state_dict=trainer.accelerator.get_state_dict(model))  # fmt: skip


def test_a_trainer_whose_own_writer_computes_on_the_state_dict_gets_it_whole(tmp_path: Any) -> None:
    """Stand-ins of the weights go only to the Trainer's own `_save`, which hands them to
    `save_pretrained` as they are; a subclass's `_save` (ms-swift has its own) gets the gathered
    weights, as before, and may compute on them."""
    import torch

    from fsdp_offload_cfg.testing.models import save_llama

    run_workers(_own_writer_worker, 2, save_llama(str(tmp_path / "llama")), str(tmp_path / "out"), timeout=240)
    halved = _files(str(tmp_path / "out" / "halved"))["model.safetensors"]
    recipe = _files(str(tmp_path / "out" / "recipe"))["model.safetensors"]
    assert halved.keys() == recipe.keys()
    assert all(torch.equal(t, recipe[k].to(torch.float16)) for k, t in halved.items())
