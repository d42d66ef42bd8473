"""Script shapes real users write, on real gloo ranks with `patch()` as the script's first call:
a load that only some ranks make, a model loaded but never prepared, `local_loading()`, and
`patch()` after `Accelerator()`. Each must behave like the plain script or fail clearly and fast,
never hang.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.logs import MessageLog

pytestmark = pytest.mark.distributed

# What `accelerate launch --config_file fsdp2.yaml` users write, as `patch()` reads it.
CONFIG = {
    "distributed_type": "FSDP",
    "fsdp_config": {
        "fsdp_version": 2,
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
    },
}
IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


def _config(strategy: str | None) -> dict[str, Any]:
    """CONFIG (load_strategy auto, the default), or with `strategy` written."""
    if strategy is None:
        return CONFIG
    return {**CONFIG, "fsdp_config": {**CONFIG["fsdp_config"], "load_strategy": strategy}}


def _meta_params(model: torch.nn.Module) -> int:
    """Parameters on meta, counted without `state_dict()` (which reads an unprepared model whole)."""
    return sum(p.is_meta for p in model.parameters())


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from fsdp_offload_cfg.testing.models import save_llama

    return save_llama(str(tmp_path_factory.mktemp("ckpt") / "llama"))


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------------------------
# a load on the main process only
# --------------------------------------------------------------------------------------------


def _main_process_only_worker(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(CONFIG)
    out: dict[str, Any] = {}
    start = time.monotonic()
    if rank == 0:  # `if accelerator.is_main_process:` (export, evaluation)
        ref = AutoModelForCausalLM.from_pretrained(path)
        scratch = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        out["ref_meta"] = sum(t.is_meta for t in ref.state_dict().values())
        out["scratch_meta"] = sum(t.is_meta for t in scratch.state_dict().values())
        out["logits_finite"] = bool(torch.isfinite(ref(IDS).logits).all())
        with fsdp_offload_cfg.local_loading():
            plain = AutoModelForCausalLM.from_pretrained(path)
        out["equal_to_plain"] = _same(_state(ref), _state(plain))
    dist.barrier()  # `accelerator.wait_for_everyone()`
    out["seconds"] = time.monotonic() - start
    # the ranks stay in step afterwards: a load that every rank makes still works
    model = AutoModelForCausalLM.from_pretrained(path)
    out["all_rank_load_meta"] = _meta_params(model)
    out["all_rank_load_tensors"] = len(list(model.parameters()))
    return out


def test_a_load_on_the_main_process_only_is_a_plain_load(llama: str) -> None:
    """`if is_main_process: from_pretrained(p)` then `wait_for_everyone()` used to hang until the
    process-group timeout. Rank 0 now gets exactly the model a plain load gives, at once."""
    rank0, rank1 = run_workers(_main_process_only_worker, 2, llama, pg_timeout=60, timeout=120)
    assert rank0["ref_meta"] == 0 and rank0["scratch_meta"] == 0
    assert rank0["logits_finite"] and rank0["equal_to_plain"]
    assert rank1["seconds"] < 30, "rank 1 waited for rank 0's solo load"
    for r in (rank0, rank1):  # the loader is still on: every rank, rank 0 included, is on meta until prepare
        assert r["all_rank_load_meta"] == r["all_rank_load_tensors"] > 0


def _values_read_worker(rank: int, world_size: int, path: str, strategy: str | None) -> dict[str, Any]:
    """Rank 0 alone loads, then reaches the weights every way a script does before any forward
    or `state_dict()`; each value is compared with a plain load's."""
    import copy

    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(_config(strategy))
    out: dict[str, Any] = {}
    if rank == 0:
        with fsdp_offload_cfg.local_loading():
            plain = AutoModelForCausalLM.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path)
        head = model.lm_head.weight
        checks = {
            "sum": lambda: torch.equal(head.sum(), plain.lm_head.weight.sum()),
            "data": lambda: torch.equal(model.model.norm.weight.data * 1, plain.model.norm.weight),
            "detach": lambda: torch.equal(model.model.embed_tokens.weight.detach().clone(), plain.model.embed_tokens.weight),
            "repr": lambda: repr(model.model.layers[0].mlp.up_proj.weight) == repr(plain.model.layers[0].mlp.up_proj.weight),
            "saved": lambda: torch.equal(_saved_and_loaded(model.model.layers[0].mlp.down_proj.weight),
                                         plain.model.layers[0].mlp.down_proj.weight),
            "indexed": lambda: torch.equal(model.model.layers[1].self_attn.q_proj.weight[0],
                                           plain.model.layers[1].self_attn.q_proj.weight[0]),
        }
        for name, check in checks.items():
            out[name] = check()
        out["same_object"] = model.lm_head.weight is head  # read in place: every holder sees the values
        out["params"] = len(list(model.parameters()))
        out["still_meta"] = _meta_params(model)
        model.to(torch.bfloat16)  # a cast reads nothing
        out["meta_after_cast"] = _meta_params(model)
        twin = copy.deepcopy(model)  # a copy reads nothing either, and reads its own values later
        out["twin_meta"] = _meta_params(twin)
        out["twin_value"] = torch.equal(twin.model.layers[1].self_attn.k_proj.weight,
                                        plain.model.layers[1].self_attn.k_proj.weight.to(torch.bfloat16))
        reference = plain.to(torch.bfloat16)
        with torch.no_grad():
            out["forward"] = torch.equal(model(IDS).logits, reference(IDS).logits)
            out["twin_forward"] = torch.equal(twin(IDS).logits, reference(IDS).logits)
        out["meta_left"] = _meta_params(model) + _meta_params(twin)
        out["classes"] = sorted({type(t).__name__ for m in (model, twin) for t in [*m.parameters(), *m.buffers()]})
    dist.barrier()
    return out


