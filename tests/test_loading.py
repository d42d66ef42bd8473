"""Meta loading on real gloo ranks, compared bit for bit with a plain single-process load, under
both load strategies: "broadcast" (rank 0 reads, scatters) and "sharded" (every rank reads its
own slices from the safetensors files).

Spawning a rank costs seconds (importing transformers), so each launch runs many cases, for both
strategies: one 2-rank launch runs the whole model matrix (results are asserted per case below),
one covers failure propagation, one simulates 2 nodes x 2 processes.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_offload_cfg.testing.compare import digest as _digest
from fsdp_offload_cfg.testing.dist import run_workers

pytestmark = pytest.mark.distributed

BUCKET = 4096  # tiny buckets: every model spans many buckets, some tensors exceed one
STRATEGIES = ["broadcast", "sharded"]
# under "sharded" this checkpoint cannot be read slice by slice: a .bin file. deepseek_v3's
# per-expert keys are read per rank too: transformers 5 stacks them into one tensor on load (a
# WeightConverter), which the reader reads expert by expert; 4.x keeps a module per expert.
FALLBACK = {"llama_bin": "not safetensors"}
STEP_INPUT = [[3, 14, 15, 92, 65, 35, 89, 79], [32, 38, 46, 26, 43, 38, 32, 79]]


# --------------------------------------------------------------------------------------------
# helpers that run inside the ranks
# --------------------------------------------------------------------------------------------


_STRATEGY = {"value": "broadcast"}  # what the patched from_pretrained does in this process


def _install_patches(strategy: str = "broadcast") -> None:
    """Route transformers' loaders through ours, the way `patch()` will (so that Auto classes and
    sub-models created in `__init__` take the real code path)."""
    from transformers import PreTrainedModel

    from fsdp_offload_cfg.loading import rank0_from_config, rank0_from_pretrained, sharded_from_pretrained

    _STRATEGY["value"] = strategy
    if getattr(PreTrainedModel, "_test_patched", False):
        return
    orig_pretrained = PreTrainedModel.from_pretrained.__func__
    orig_config = PreTrainedModel._from_config.__func__

    def from_pretrained(cls, *a, **k):
        from fsdp_offload_cfg.loading.local import rank0_loading_wanted

        if not rank0_loading_wanted():  # inside local_loading(), as patch()'s replacement
            return orig_pretrained(cls, *a, **k)
        body = sharded_from_pretrained if _STRATEGY["value"] == "sharded" else rank0_from_pretrained
        return body(orig_pretrained, cls, *a, **k)

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    PreTrainedModel._from_config = classmethod(lambda cls, c, **k: rank0_from_config(orig_config, cls, c, **k))
    PreTrainedModel._test_patched = True
    PreTrainedModel._test_original_from_pretrained = orig_pretrained
    from peft.tuners.tuners_utils import BaseTuner

    from fsdp_offload_cfg.loading.adapters import build_inject_adapter

    BaseTuner.inject_adapter = build_inject_adapter(BaseTuner.inject_adapter, None)  # as patch() does


class _Warnings(logging.Handler):
    """Collects the loader's warnings (the sharded strategy's fallback notice)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("fsdp_offload_cfg.loading").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def take(self) -> list[str]:
        out, self.messages = self.messages, []
        return out


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


def _plain_model(path: str) -> nn.Module:
    """What a plain single-process load gives, in a rank whose loaders are patched."""
    from transformers import LlamaForCausalLM, PreTrainedModel

    return PreTrainedModel._test_original_from_pretrained(LlamaForCausalLM, path)


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


def _held_by_kind(model: nn.Module) -> dict[str, int]:
    """Real bytes held in parameters, persistent and non-persistent buffers."""
    out = {"params": 0, "persistent": 0, "non_persistent": 0}
    for module in model.modules():
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is None or t.is_meta:
                continue
            kind = "params" if name in module._parameters else "persistent"
            kind = "non_persistent" if name in module._non_persistent_buffers_set else kind
            out[kind] += t.numel() * t.element_size()
    return out


def _read_stats(report: Any) -> dict[str, Any] | None:
    """What this rank's reader did in a `load_into_sharded` (None if it read nothing)."""
    stats = report.read
    if stats is None:
        return None
    return {"bytes_read": stats.bytes_read, "largest_read": stats.largest_read, "files": stats.files}


def _sent_tensors(report: Any) -> int | None:
    """Tensors rank 0's scatter sent in a `load_into_sharded` (None if it never ran)."""
    return None if report.sent is None else report.sent.tensors


def _checkpoint_bytes(path: str) -> tuple[int, int]:
    """(bytes of all tensors, bytes of the largest tensor) in a safetensors checkpoint dir."""
    from fsdp_offload_cfg.loading.checkpoint import read_header

    sizes = []
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            for t in read_header(os.path.join(path, name)).values():
                numel = 1
                for n in t.shape:
                    numel *= n
                sizes.append(numel * t.dtype.itemsize)
    return sum(sizes), max(sizes, default=0)


