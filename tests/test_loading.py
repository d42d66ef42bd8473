"""Rank-0 meta loading on real gloo ranks, compared bit for bit with a plain single-process load.

Spawning a rank costs seconds (importing transformers), so each launch runs many cases: one
2-rank launch runs the whole model matrix (results are asserted per case below), one covers
failure propagation, one simulates 2 nodes x 2 processes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import run_workers

pytestmark = pytest.mark.distributed

BUCKET = 4096  # tiny buckets: every model spans many buckets, some tensors exceed one
STEP_INPUT = [[3, 14, 15, 92, 65, 35, 89, 79], [32, 38, 46, 26, 43, 38, 32, 79]]


# --------------------------------------------------------------------------------------------
# helpers that run inside the ranks
# --------------------------------------------------------------------------------------------


def _install_patches() -> None:
    """Route transformers' loaders through ours, the way `patch()` will (so that Auto classes and
    sub-models created in `__init__` take the real code path)."""
    from transformers import PreTrainedModel

    from fsdp_offload_cfg.loading import rank0_from_config, rank0_from_pretrained

    if getattr(PreTrainedModel, "_test_patched", False):
        return
    orig_pretrained = PreTrainedModel.from_pretrained.__func__
    orig_config = PreTrainedModel._from_config.__func__
    PreTrainedModel.from_pretrained = classmethod(
        lambda cls, *a, **k: rank0_from_pretrained(orig_pretrained, cls, *a, **k)
    )
    PreTrainedModel._from_config = classmethod(lambda cls, c, **k: rank0_from_config(orig_config, cls, c, **k))
    PreTrainedModel._test_patched = True


def _shard(model: nn.Module, layer_classes: set[str], offload: bool = False, upcast: bool = False) -> nn.Module:
    """What accelerate's fsdp2_prepare_model does: one unit per layer, a tail unit
    [norm, embed, lm_head] when tied (reshard_after_forward=False), then the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

    kwargs: dict[str, Any] = {}
    if offload:  # pinning needs an accelerator
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if upcast:
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.to(torch.float32)
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    for m in reversed(layers):
        fully_shard(m, **kwargs)
    get_in = getattr(model, "get_input_embeddings", None)
    emb, out = (model.get_input_embeddings(), model.get_output_embeddings()) if get_in else (None, None)
    if emb is not None and out is not None and emb.weight is out.weight and not isinstance(emb, FSDPModule):
        fully_shard([emb, out], reshard_after_forward=False, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _all_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (gathered) copy of every parameter and buffer, in sorted order on every rank."""
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    out = {}
    for name in sorted(named):
        t = named[name]
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
    return out


def _digest(t: torch.Tensor) -> str:
    data = t.contiguous().view(torch.uint8).numpy().tobytes()
    return f"{t.dtype}{tuple(t.shape)}:" + hashlib.sha256(data).hexdigest()


def _compare(model: nn.Module, ref: dict[str, torch.Tensor], upcast: bool = False) -> dict[str, Any]:
    got = _all_tensors(model)
    wrong = []
    for name, expected in ref.items():
        if upcast and expected.is_floating_point() and got.get(name) is not None and got[name].dtype == torch.float32:
            expected = expected.float()
        if name not in got or got[name].dtype != expected.dtype or not torch.equal(got[name], expected):
            wrong.append(name)
    return {"wrong": wrong, "extra": sorted(set(got) - set(ref)), "n": len(ref)}


def _bytes_held(model: nn.Module) -> tuple[int, int]:
    """(bytes of real tensors, number of meta tensors) over parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta), sum(t.is_meta for t in tensors)


def _meta_left(model: nn.Module) -> list[str]:
    from fsdp_offload_cfg.loading.spec import meta_tensor_names

    return meta_tensor_names(model)