def _saved_and_loaded(t: torch.Tensor) -> torch.Tensor:
    import io

    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize("strategy", [None, "sharded"], ids=["auto", "sharded"])
def test_a_main_process_only_load_gives_real_values_wherever_they_are_read(llama: str, strategy: str | None) -> None:
    """Issue 45 item 8: under auto and sharded rank 0's solo load is built on meta like one that
    `prepare` fills. `model.lm_head.weight.sum()`, `.data`, `.detach()`, printing, `torch.save`,
    indexing and `copy.deepcopy` each gave meta tensors without a word; now each tensor reads
    itself from the files where its values are used, in place, and a cast or a copy reads nothing."""
    rank0, _ = run_workers(_values_read_worker, 2, llama, strategy, timeout=120)
    for check in ("sum", "data", "detach", "repr", "saved", "indexed", "same_object", "twin_value", "forward",
                  "twin_forward"):
        assert rank0[check] is True, (check, rank0)
    assert rank0["still_meta"] == rank0["params"] - 6, rank0  # exactly the six tensors used were read
    assert rank0["meta_after_cast"] == rank0["still_meta"] and rank0["twin_meta"] == rank0["still_meta"], rank0
    assert rank0["meta_left"] == 0 and rank0["classes"] == ["Parameter", "Tensor"], rank0


def _other_rank_only_worker(rank: int, world_size: int, path: str, strategy: str | None) -> str:
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg
    import fsdp_offload_cfg.loading.mailbox as sync

    fsdp_offload_cfg.patch(_config(strategy))
    sync.WAIT_LOG_EVERY_S = 1.0
    warnings = MessageLog("fsdp_offload_cfg.loading", logging.WARNING)
    start = time.monotonic()
    try:
        if rank == 1:
            AutoModelForCausalLM.from_pretrained(path)
        dist.barrier()
    except Exception as exc:  # noqa: BLE001
        return f"{time.monotonic() - start:.1f}s|{warnings[:1]}|{type(exc).__name__}: {exc}"
    return "no error"


def test_a_load_that_rank_0_skips_raises_naming_the_checkpoint_and_local_loading(llama: str) -> None:
    """Under broadcast rank 1 builds from rank 0's description, which never comes."""
    pg_timeout = 5.0
    results = run_workers(_other_rank_only_worker, 2, llama, "broadcast", pg_timeout=pg_timeout, expect_errors=True,
                          timeout=90)  # fmt: skip
    seconds, warned, message = results[1].split("|", 2)
    assert message.startswith("RuntimeError: rank 1 waited"), message
    assert llama in message and "local_loading()" in message and "rank 0 never started it" in message
    assert pg_timeout <= float(seconds[:-1]) < pg_timeout + 10
    assert "rank 0 has not started it" in warned and "local_loading()" in warned, warned  # logged while waiting
    assert "no error" not in results[0]  # rank 0's barrier timed out: no rank is left waiting