def _meta_left(model: nn.Module) -> list[str]:
    from fsdp_offload_cfg.loading.spec import meta_tensor_names

    return meta_tensor_names(model)


def _load_case(case: str, path: str, ref_dir: str, rank: int, strategy: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration

    from fsdp_offload_cfg.loading import is_rank0_source, load_into_sharded
    from fsdp_offload_cfg.testing.models import TinyBufferModel

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
    result["held_after_from_pretrained"] = _held_by_kind(model)
    result["marked"] = is_rank0_source(model)
    report = load_into_sharded(
        model, lambda m: _shard(m, layers, offload=offload, upcast=upcast), strategy=strategy,
        cpu_offload=offload, bucket_bytes=BUCKET,
    )  # fmt: skip
    model = report.model
    result["read"] = _read_stats(report)
    result["sent"] = _sent_tensors(report)
    result["checkpoint_bytes"] = _checkpoint_bytes(path)
    result.update(_compare(model, torch.load(os.path.join(ref_dir, f"{case}.pt")), upcast=upcast))
    result["meta_left"] = _meta_left(model)
    result["offload_to_cpu"] = _offload_to_cpu(model)
    if offload:
        result["param_devices"] = sorted({p.to_local().device.type for p in model.parameters()})
        model(torch.tensor(STEP_INPUT))  # FSDP2 with CPUOffloadPolicy still runs
    if case == "qwen2_tied":
        result.update(_adamw_step(model, torch.load(os.path.join(ref_dir, "qwen2_step.pt"))))
    return result


def _offload_to_cpu(model: nn.Module) -> list[bool]:
    """Whether FSDP2 keeps each managed parameter on the host (its CPUOffloadPolicy in force), as
    the loader leaves the groups it was handed."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    groups = {id(g): g for m in model.modules() if isinstance(m, FSDPModule)
              for g in [fully_shard.state(m)._fsdp_param_group] if g is not None}
    return sorted({p.offload_to_cpu for g in groups.values() for p in g.fsdp_params})


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


def _lora_case(path: str, ref_dir: str, strategy: str) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fsdp_offload_cfg.loading import load_into_sharded

    base = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(11)  # every rank draws the adapters, as a plain run with one seed does
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"))
    before = {n: _digest(p) for n, p in model.named_parameters() if "lora_" in n and not p.is_meta}
    plain_base = _plain_model(path)
    torch.manual_seed(11)
    plain = get_peft_model(plain_base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights="gaussian"))
    plain_adapters = {n: _digest(p) for n, p in plain.named_parameters() if "lora_" in n}
    model = load_into_sharded(
        model, lambda m: _shard(m, {"LlamaDecoderLayer"}, upcast=True), strategy=strategy, bucket_bytes=BUCKET
    ).model
    full = _all_tensors(model)
    base = {
        n.replace("base_model.model.", "", 1).replace(".base_layer", ""): t for n, t in full.items() if "lora_" not in n
    }
    ref = torch.load(os.path.join(ref_dir, "llama_bf16.pt"))
    wrong = sorted(n for n in set(ref) | set(base) if n not in base or n not in ref or not torch.equal(base[n], ref[n]))
    return {
        "lora_before": before,
        "lora_plain": plain_adapters,
        "lora_after": {n: _digest(t) for n, t in full.items() if "lora_" in n},
        "lora_B_zero": all(not t.any() for n, t in full.items() if "lora_B" in n),
        "lora_A_std": [t.float().std().item() for n, t in full.items() if "lora_A" in n],
        "base_wrong": wrong,
        "meta_left": _meta_left(model),
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
    }


def _from_config_case(rank: int, strategy: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from fsdp_offload_cfg.loading import load_into_sharded
    from fsdp_offload_cfg.testing.models import llama_config

    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_config(llama_config())
    held, n_meta = _bytes_held(model)
    before = {n: _digest(t) for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta}
    model = load_into_sharded(model, lambda m: _shard(m, {"LlamaDecoderLayer"}), strategy=strategy, bucket_bytes=BUCKET).model
    return {
        "bytes": held,
        "meta": n_meta,
        "before": before,
        "after": {n: _digest(t) for n, t in _all_tensors(model).items()},
        "rng_after": _digest(torch.get_rng_state()),
    }


def _accelerate_case(path: str, ref_dir: str, strategy: str) -> dict[str, Any]:
    """accelerate's own fsdp2_prepare_model as the shard_fn (mixed precision bf16: it upcasts the
    bf16 checkpoint's trainable params to fp32 master weights). The FSDP plugin is put on a real
    MULTI_CPU Accelerator by hand, as `patch()` promotes it on the CPU."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from transformers import AutoModelForCausalLM

    from fsdp_offload_cfg import local_loading
    from fsdp_offload_cfg.loading import load_into_sharded

    switch = os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING")
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        cpu_ram_efficient_loading=False,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )  # exports FSDP_CPU_RAM_EFFICIENT_LOADING=False, accelerate's switch the loader honours: put it back
    if switch is None:
        os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)
    else:
        os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = switch
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    plugin.set_mixed_precision("bf16")
    accelerator.state.fsdp_plugin = plugin
    model = AutoModelForCausalLM.from_pretrained(path)
    model = load_into_sharded(model, lambda m: fsdp2_prepare_model(accelerator, m), strategy=strategy).model
    result = _compare(model, torch.load(os.path.join(ref_dir, "llama_bf16.pt")), upcast=True)
    result["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    result["meta_left"] = _meta_left(model)
    ids = torch.tensor(STEP_INPUT)
    result["loss"] = model(ids, labels=ids).loss.item()
    # What stock accelerate gives without the loader: its fp32 upcast of trainable bf16 params
    # differs by version (1.13 rebinds a loop variable and keeps bf16).
    with local_loading():
        stock = fsdp2_prepare_model(accelerator, AutoModelForCausalLM.from_pretrained(path))
    result["stock_dtypes"] = sorted({str(p.dtype) for p in stock.parameters()})
    return result


def _mismatch_case(path: str, rank: int, strategy: str) -> str:
    from transformers import AutoModelForCausalLM

    from fsdp_offload_cfg.loading import load_into_sharded

    model = AutoModelForCausalLM.from_pretrained(path)
    if rank == 1:
        model.extra_head = nn.Linear(2, 2, bias=False, device="meta")
        del model.model.rotary_emb._buffers["inv_freq"]
    try:
        load_into_sharded(model, lambda m: _shard(m, {"LlamaDecoderLayer"}), strategy=strategy)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _matrix_worker(rank: int, world_size: int, paths: dict[str, str], ref_dir: str) -> dict[str, Any]:
    """The whole matrix once per strategy, in one launch: {strategy: {case: result}}. Every rank
    starts from one seed, as a training script sets it: from different states, a load that draws
    (llava's missing weights on transformers 4.57) is warned about on rank 1, rightly."""
    torch.manual_seed(0)
    warnings = _Warnings()
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        _install_patches(strategy)
        results: dict[str, Any] = {}
        for case in [c for c in LOAD_CASES if c != "llama_offload"]:
            results[case] = _load_case(case, paths[case], ref_dir, rank, strategy)
            results[case]["warnings"] = warnings.take()
        results["llama_offload"] = _load_case("llama_offload", paths["llama"], ref_dir, rank, strategy)
        results["llama_offload"]["warnings"] = warnings.take()
        results["lora"] = _lora_case(paths["llama_bf16"], ref_dir, strategy)
        results["from_config"] = _from_config_case(rank, strategy)
        results["mismatch"] = _mismatch_case(paths["llama"], rank, strategy)
        results["accelerate"] = _accelerate_case(paths["llama_bf16"], ref_dir, strategy)
        results["warnings_elsewhere"] = warnings.take()
        out[strategy] = results
    return out


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

    from fsdp_offload_cfg.testing import models as _models

    root = tmp_path_factory.mktemp("ckpt")
    paths = _models.build_all(str(root))
    paths.update({name: build(str(root / name)) for name, build in _models.SHARDED_BUILDERS.items()})
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
    return run_workers(_matrix_worker, 2, checkpoints["paths"], checkpoints["ref_dir"], timeout=400)


# --------------------------------------------------------------------------------------------
# the matrix, case by case, for each strategy
# --------------------------------------------------------------------------------------------

LOAD_CASES = [
    "llama", "qwen2_tied", "deepseek_v3", "llava", "tiny_buffers", "llama_bf16", "llama_offload",
    "deepseek_v3_fused", "llama_multi_file", "llama_bin",
]  # fmt: skip
SHARDED_READS = [c for c in LOAD_CASES if c not in FALLBACK]


def _by_rank(matrix: list[dict[str, Any]], strategy: str, case: str) -> list[dict[str, Any]]:
    return [results[strategy][case] for results in matrix]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", LOAD_CASES)
def test_bit_exact_on_every_rank(matrix: list[dict[str, Any]], strategy: str, case: str) -> None:
    for rank, r in enumerate(_by_rank(matrix, strategy, case)):
        assert r["wrong"] == [], f"rank {rank}: {case} differs from a plain load in {r['wrong']}"
        assert r["extra"] == [], f"rank {rank}: {case} has tensors a plain load lacks: {r['extra']}"
        assert r["meta_left"] == [], f"rank {rank}: {case} left on meta: {r['meta_left']}"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", LOAD_CASES)
def test_who_holds_weights_after_from_pretrained(matrix: list[dict[str, Any]], strategy: str, case: str) -> None:
    """Where the checkpoint can be read slice by slice, no rank holds a parameter or persistent-
    buffer byte after `from_pretrained`, rank 0 included (under broadcast rank 0 used to
    load the whole model; now it streams the weights from the files at prepare); only the
    non-persistent buffers a rank computes. Where it cannot (a `.bin`, keys converted on load),
    rank 0 loads it whole and the other ranks hold nothing."""
    rank0, rank1 = _by_rank(matrix, strategy, case)
    assert rank0["marked"] and rank1["marked"]
    if case in FALLBACK:
        assert rank0["bytes_after_from_pretrained"] > 0 and rank0["meta_after_from_pretrained"] == 0
        assert rank1["bytes_after_from_pretrained"] == 0, "rank 1 allocated parameter/buffer bytes"
        assert rank1["meta_after_from_pretrained"] > 0
        return
    for rank, r in enumerate((rank0, rank1)):
        held = r["held_after_from_pretrained"]
        if strategy == "broadcast" and rank == 1:  # built from rank 0's description: nothing at all
            assert r["bytes_after_from_pretrained"] == 0, "rank 1 allocated parameter/buffer bytes"
        assert held["params"] == 0 and held["persistent"] == 0, f"rank {rank} holds weights: {held}"
        assert r["meta_after_from_pretrained"] > 0


@pytest.mark.parametrize("case", SHARDED_READS)
def test_sharded_each_rank_reads_only_its_slices(matrix: list[dict[str, Any]], case: str) -> None:
    """The reader never holds a full copy: each rank reads about half of the checkpoint (its rows
    plus the small replicated buffers), in reads of at most about one bucket, each smaller than
    the largest tensor; nothing is scattered for tensors in the checkpoint."""
    for rank, r in enumerate(_by_rank(matrix, "sharded", case)):
        total, largest = r["checkpoint_bytes"]
        read = r["read"]
        assert read is not None and read["files"], f"rank {rank}: read nothing"
        assert 0.3 * total < read["bytes_read"] < 0.65 * total, f"rank {rank}: read {read['bytes_read']} of {total}"
        assert read["largest_read"] <= 2 * BUCKET and read["largest_read"] < largest, f"rank {rank}: {read}"
        assert r["sent"] == 0, f"rank {rank}: rank 0 scattered {r['sent']} tensors"
    assert len(_by_rank(matrix, "sharded", "llama_multi_file")[0]["read"]["files"]) > 1


@pytest.mark.parametrize("case", sorted(FALLBACK))
def test_sharded_falls_back_to_broadcast_with_one_warning(matrix: list[dict[str, Any]], case: str) -> None:
    rank0, rank1 = _by_rank(matrix, "sharded", case)
    assert len(rank0["warnings"]) == 1 and rank1["warnings"] == [], (rank0["warnings"], rank1["warnings"])
    assert "falling back to broadcast" in rank0["warnings"][0] and FALLBACK[case] in rank0["warnings"][0]
    assert rank0["read"] is None and rank1["read"] is None
    assert rank0["sent"] and rank0["sent"] == rank1["sent"], "the fallback should scatter every tensor from rank 0"
    for strategy in STRATEGIES:
        assert all(not results[strategy]["warnings_elsewhere"] for results in matrix), [
            r[strategy]["warnings_elsewhere"] for r in matrix]
        assert all(not results[strategy][c]["warnings"] for results in matrix for c in SHARDED_READS), [
            (strategy, c, results[strategy][c]["warnings"]) for results in matrix for c in SHARDED_READS
            if results[strategy][c]["warnings"]]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tied_weights_survive_load_and_adamw_step(matrix: list[dict[str, Any]], strategy: str) -> None:
    for rank, r in enumerate(_by_rank(matrix, strategy, "qwen2_tied")):
        assert r["tied_before_step"] and r["tied_after_step"], f"rank {rank}: lm_head no longer is embed_tokens"
        assert r["step_max_abs_diff"] < 1e-6, f"rank {rank}: step differs from single-process AdamW"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cpu_offload_keeps_params_on_cpu(matrix: list[dict[str, Any]], strategy: str) -> None:
    """The harness hides every GPU, so "on the CPU" alone holds whatever the loader does: the
    offload policy itself must be in force on every group after the load, and only there."""
    for r in _by_rank(matrix, strategy, "llama_offload"):
        assert r["offload_to_cpu"] == [True] and r["param_devices"] == ["cpu"], r["offload_to_cpu"]
    assert all(r["offload_to_cpu"] == [False] for r in _by_rank(matrix, strategy, "llama"))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lora_adapters_identical_on_every_rank(matrix: list[dict[str, Any]], strategy: str) -> None:
    rank0, rank1 = _by_rank(matrix, strategy, "lora")
    assert rank0["lora_after"] and rank0["lora_after"] == rank1["lora_after"]
    # every rank keeps the adapters PEFT drew (a meta base used to take them to meta, and under
    # "sharded" rank 0 drew them again at prepare: not what the same seed gives), and they arrive
    # unchanged: what a plain load + get_peft_model with the same seed holds
    for r in (rank0, rank1):
        assert r["lora_before"] == r["lora_plain"], "adapters differ from a plain run's"
        assert r["lora_after"] == r["lora_before"], "adapters changed in transit"
    assert rank0["lora_B_zero"] and all(0.15 < std < 0.35 for std in rank0["lora_A_std"]), rank0["lora_A_std"]
    for rank, r in enumerate((rank0, rank1)):
        assert r["meta_left"] == []
        assert r["base_wrong"] == [], f"rank {rank}: base weights differ from a plain load: {r['base_wrong']}"
        assert r["trainable"] and all("lora_" in n for n in r["trainable"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_from_config_rank0_init_reaches_every_rank(matrix: list[dict[str, Any]], strategy: str) -> None:
    rank0, rank1 = _by_rank(matrix, strategy, "from_config")
    assert rank1["bytes"] == 0 and rank0["meta"] == 0
    assert rank0["after"] == rank1["after"]
    assert all(rank0["after"][n] == d for n, d in rank0["before"].items())
    assert rank0["rng_after"] == rank1["rng_after"], "ranks continue with different CPU RNG states"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_key_mismatch_raises_on_every_rank_naming_keys(matrix: list[dict[str, Any]], strategy: str) -> None:
    for rank, message in enumerate(_by_rank(matrix, strategy, "mismatch")):
        assert "extra_head.weight" in message and "rotary_emb.inv_freq" in message, f"rank {rank}: {message}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_with_accelerates_fsdp2_prepare_model(matrix: list[dict[str, Any]], strategy: str) -> None:
    by_rank = _by_rank(matrix, strategy, "accelerate")
    for rank, r in enumerate(by_rank):
        assert r["wrong"] == [] and r["extra"] == [] and r["meta_left"] == [], f"rank {rank}: {r}"
        assert r["dtypes"] == r["stock_dtypes"]
    assert by_rank[0]["loss"] == by_rank[1]["loss"]


# --------------------------------------------------------------------------------------------
# rank 0 failing to read the checkpoint
# --------------------------------------------------------------------------------------------


def _failure_worker(rank: int, world_size: int, cases: dict[str, str], late: str) -> dict[str, Any]:
    """Every case under both strategies, then (sharded only) a file truncated between
    `from_pretrained` and `load_into_sharded`: the reader's error must reach every rank."""
    import importlib

    from transformers import LlamaForCausalLM

    from fsdp_offload_cfg.compat.checkpoint_reading import swap_targets
    from fsdp_offload_cfg.loading import load_into_sharded

    def swappable() -> dict[tuple[str, str], Any]:  # what the sharded meta load swaps for its call
        return {(m, a): getattr(importlib.import_module(m), a) for m, a in swap_targets()}

    originals = swappable()
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        _install_patches(strategy)
        for case, path in cases.items():
            start = time.monotonic()
            try:
                LlamaForCausalLM.from_pretrained(path)
                message = "no error"
            except Exception as exc:  # noqa: BLE001
                message = f"{type(exc).__name__}: {exc}"
            out[f"{strategy}/{case}"] = (message, time.monotonic() - start)
            assert swappable() == originals, f"{strategy}/{case} left transformers' loaders swapped"
            dist.barrier()  # the ranks are still in step: the next case starts together
    model = LlamaForCausalLM.from_pretrained(late)  # still "sharded"
    dist.barrier()
    if rank == 0:
        weights = os.path.join(late, "model.safetensors")
        os.truncate(weights, os.path.getsize(weights) // 2)
    dist.barrier()
    start = time.monotonic()
    try:
        load_into_sharded(model, lambda m: _shard(m, {"LlamaDecoderLayer"}), strategy="sharded", bucket_bytes=BUCKET)
        message = "no error"
    except Exception as exc:  # noqa: BLE001
        message = f"{type(exc).__name__}: {exc}"
    out["sharded/truncated_after_from_pretrained"] = (message, time.monotonic() - start)
    return out


def test_load_failure_raises_on_every_rank(checkpoints: dict[str, Any], tmp_path) -> None:
    good = checkpoints["paths"]["llama"]
    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    weights = truncated / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    no_weights = tmp_path / "no_weights"
    shutil.copytree(good, no_weights)
    os.remove(no_weights / "model.safetensors")
    missing_shard = tmp_path / "missing_shard"
    shutil.copytree(checkpoints["paths"]["llama_multi_file"], missing_shard)
    os.remove(missing_shard / "model-00002-of-00003.safetensors")
    late = tmp_path / "late"
    shutil.copytree(good, late)
    cases = {
        "truncated": str(truncated), "missing": str(tmp_path / "does_not_exist"), "no_weights": str(no_weights),
        "missing_shard": str(missing_shard),
    }  # fmt: skip
    causes = {
        "truncated": "SafetensorError", "missing": _plain_load_error(cases["missing"]), "no_weights": "model.safetensors",
        "missing_shard": "model-00002-of-00003.safetensors",
        "truncated_after_from_pretrained": "late/model.safetensors",  # the reader names the file
    }  # fmt: skip

    results = run_workers(_failure_worker, 2, cases, str(late), timeout=120)
    for rank, out in enumerate(results):
        assert len(out) == 2 * len(cases) + 1
        for key, (message, seconds) in out.items():
            case = key.split("/")[1]
            assert causes[case] in message, f"rank {rank}, {key}: cause not named: {message}"
            assert seconds < 20, f"rank {rank}, {key}: took {seconds:.1f}s to fail"
            # broadcast: rank 1 hears rank 0's error; sharded: every rank opens the files and fails itself
            if rank == 1 and key.startswith("broadcast/"):
                assert message.startswith("RuntimeError: rank 0 failed to load"), message


def _scatter_failure_worker(rank: int, world_size: int, path: str) -> dict[str, tuple[str, float]]:
    """Failures injected on rank 0 alone just before the scatter: a source tensor that no longer
    matches its description, and the staging allocation."""
    from transformers import LlamaForCausalLM

    from fsdp_offload_cfg.loading import broadcast, load_into_sharded, prepare

    _install_patches("broadcast")
    real_source, real_allocate = prepare._rank0_source, broadcast._allocate_staging

    def changed_source(*args: Any, **kwargs: Any) -> Any:
        source = real_source(*args, **kwargs)
        if source is not None:  # (a FileSlice under a streamed broadcast: replaced by a tensor of another dtype)
            source["model.norm.weight"] = torch.zeros(source["model.norm.weight"].shape, dtype=torch.float64)
        return source

    def no_memory(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("injected: cannot allocate the staging buffers")

    out = {}
    for case, attr, fault in [("changed", "_rank0_source", changed_source), ("no_memory", None, no_memory)]:
        if rank == 0:
            if attr:
                prepare._rank0_source = fault
            else:
                broadcast._allocate_staging = fault
        model = LlamaForCausalLM.from_pretrained(path)
        start = time.monotonic()
        try:
            load_into_sharded(model, lambda m: _shard(m, {"LlamaDecoderLayer"}), bucket_bytes=BUCKET)
            message = "no error"
        except Exception as exc:  # noqa: BLE001
            message = f"{type(exc).__name__}: {exc}"
        out[case] = (message, time.monotonic() - start)
        prepare._rank0_source, broadcast._allocate_staging = real_source, real_allocate
    return out


def test_a_rank0_failure_before_the_scatter_raises_on_every_rank(checkpoints: dict[str, Any]) -> None:
    """Every check and allocation that can fail on one rank is agreed before the first scatter,
    so no rank waits in `dist.scatter` for a rank 0 that has already raised."""
    pg_timeout = 30.0
    results = run_workers(
        _scatter_failure_worker, 2, checkpoints["paths"]["llama"], pg_timeout=pg_timeout, timeout=150
    )
    causes = {"changed": "model.norm.weight: changed since it was described", "no_memory": "injected: cannot allocate"}
    for rank, out in enumerate(results):
        for case, (message, seconds) in out.items():
            assert "getting ready to receive from rank 0" in message and causes[case] in message, (rank, message)
            assert "rank 0:" in message, message
            assert seconds < pg_timeout / 2, f"rank {rank}, {case}: took {seconds:.1f}s"


# (module, function, which call fails, words of the step in the message, strategies), injected on one rank
STEP_FAULTS = [
    ("prepare", "describe", 1, "matching this rank's model with rank 0's", STRATEGIES),
    ("prepare", "rebuild_on_meta", 1, "sharding the model on meta (rebuild, shard_fn)", STRATEGIES),
    ("prepare", "_materialize", 1, "allocating the sharded model", STRATEGIES),
    ("prepare", "plan", 1, "allocating the sharded model", STRATEGIES),
    ("sharded", "_own_sources", 1, "finding each tensor in the checkpoint record", ["sharded"]),
    ("sharded", "fill_own", 1, "reading this rank's shards from the checkpoint", ["sharded"]),
    ("broadcast", "_pack", 2, "receiving the weights from rank 0 (bucket by bucket)", ["broadcast"]),
    ("broadcast", "_unpack", 2, "receiving the weights from rank 0 (bucket by bucket)", ["broadcast"]),
    ("prepare", "meta_tensor_names", 1, "checking the loaded model", STRATEGIES),
]


def _step_fault_worker(rank: int, world_size: int, path: str, bin_path: str) -> dict[str, tuple[str, float]]:
    """For each step of `load_into_sharded`, under each strategy, one rank's call of the step's
    function raises (the n-th call: the transfer fails in its second bucket); the other ranks run
    normally. What every rank raised, and when. `_unpack` runs on the `.bin` checkpoint, which
    rank 0 loads whole and so unpacks its own part too (from safetensors it reads its own slices)."""
    import importlib

    from transformers import LlamaForCausalLM

    from fsdp_offload_cfg.loading import load_into_sharded

    out: dict[str, tuple[str, float]] = {}
    for module_name, function, nth, _, strategies in STEP_FAULTS:
        module = importlib.import_module(f"fsdp_offload_cfg.loading.{module_name}")
        real = getattr(module, function)
        for strategy in strategies:
            _install_patches(strategy)
            for failing in (0, 1):
                if function == "_pack" and failing == 1:
                    continue  # only rank 0 packs
                calls = {"n": 0}

                def fault(*args: Any, _real: Any = real, _nth: int = nth, _calls: dict = calls, _name: str = function,
                          **kwargs: Any) -> Any:
                    _calls["n"] += 1
                    if _calls["n"] == _nth:
                        raise RuntimeError(f"injected fault in {_name}")
                    return _real(*args, **kwargs)

                model = LlamaForCausalLM.from_pretrained(bin_path if function == "_unpack" else path)
                dist.barrier()
                if rank == failing:
                    setattr(module, function, fault)
                start = time.monotonic()
                try:
                    load_into_sharded(model, lambda m: _shard(m, {"LlamaDecoderLayer"}), strategy=strategy,
                                      bucket_bytes=BUCKET)
                    message = "no error"
                except Exception as exc:  # noqa: BLE001
                    message = f"{type(exc).__name__}: {exc}"
                out[f"{strategy}/{function}/rank{failing}"] = (message, time.monotonic() - start)
                setattr(module, function, real)
                dist.barrier()  # still in step: the next case starts together
    return out


def test_a_failure_at_any_step_raises_on_every_rank_naming_the_rank_and_step(checkpoints: dict[str, Any]) -> None:
    """steps outside an agreement (rebuild, the scatter loop, the final check) used to
    leave the other ranks waiting in a collective until the process-group timeout."""
    pg_timeout = 30.0
    results = run_workers(_step_fault_worker, 2, checkpoints["paths"]["llama"], checkpoints["paths"]["llama_bin"],
                          pg_timeout=pg_timeout, timeout=400)
    steps = {function: words for _, function, _, words, _ in STEP_FAULTS}
    for rank, out in enumerate(results):
        assert len(out) == sum(len(s) * (1 if f == "_pack" else 2) for _, f, _, _, s in STEP_FAULTS)
        for case, (message, seconds) in out.items():
            _, function, failing = case.split("/")
            assert f"injected fault in {function}" in message, (rank, case, message)
            if case.endswith("describe/rank0"):  # rank 0 describes its model for everyone first
                assert "rank 0 cannot describe its model" in message, (rank, case, message)
            else:
                assert f"{steps[function]} failed on {failing.replace('rank', 'rank ')}:" in message, (rank, case, message)
            if function in ("_pack", "_unpack"):
                assert "bucket 2/" in message, (rank, case, message)
            assert seconds < pg_timeout / 2, f"rank {rank}, {case}: took {seconds:.1f}s"


def _plain_load_error(path: str) -> str:
    """The exception type a plain load raises (OSError; HFValidationError on transformers 4.57)."""
    from transformers import LlamaForCausalLM

    try:
        LlamaForCausalLM.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__
    raise AssertionError(f"{path} loads")


def _slow_rank0_worker(rank: int, world_size: int, path: str, delay: float) -> dict[str, Any]:
    """Rank 0's `from_pretrained` (and `_from_config`) outlast the process-group timeout."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

    from fsdp_offload_cfg.loading import rank0_from_config, rank0_from_pretrained

    def slow(original: Any) -> Any:
        def call(cls: type, *args: Any, **kwargs: Any) -> Any:
            if rank == 0:  # the other ranks run `_from_config` too, on meta: that stays fast
                time.sleep(delay)
            return original(cls, *args, **kwargs)

        return call

    start = time.monotonic()
    model = rank0_from_pretrained(slow(PreTrainedModel.from_pretrained.__func__), LlamaForCausalLM, path)
    loaded = time.monotonic() - start
    config = LlamaConfig.from_pretrained(path)
    built = rank0_from_config(slow(PreTrainedModel._from_config.__func__), LlamaForCausalLM, config)
    dist.barrier()  # rank 0 hosts the store: it must not exit before rank 1 has read its post
    return {
        "seconds": loaded,
        "meta": sum(p.is_meta for p in model.parameters()),
        "params": len(list(model.parameters())),
        "built_meta": sum(p.is_meta for p in built.parameters()),
    }


def test_ranks_wait_out_a_rank0_load_longer_than_the_collective_timeout(checkpoints: dict[str, Any]) -> None:
    """Big checkpoints take rank 0 longer to load than the process-group timeout (10-30 min by
    default); the other ranks wait through the store, not in a collective that would time out."""
    pg_timeout, delay = 2.0, 5.0
    results = run_workers(
        _slow_rank0_worker, 2, checkpoints["paths"]["llama"], delay, pg_timeout=pg_timeout, timeout=120
    )
    rank0, rank1 = results
    assert rank1["seconds"] >= delay, "rank 1 did not wait for rank 0"
    assert rank0["meta"] == rank1["meta"] == rank1["params"] > 0  # rank 0 streams at prepare: both on meta
    assert rank0["built_meta"] == 0 and rank1["built_meta"] > 0


def _rank0_dies_worker(rank: int, world_size: int, path: str) -> None:
    from transformers import LlamaForCausalLM

    from fsdp_offload_cfg.loading import rank0_from_pretrained

    def killed(cls: type, *args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)  # rank 1 is waiting by now
        os._exit(9)  # as if the OOM killer took rank 0 (which hosts the store here)

    rank0_from_pretrained(killed, LlamaForCausalLM, path)


def test_rank0_dying_while_it_loads_raises_on_the_waiting_ranks(checkpoints: dict[str, Any]) -> None:
    with pytest.raises(AssertionError) as failure:
        run_workers(_rank0_dies_worker, 2, checkpoints["paths"]["llama"], expect_errors=True, timeout=60)
    report = str(failure.value)
    assert "ranks [0] did not report" in report, report
    assert "rank 1 lost contact with rank 0 while waiting for it to load" in report, report


# --------------------------------------------------------------------------------------------
# two nodes x two processes: broadcast: only global rank 0 reads (at prepare); sharded: every rank reads its part
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
    out = {}
    for strategy in STRATEGIES:
        _install_patches(strategy)
        model = AutoModelForCausalLM.from_pretrained(path)
        held = _held_by_kind(model)
        shard = lambda m: _shard(m, {"Qwen2DecoderLayer"})  # noqa: E731
        report = load_into_sharded(model, shard, strategy=strategy, bucket_bytes=BUCKET)
        model = report.model
        result = _compare(model, torch.load(os.path.join(ref_dir, "qwen2_tied.pt")))
        out[strategy] = {
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "opened": list(opened),
            "held": held,
            "read": _read_stats(report),
            "wrong": result["wrong"],
            "meta_left": _meta_left(model),
        }
        opened.clear()
    return out


def test_two_nodes(checkpoints: dict[str, Any]) -> None:
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}
    results = run_workers(
        _two_nodes_worker, 4, checkpoints["paths"]["qwen2_tied"], checkpoints["ref_dir"],
        env=env, local_world_size=2, timeout=180,
    )  # fmt: skip
    broadcast = [r["broadcast"] for r in results]
    assert [r["local_rank"] for r in broadcast] == [0, 1, 0, 1]
    assert broadcast[0]["held"]["params"] == 0  # rank 0 streams the weights from the files at prepare
    for rank, r in enumerate(broadcast[1:], start=1):
        assert r["opened"] == [], f"rank {rank} (local rank {r['local_rank']}) opened {r['opened']}"
        assert sum(r["held"].values()) == 0, f"rank {rank} holds {r['held']} bytes after from_pretrained"
    for rank, r in enumerate(r["sharded"] for r in results):
        assert r["held"]["params"] == 0 and r["held"]["persistent"] == 0, f"rank {rank} holds {r['held']}"
        assert r["read"] and r["read"]["files"], f"rank {rank} read nothing"
    for strategy in STRATEGIES:
        for rank, r in enumerate(r[strategy] for r in results):
            assert r["wrong"] == [] and r["meta_left"] == [], f"{strategy}, rank {rank}: {r}"


# --------------------------------------------------------------------------------------------
# transformers 5.25's fusion_config: module classes swapped during __init__
# --------------------------------------------------------------------------------------------

FUSION = {"patch_embeddings": True}  # Qwen2-VL's Conv3d patch embedding as one Linear


def _fusion_worker(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from transformers import PreTrainedModel, Qwen2VLForConditionalGeneration

    from fsdp_offload_cfg.loading import auto_from_pretrained, load_into_sharded, rank0_from_pretrained

    def digests(model: nn.Module) -> dict[str, str]:
        return {name: _digest(t) for name, t in _all_tensors(model).items()}

    out = {"plain": digests(Qwen2VLForConditionalGeneration.from_pretrained(path, fusion_config=FUSION))}
    for strategy, load in {"broadcast": rank0_from_pretrained, "auto": auto_from_pretrained}.items():
        model = load(PreTrainedModel.from_pretrained, Qwen2VLForConditionalGeneration, path, fusion_config=FUSION)
        out[strategy] = digests(load_into_sharded(model, fully_shard, strategy=strategy).model)
    return out


def test_a_fusion_config_loads_what_a_plain_load_with_it_gives(tmp_path) -> None:
    """`from_pretrained(fusion_config=...)` (transformers 5.25) swaps module classes while the model
    is constructed, from the config: a rank that builds from rank 0's description built the
    unfused classes (`proj`, a Conv3d, where rank 0 had `linear_proj`) and stopped on the names,
    while rank 0 went on to prepare. Now that build is given the config, as `from_pretrained`
    gives it. transformers 5.16-5.24 register fusions for the whole process instead (every later
    load then walks every transformers module, and stops on an image processor that needs
    torchvision): not supported there, and the plain loads run in the ranks, not in pytest's
    process."""
    from transformers import PreTrainedModel

    if "config" not in inspect.signature(PreTrainedModel.get_init_context).parameters:
        pytest.skip("this transformers builds fusions from process-wide patches, not from the config")
    from fsdp_offload_cfg.testing.models import save_qwen2_vl

    path = save_qwen2_vl(str(tmp_path / "qwen2_vl"))
    for rank, result in enumerate(run_workers(_fusion_worker, 2, path, timeout=120)):
        plain = result.pop("plain")
        assert any(name.endswith("patch_embed.linear_proj.weight") for name in plain)  # the fusion took effect
        for strategy, got in result.items():
            assert got == plain, (rank, strategy, sorted(set(got) ^ set(plain)))