def _load_case(case: str, path: str, ref_dir: str, rank: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration

    from _models import TinyBufferModel
    from fsdp_offload_cfg.loading import is_rank0_source, load_into_sharded

    decoder = {"LlamaDecoderLayer", "Qwen2DecoderLayer", "DeepseekV3DecoderLayer"}
    upcast = offload = False
    if case == "llava":
        model = LlavaForConditionalGeneration.from_pretrained(path)
        layers = {"CLIPEncoderLayer", "LlamaDecoderLayer"}
    elif case == "tiny_buffers":
        model = TinyBufferModel.from_pretrained(path, dtype=torch.bfloat16)  # norm stays fp32
        layers = {"Linear", "LayerNorm", "Embedding"}
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
        layers = decoder
        upcast = case == "llama_bf16"
        offload = case == "llama_offload"
    held, n_meta = _bytes_held(model)
    result: dict[str, Any] = {"bytes_after_from_pretrained": held, "meta_after_from_pretrained": n_meta}
    result["marked"] = is_rank0_source(model)
    model = load_into_sharded(
        model, lambda m: _shard(m, layers, offload=offload, upcast=upcast), cpu_offload=offload, bucket_bytes=BUCKET
    )
    result.update(_compare(model, torch.load(os.path.join(ref_dir, f"{case}.pt")), upcast=upcast))
    result["meta_left"] = _meta_left(model)
    if offload:
        result["param_devices"] = sorted({p.to_local().device.type for p in model.parameters()})
        model(torch.tensor(STEP_INPUT))  # FSDP2 with CPUOffloadPolicy still runs
    if case == "qwen2_tied":
        result.update(_adamw_step(model, torch.load(os.path.join(ref_dir, "qwen2_step.pt"))))
    return result


def _adamw_step(model: nn.Module, reference: torch.Tensor) -> dict[str, Any]:
    """One AdamW step on the sharded model vs the same step in a single process."""
    from torch.distributed.fsdp import FSDPModule

    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    before = emb.weight is head.weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor(STEP_INPUT)
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    model(ids)  # a second forward: the tail unit stays unsharded (reshard_after_forward=False)
    tied_unsharded = emb.weight is head.weight
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return {
        "tied_before_step": before,
        "tied_after_step": tied_unsharded and emb.weight is head.weight,
        "step_max_abs_diff": (emb.weight.full_tensor() - reference).abs().max().item(),
    }


def _lora_case(path: str, ref_dir: str) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fsdp_offload_cfg.loading import load_into_sharded

    base = AutoModelForCausalLM.from_pretrained(path)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"))
    before = {n: _digest(p) for n, p in model.named_parameters() if "lora_" in n and not p.is_meta}
    model = load_into_sharded(model, lambda m: _shard(m, {"LlamaDecoderLayer"}, upcast=True), bucket_bytes=BUCKET)
    full = _all_tensors(model)
    base = {
        n.replace("base_model.model.", "", 1).replace(".base_layer", ""): t for n, t in full.items() if "lora_" not in n
    }
    ref = torch.load(os.path.join(ref_dir, "llama_bf16.pt"))
    wrong = sorted(n for n in set(ref) | set(base) if n not in base or n not in ref or not torch.equal(base[n], ref[n]))
    return {
        "lora_before": before,
        "lora_after": {n: _digest(t) for n, t in full.items() if "lora_" in n},
        "base_wrong": wrong,
        "meta_left": _meta_left(model),
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
    }


def _from_config_case(rank: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from _models import llama_config
    from fsdp_offload_cfg.loading import load_into_sharded

    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_config(llama_config())
    held, n_meta = _bytes_held(model)
    before = {n: _digest(t) for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta}
    model = load_into_sharded(model, lambda m: _shard(m, {"LlamaDecoderLayer"}), bucket_bytes=BUCKET)
    return {
        "bytes": held,
        "meta": n_meta,
        "before": before,
        "after": {n: _digest(t) for n, t in _all_tensors(model).items()},
        "rng_after": _digest(torch.get_rng_state()),
    }


def _accelerate_case(path: str, ref_dir: str) -> dict[str, Any]:
    """accelerate's own fsdp2_prepare_model as the shard_fn (mixed precision bf16: it upcasts the
    bf16 checkpoint's trainable params to fp32 master weights). The FSDP plugin is put on a real
    MULTI_CPU Accelerator by hand, as `patch()` promotes it on the CPU."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from transformers import AutoModelForCausalLM

    from fsdp_offload_cfg.loading import load_into_sharded

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        cpu_ram_efficient_loading=False,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    plugin.set_mixed_precision("bf16")
    accelerator.state.fsdp_plugin = plugin
    model = AutoModelForCausalLM.from_pretrained(path)
    model = load_into_sharded(model, lambda m: fsdp2_prepare_model(accelerator, m))
    result = _compare(model, torch.load(os.path.join(ref_dir, "llama_bf16.pt")), upcast=True)
    result["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    result["meta_left"] = _meta_left(model)
    ids = torch.tensor(STEP_INPUT)
    result["loss"] = model(ids, labels=ids).loss.item()
    return result


def _mismatch_case(path: str, rank: int) -> str:
    from transformers import AutoModelForCausalLM

    from fsdp_offload_cfg.loading import load_into_sharded

    model = AutoModelForCausalLM.from_pretrained(path)
    if rank == 1:
        model.extra_head = nn.Linear(2, 2, bias=False, device="meta")
        del model.model.rotary_emb._buffers["original_inv_freq"]
    try:
        load_into_sharded(model, lambda m: _shard(m, {"LlamaDecoderLayer"}))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _matrix_worker(rank: int, world_size: int, paths: dict[str, str], ref_dir: str) -> dict[str, Any]:
    _install_patches()
    results: dict[str, Any] = {}
    for case in ["llama", "qwen2_tied", "deepseek_v3", "llava", "tiny_buffers", "llama_bf16"]:
        results[case] = _load_case(case, paths[case], ref_dir, rank)
    results["llama_offload"] = _load_case("llama_offload", paths["llama"], ref_dir, rank)
    results["lora"] = _lora_case(paths["llama_bf16"], ref_dir)
    results["from_config"] = _from_config_case(rank)
    results["mismatch"] = _mismatch_case(paths["llama"], rank)
    results["accelerate"] = _accelerate_case(paths["llama_bf16"], ref_dir)
    return results


# --------------------------------------------------------------------------------------------
# fixtures (parent process): tiny checkpoints and plain single-process reference loads
# --------------------------------------------------------------------------------------------


def _reference_step(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor(STEP_INPUT)
    model(ids, labels=ids).loss.backward()
    opt.step()
    return model.get_input_embeddings().weight.detach().clone()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration

    import _models

    root = tmp_path_factory.mktemp("ckpt")
    paths = _models.build_all(str(root))
    ref_dir = root / "ref"
    ref_dir.mkdir()
    loaders = {
        "llava": lambda p: LlavaForConditionalGeneration.from_pretrained(p),
        "tiny_buffers": lambda p: _models.TinyBufferModel.from_pretrained(p, dtype=torch.bfloat16),
    }
    for case, path in paths.items():
        model = loaders.get(case, AutoModelForCausalLM.from_pretrained)(path)
        named = dict(model.named_parameters())
        named.update(model.named_buffers())
        torch.save({n: t.detach().clone() for n, t in named.items()}, ref_dir / f"{case}.pt")
    shutil.copy(ref_dir / "llama.pt", ref_dir / "llama_offload.pt")
    torch.save(_reference_step(paths["qwen2_tied"]), ref_dir / "qwen2_step.pt")
    return {"paths": paths, "ref_dir": str(ref_dir)}


@pytest.fixture(scope="module")
def matrix(checkpoints: dict[str, Any]) -> list[dict[str, Any]]:
    return run_workers(_matrix_worker, 2, checkpoints["paths"], checkpoints["ref_dir"], timeout=300)


# --------------------------------------------------------------------------------------------
# the matrix, case by case
# --------------------------------------------------------------------------------------------

LOAD_CASES = ["llama", "qwen2_tied", "deepseek_v3", "llava", "tiny_buffers", "llama_bf16", "llama_offload"]


@pytest.mark.parametrize("case", LOAD_CASES)
def test_bit_exact_on_every_rank(matrix: list[dict[str, Any]], case: str) -> None:
    for rank, results in enumerate(matrix):
        r = results[case]
        assert r["wrong"] == [], f"rank {rank}: {case} differs from a plain load in {r['wrong']}"
        assert r["extra"] == [], f"rank {rank}: {case} has tensors a plain load lacks: {r['extra']}"
        assert r["meta_left"] == [], f"rank {rank}: {case} left on meta: {r['meta_left']}"


@pytest.mark.parametrize("case", LOAD_CASES)
def test_only_rank0_holds_weights_after_from_pretrained(matrix: list[dict[str, Any]], case: str) -> None:
    rank0, rank1 = matrix[0][case], matrix[1][case]
    assert rank0["bytes_after_from_pretrained"] > 0 and rank0["meta_after_from_pretrained"] == 0
    assert rank1["bytes_after_from_pretrained"] == 0, "rank 1 allocated parameter/buffer bytes"
    assert rank1["meta_after_from_pretrained"] > 0
    assert rank0["marked"] and rank1["marked"]


def test_tied_weights_survive_load_and_adamw_step(matrix: list[dict[str, Any]], checkpoints: dict[str, Any]) -> None:
    for rank, results in enumerate(matrix):
        r = results["qwen2_tied"]
        assert r["tied_before_step"] and r["tied_after_step"], f"rank {rank}: lm_head no longer is embed_tokens"
        assert r["step_max_abs_diff"] < 1e-6, f"rank {rank}: step differs from single-process AdamW"



def test_cpu_offload_keeps_params_on_cpu(matrix: list[dict[str, Any]]) -> None:
    assert all(results["llama_offload"]["param_devices"] == ["cpu"] for results in matrix)


def test_lora_adapters_identical_on_every_rank(matrix: list[dict[str, Any]], checkpoints: dict[str, Any]) -> None:
    rank0, rank1 = matrix[0]["lora"], matrix[1]["lora"]
    assert rank0["lora_before"] and rank1["lora_before"] == {}, "rank 1's adapters should start on meta"
    assert rank0["lora_after"] == rank1["lora_after"]
    assert rank0["lora_after"] == rank0["lora_before"], "adapters changed in transit"
    for rank, r in enumerate((rank0, rank1)):
        assert r["meta_left"] == []
        assert r["base_wrong"] == [], f"rank {rank}: base weights differ from a plain load: {r['base_wrong']}"
        assert r["trainable"] and all("lora_" in n for n in r["trainable"])


def test_from_config_rank0_init_reaches_every_rank(matrix: list[dict[str, Any]]) -> None:
    rank0, rank1 = matrix[0]["from_config"], matrix[1]["from_config"]
    assert rank1["bytes"] == 0 and rank0["meta"] == 0
    assert rank0["after"] == rank1["after"]
    assert all(rank0["after"][n] == d for n, d in rank0["before"].items())
    assert rank0["rng_after"] == rank1["rng_after"], "ranks continue with different CPU RNG states"


def test_key_mismatch_raises_on_every_rank_naming_keys(matrix: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(matrix):
        message = results["mismatch"]
        assert "extra_head.weight" in message and "original_inv_freq" in message, f"rank {rank}: {message}"


def test_with_accelerates_fsdp2_prepare_model(matrix: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(matrix):
        r = results["accelerate"]
        assert r["wrong"] == [] and r["extra"] == [] and r["meta_left"] == [], f"rank {rank}: {r}"
        assert r["dtypes"] == ["torch.float32"]
    assert matrix[0]["accelerate"]["loss"] == matrix[1]["accelerate"]["loss"]


# --------------------------------------------------------------------------------------------
# rank 0 failing to read the checkpoint
# --------------------------------------------------------------------------------------------


def _failure_worker(rank: int, world_size: int, cases: dict[str, str]) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    _install_patches()
    out = {}
    for case, path in cases.items():
        start = time.monotonic()
        try:
            LlamaForCausalLM.from_pretrained(path)
            message = "no error"
        except Exception as exc:  # noqa: BLE001
            message = f"{type(exc).__name__}: {exc}"
        out[case] = (message, time.monotonic() - start)
        dist.barrier()  # the ranks are still in step: the next case starts together
    return out


def test_rank0_failure_raises_on_every_rank(checkpoints: dict[str, Any], tmp_path) -> None:
    good = checkpoints["paths"]["llama"]
    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    weights = truncated / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    no_weights = tmp_path / "no_weights"
    shutil.copytree(good, no_weights)
    os.remove(no_weights / "model.safetensors")
    cases = {"truncated": str(truncated), "missing": str(tmp_path / "does_not_exist"), "no_weights": str(no_weights)}
    causes = {"truncated": "SafetensorError", "missing": "OSError", "no_weights": "no file named model.safetensors"}

    results = run_workers(_failure_worker, 2, cases, timeout=90)
    for rank, out in enumerate(results):
        for case, (message, seconds) in out.items():
            assert causes[case] in message, f"rank {rank}, {case}: cause not named: {message}"
            assert seconds < 20, f"rank {rank}, {case}: took {seconds:.1f}s to fail"
            if rank == 1:
                assert message.startswith("RuntimeError: rank 0 failed to load"), message


# --------------------------------------------------------------------------------------------
# two nodes x two processes: only global rank 0 reads the weights
# --------------------------------------------------------------------------------------------


def _two_nodes_worker(rank: int, world_size: int, path: str, ref_dir: str) -> dict[str, Any]:
    import transformers.modeling_utils as mu
    from transformers import AutoModelForCausalLM

    from fsdp_offload_cfg.loading import load_into_sharded

    opened: list[str] = []
    real_safe_open = mu.safe_open

    def counting_safe_open(filename, *args, **kwargs):
        opened.append(str(filename))
        return real_safe_open(filename, *args, **kwargs)

    mu.safe_open = counting_safe_open
    _install_patches()
    model = AutoModelForCausalLM.from_pretrained(path)
    held, _ = _bytes_held(model)
    model = load_into_sharded(model, lambda m: _shard(m, {"Qwen2DecoderLayer"}), bucket_bytes=BUCKET)
    result = _compare(model, torch.load(os.path.join(ref_dir, "qwen2_tied.pt")))
    return {
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "opened": opened,
        "bytes": held,
        "wrong": result["wrong"],
        "meta_left": _meta_left(model),
    }


def test_two_nodes_only_global_rank0_reads(checkpoints: dict[str, Any]) -> None:
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}
    results = run_workers(
        _two_nodes_worker, 4, checkpoints["paths"]["qwen2_tied"], checkpoints["ref_dir"],
        env=env, local_world_size=2, timeout=180,
    )  # fmt: skip
    assert [r["local_rank"] for r in results] == [0, 1, 0, 1]
    assert results[0]["opened"] and results[0]["bytes"] > 0
    for rank, r in enumerate(results[1:], start=1):
        assert r["opened"] == [], f"rank {rank} (local rank {r['local_rank']}) opened {r['opened']}"
        assert r["bytes"] == 0, f"rank {rank} holds {r['bytes']} bytes after from_pretrained"
    for rank, r in enumerate(results):
        assert r["wrong"] == [] and r["meta_left"] == [], f"rank {rank}: {r}"