def test_a_load_that_rank_0_skips_is_a_load_of_its_own_under_auto(llama: str) -> None:
    """Under auto (the default) rank 1 builds from the files itself: nothing waits on rank 0."""
    assert run_workers(_other_rank_only_worker, 2, llama, None, pg_timeout=30, timeout=90) == ["no error"] * 2


# A script as `srun python train.py` starts it on each rank (no torchrun agent to stop the job when
# a rank exits), where rank 1 fails alone: its node lacks a package the model's `__init__` needs
# ("build"), or its data ("script", after the load).
_ONE_RANK_FAILS = """
import json, sys, time
from datetime import timedelta
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, LlamaForCausalLM
import fsdp_offload_cfg
from fsdp_offload_cfg.loading import load_into_sharded

path, config, pg_timeout = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
failing, fails_in = int(sys.argv[4]), sys.argv[5]
fsdp_offload_cfg.patch(config)
dist.init_process_group("gloo", timeout=timedelta(seconds=pg_timeout))
rank = dist.get_rank()
if rank == failing and fails_in == "build":
    def needs_a_package(*args, **kwargs):
        raise ImportError("flash_attn is not installed on this node")
    LlamaForCausalLM.__init__ = needs_a_package
model = AutoModelForCausalLM.from_pretrained(path)
if rank == failing and fails_in == "script":
    raise FileNotFoundError("no dataset at /data/train.jsonl on this node")
if failing == 0:  # rank 1 comes to prepare late, as after a long dataset step
    store, deadline = dist.distributed_c10d._get_default_store(), time.monotonic() + 60
    try:
        while time.monotonic() < deadline:  # until rank 0's note is there ("build"), its store gone ("script")
            if store.check(["fsdp_offload_cfg/gone/rank0"]) and fails_in == "build":
                time.sleep(3)  # long after rank 0's process would have ended, taking its store
                break
            time.sleep(0.05)
    except dist.DistNetworkError:
        pass
start = time.monotonic()
try:
    load_into_sharded(model, fully_shard, strategy=config["fsdp_config"].get("load_strategy", "auto"))
except Exception as exc:
    print(f"stopped after {time.monotonic() - start:.1f}s: {type(exc).__name__}: {exc}", flush=True)
    raise
"""


@pytest.mark.parametrize(("strategy", "failing", "fails_in"),
                         [(None, 1, "build"), ("sharded", 1, "build"), (None, 1, "script"), (None, 0, "build"),
                          (None, 0, "script")],
                         ids=["auto-build", "sharded-build", "auto-script", "rank0-auto-build", "rank0-auto-script"])  # fmt: skip
@pytest.mark.launches
def test_a_rank_that_fails_alone_before_prepare_stops_the_others_there_naming_it(
        llama: str, strategy: str | None, failing: int, fails_in: str, tmp_path: Any) -> None:
    """A load has no collective (a rank may load alone), so a rank whose build fails raises
    alone. Under a launcher that starts each rank itself, the others then waited in prepare's
    first collective: on NCCL until the process-group timeout, on gloo until the dead peer's
    socket failed them with a message about connections. Now the failing rank's uncaught error
    leaves a note in the store, and prepare, which opens with a meeting there, names it at once.
    Under auto rank 1 tries the files itself, then rank 0's description; under sharded only the
    files. Any error that ends a rank before prepare is named the same way (its script's own:
    "script"). Rank 0 hosts the store: failed at its load, it stays until rank 1, come late, has
    read why; failed in its script, it does not, and rank 1 says the store is gone with rank 0
    (before: `DistNetworkError: Broken pipe`, both)."""
    import json
    import os
    import subprocess
    import sys
    import time

    from fsdp_offload_cfg.testing.dist import free_port

    script = tmp_path / "train.py"
    script.write_text(_ONE_RANK_FAILS)
    pg_timeout = 60.0
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "CUDA_VISIBLE_DEVICES": ""}
    args = [llama, json.dumps(_config(strategy)), str(pg_timeout), str(failing), fails_in]
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(script), *args],
                              env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]  # fmt: skip
    try:
        outputs = [p.communicate(timeout=150) for p in procs]
    finally:  # a rank left waiting (before: on NCCL, until the timeout) must not outlive the test
        for p in procs:
            p.kill()
    seconds = time.monotonic() - start
    peer = 1 - failing
    (out, err), failed_err = outputs[peer], outputs[failing][1]
    error = {"build": "ImportError: flash_attn is not installed on this node",
             "script": "FileNotFoundError: no dataset at /data/train.jsonl on this node"}[fails_in]
    assert procs[failing].returncode == 1 and error in failed_err, failed_err[-2000:]
    assert procs[peer].returncode == 1, err[-2000:]
    waited, message = out.removeprefix("stopped after ").split("s: ", 1)
    if failing == 0 and fails_in == "script":  # nothing to read: gone with rank 0
        assert message.startswith(f"StoreLost: rank 1 lost the process group's store (127.0.0.1:{env['MASTER_PORT']}) "
                                  "while it waited for every rank to prepare the model the loader built"), message
        assert "that is rank 0, whose own output says why it stopped" in message, message
        return
    assert message.startswith(f"RuntimeError: rank {failing} will not prepare the model the loader built"), out + err
    step = {(1, "build"): "failed to load ", (0, "build"): "failed to describe "}.get((failing, fails_in))
    assert f"rank {failing} {step or 'exited on an uncaught '}" in message, message
    assert error in message and float(waited) < pg_timeout / 2, out
    assert seconds < 45, seconds  # rank 0, staying, left when rank 1 had read its note (at most it stays 60s)


def _late_to_prepare_worker(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    from fsdp_offload_cfg.loading.prepare import _every_rank_prepares

    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # a long step of its own: rank 0 has given up on it by the time it comes
        store.wait(["rank 0 gave up"])
    try:
        _every_rank_prepares()
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    if rank == 0:
        store.set("rank 0 gave up", "1")
    return message


def test_a_rank_that_comes_to_prepare_after_the_others_gave_up_stops_saying_so() -> None:
    """Rank 0 waits out the process-group timeout at prepare's meeting and stops naming rank 1;
    rank 1, come later, stops too (alone it would wait in rank 0's collectives), and says that it
    came late. Before, its message named no rank: "ranks  will not prepare the model ..."."""
    rank0, rank1 = run_workers(_late_to_prepare_worker, 2, pg_timeout=2, timeout=120)
    assert rank0 == ("rank 1 will not prepare the model the loader built, so rank 0 stops here instead of waiting "
                     "for it in a collective: rank 1 did not come within the process-group timeout (2s)"), rank0
    assert rank1 == ("the other ranks stopped waiting before rank 1 came to prepare the model the loader built, so "
                     "it stops here too instead of going into a collective alone: this rank came after the others "
                     "had stopped waiting for it"), rank1


@pytest.mark.launches
def test_under_torchrun_rank_0_failed_at_its_load_does_not_stay(llama: str, tmp_path: Any) -> None:
    """Under torchrun (and `accelerate launch`, which runs it) the agent hosts the store, not rank 0
    (`TORCHELASTIC_USE_AGENT_STORE=True`): rank 0, failed at its load, exits with its error at
    once, and the agent stops rank 1. Staying there would hold the whole job's exit for nothing:
    the store outlives rank 0 anyway, and the agent stops the others as soon as rank 0 exits."""
    import json
    import os
    import subprocess
    import sys

    from fsdp_offload_cfg.testing.dist import free_port

    script = tmp_path / "train.py"
    script.write_text(_ONE_RANK_FAILS)
    args = [llama, json.dumps(_config(None)), "60", "0", "build"]
    launch = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", str(free_port()), str(script), *args],
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                            timeout=150)  # fmt: skip
    output = launch.stdout + launch.stderr
    assert launch.returncode != 0, output[-3000:]
    assert "ImportError: flash_attn is not installed on this node" in output, output[-3000:]
    assert "it stays up to" not in output, output[-3000:]  # the warning of a rank 0 that hosts the store


# --------------------------------------------------------------------------------------------
# a model loaded on every rank but never prepared; local_loading()
# --------------------------------------------------------------------------------------------


def _unprepared_worker(rank: int, world_size: int, path: str, strategy: str | None) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(_config(strategy))
    out: dict[str, Any] = {}
    teacher = AutoModelForCausalLM.from_pretrained(path)
    calls = {"unprepared": lambda: teacher(IDS), "unprepared_body": lambda: teacher.model(IDS),
             "unprepared_head": lambda: teacher.lm_head(torch.zeros(1, teacher.config.hidden_size))}
    for name, call in calls.items():  # the model, and parts of it called on their own
        try:
            call()
            out[name] = "no error"
        except RuntimeError as exc:
            out[name] = str(exc)
    torch.manual_seed(0)  # the classifier head is not in the checkpoint: every rank draws it alike
    with fsdp_offload_cfg.local_loading():
        local = AutoModelForCausalLM.from_pretrained(path)
        # a key missing from the checkpoint: transformers' own FSDP gate would leave it
        # uninitialised on ranks other than local rank 0, unless local_loading() turns it off
        classifier = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3)
    out["local_meta"] = sum(t.is_meta for m in (local, classifier) for t in m.state_dict().values())
    for name, outputs in [("local", local(IDS).logits), ("classifier", classifier(IDS).logits)]:
        gathered = [torch.empty_like(outputs) for _ in range(world_size)]
        dist.all_gather(gathered, outputs)
        out[f"{name}_same_on_every_rank"] = all(torch.equal(g, gathered[0]) for g in gathered)
    return out


def test_an_unprepared_model_refuses_its_forward_and_local_loading_gives_a_full_copy(llama: str) -> None:
    """Under broadcast rank 1 holds a description, not the files: its unprepared model refuses.
    Rank 0 holds the checkpoint record: it reads the model whole at the first forward."""
    rank0, rank1 = run_workers(_unprepared_worker, 2, llama, "broadcast", timeout=120)
    assert rank0["unprepared"] == rank0["unprepared_body"] == rank0["unprepared_head"] == "no error"  # plain there
    message = rank1["unprepared"]
    assert "still on the meta device on rank 1" in message, message
    assert "prepare" in message and "local_loading()" in message and llama in message
    # the guard sat on the top module only; its parts reached meta tensors
    assert "still on the meta device on rank 1 (its part `model.embed_tokens`" in rank1["unprepared_body"], rank1
    assert "still on the meta device on rank 1 (its part `lm_head`" in rank1["unprepared_head"], rank1
    for out in (rank0, rank1):
        assert out["local_meta"] == 0 and out["local_same_on_every_rank"] and out["classifier_same_on_every_rank"]


def test_an_unprepared_model_under_auto_is_read_whole_where_it_is_used(llama: str) -> None:
    """Under auto every rank holds the checkpoint record: an unprepared model (a teacher used
    without prepare) reads itself whole from the files on the rank that calls it, like a plain load."""
    for out in run_workers(_unprepared_worker, 2, llama, None, timeout=120):
        assert out["unprepared"] == out["unprepared_body"] == out["unprepared_head"] == "no error", out


# --------------------------------------------------------------------------------------------
# patch() after Accelerator()
# --------------------------------------------------------------------------------------------


def _late_patch_worker(rank: int, world_size: int) -> str:
    from accelerate import Accelerator

    import fsdp_offload_cfg

    Accelerator(cpu=True)
    try:
        fsdp_offload_cfg.patch(CONFIG)
    except RuntimeError as exc:
        return f"{exc} | active: {fsdp_offload_cfg.active_config()}"
    return "patched"


def test_patch_after_accelerator_is_refused_on_every_rank() -> None:
    for message in run_workers(_late_patch_worker, 2, timeout=90):
        assert "after Accelerator() was created" in message and "patch() first" in message, message
        assert message.endswith("active: None")


# --------------------------------------------------------------------------------------------
# a model loaded before the config was active
# --------------------------------------------------------------------------------------------

TRAINER_FSDP_CONFIG = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                       "cpu_ram_efficient_loading": True}


def _load_order_worker(rank: int, world_size: int, path: str, shape: str) -> dict[str, Any]:
    """`shape`: where `from_pretrained` stands against what makes the config active: `patch(CONFIG)`
    (an accelerate script) or `TrainingArguments(fsdp_config=...)` (a Trainer script)."""
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    trainer = shape.startswith("trainer")
    load_first = shape.endswith("load_first")
    with MessageLog(level=logging.WARNING) as warnings:
        if load_first:
            model = AutoModelForCausalLM.from_pretrained(path)
        fsdp_offload_cfg.patch(None if trainer else CONFIG)
        if trainer:
            from transformers import Trainer, TrainingArguments

            args = TrainingArguments(output_dir="unused", max_steps=1, per_device_train_batch_size=1, report_to=[],
                                     save_strategy="no", use_cpu=True, fsdp=True, fsdp_config=TRAINER_FSDP_CONFIG)
        if not load_first:
            model = AutoModelForCausalLM.from_pretrained(path)
        meta_before_prepare = _meta_params(model)
        if trainer:
            Trainer(model=model, args=args, train_dataset=[{"input_ids": IDS[0], "labels": IDS[0]}]).train()
            return {"warnings": list(warnings), "meta_before_prepare": meta_before_prepare}
        from accelerate import Accelerator

        accelerator = Accelerator()
        prepared = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))[0]
        state = accelerator.get_state_dict(prepared)
    out: dict[str, Any] = {"warnings": list(warnings), "meta_before_prepare": meta_before_prepare}
    if rank == 0:
        with fsdp_offload_cfg.local_loading():
            out["equal_to_plain"] = _same(state, _state(AutoModelForCausalLM.from_pretrained(path)))
    return out


@pytest.mark.parametrize("shape", ["patch_load_first", "trainer_load_first"])
def test_a_model_loaded_before_the_config_is_said_to_have_cost_every_rank_the_whole_model(llama: str, shape: str) -> None:
    """`from_pretrained` before `TrainingArguments(fsdp_config={cpu_ram_efficient_loading: True})`
    (or before `patch()`) loads the whole model on every rank, which is what meta loading exists to
    avoid; stock transformers says nothing. Rank 0 says so once, naming the ranks, the size and the
    fix for the script's shape; the prepared model is still exactly the plain load."""
    rank0, rank1 = run_workers(_load_order_worker, 2, llama, shape, timeout=180)
    assert rank0["meta_before_prepare"] == rank1["meta_before_prepare"] == 0  # whole on every rank
    said = [w for w in rank0["warnings"] if "reached prepare whole on rank 1" in w]
    assert len(said) == 1, rank0["warnings"]
    assert "LlamaForCausalLM" in said[0] and "cpu_ram_efficient_loading" in said[0] and "KiB" in said[0], said
    fix = "after TrainingArguments(fsdp_config=...)" if shape.startswith("trainer") else "after fsdp_offload_cfg.patch()"
    assert fix in said[0], said
    assert not any("reached prepare whole" in w for w in rank1["warnings"])  # rank 0 alone says it
    if not shape.startswith("trainer"):
        assert rank0["equal_to_plain"], "a model loaded whole everywhere is still filled as a plain load"


@pytest.mark.parametrize("shape", ["patch_config_first", "trainer_config_first"])
def test_a_model_loaded_after_the_config_draws_no_such_warning(llama: str, shape: str) -> None:
    rank0, rank1 = run_workers(_load_order_worker, 2, llama, shape, timeout=180)
    assert rank1["meta_before_prepare"] > 0  # the loader kept rank 1 on meta
    for out in (rank0, rank1):
        assert not any("reached prepare whole" in w for w in out["warnings"]), out["warnings"]
    if not shape.startswith("trainer"):
        assert rank0["equal_to_plain"]


# --------------------------------------------------------------------------------------------
# a model built by its own code (no from_pretrained): a torch module, a transformers class
# --------------------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.register_buffer("scale", torch.full((width,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x) * self.scale


class _Net(torch.nn.Module):
    """A model of the user's own, as in a nanoGPT-style script: no transformers anywhere."""

    def __init__(self, width: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _own_code_worker(rank: int, world_size: int, path: str, shape: str) -> dict[str, Any]:
    """`shape`: `torch_whole` (every rank builds `_Net()`, each with its own seed), `torch_meta`
    (the ranks but 0 build it under `torch.device("meta")`), `transformers_class` (every rank calls
    `LlamaForCausalLM(config)` after `patch()`)."""
    import fsdp_offload_cfg

    config = {**CONFIG, "fsdp_config": {**CONFIG["fsdp_config"], "fsdp_transformer_layer_cls_to_wrap": "_Block"}}
    torch.manual_seed(rank if shape == "torch_meta" else 0)  # on meta: rank 0's values must reach rank 1
    with MessageLog(level=logging.WARNING) as warnings:
        fsdp_offload_cfg.patch(CONFIG if shape == "transformers_class" else config)
        if shape == "transformers_class":
            from transformers import AutoConfig, LlamaForCausalLM

            model: torch.nn.Module = LlamaForCausalLM(AutoConfig.from_pretrained(path))
        else:
            with torch.device("meta") if shape == "torch_meta" and rank > 0 else torch.device("cpu"):
                model = _Net()
        before = _state(model) if rank == 0 else {}
        from accelerate import Accelerator

        accelerator = Accelerator()
        prepared = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))[0]
        after = {k: getattr(v, "full_tensor", lambda v=v: v)().detach().clone() for k, v in prepared.state_dict().items()}
        buffers = {n: b.clone() for n, b in prepared.named_buffers()}
    out: dict[str, Any] = {"warnings": list(warnings), "buffers_are_rank_0s": all(
        torch.equal(b, torch.full_like(b, 0.5)) for n, b in buffers.items() if n.endswith("scale"))}
    out["digest"] = [float(v.double().sum()) for _, v in sorted(after.items())]
    if rank == 0:
        out["equal_to_rank_0s_own"] = [float(v.double().sum()) for _, v in sorted(before.items())] == out["digest"]
    return out


def test_a_torch_model_built_whole_on_every_rank_is_said_with_how_to_build_it_on_meta(llama: str) -> None:
    """A model of the user's own code under the default meta loading: no loader built it, so every
    rank held it whole; the warning said "loaded before the config was active" and "load it after
    patch()", which the script already did. It now says what happened and how to build it on meta
    on the other ranks."""
    rank0, rank1 = run_workers(_own_code_worker, 2, llama, "torch_whole", timeout=120)
    said = [w for w in rank0["warnings"] if "reached prepare whole on rank 1" in w]
    assert len(said) == 1, rank0["warnings"]
    assert "_Net is not a transformers model" in said[0] and "before the config was active" not in said[0], said
    assert 'torch.device("meta")' in said[0] and "accelerator.is_main_process" in said[0], said
    assert rank0["equal_to_rank_0s_own"] and rank0["digest"] == rank1["digest"]
    assert not any("reached prepare whole" in w for w in rank1["warnings"])


def test_a_torch_model_built_on_meta_beyond_rank_0_is_filled_from_rank_0_without_a_warning(llama: str) -> None:
    """What the warning above advises works: the ranks but 0 build on meta, prepare fills their
    shards and buffers (a non-persistent one too) from rank 0 (seeded apart from rank 1)."""
    rank0, rank1 = run_workers(_own_code_worker, 2, llama, "torch_meta", timeout=120)
    for out in (rank0, rank1):
        assert not any("reached prepare whole" in w for w in out["warnings"]), out["warnings"]
        assert out["buffers_are_rank_0s"]
    assert rank0["equal_to_rank_0s_own"] and rank0["digest"] == rank1["digest"]


def test_a_transformers_class_built_by_its_constructor_is_named_as_a_cause(llama: str) -> None:
    """`LlamaForCausalLM(config)` after `patch()` goes through no loader: the warning names that
    cause beside a load before the config, and from_pretrained / from_config as the fix."""
    rank0, _ = run_workers(_own_code_worker, 2, llama, "transformers_class", timeout=120)
    said = [w for w in rank0["warnings"] if "reached prepare whole on rank 1" in w]
    assert len(said) == 1, rank0["warnings"]
    assert "LlamaForCausalLM(config)" in said[0] and "from_config" in said[0], said
    assert rank0["equal_to_rank_0s_own"]
