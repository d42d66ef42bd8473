"""What frameworks do to a model between `from_pretrained` and `prepare`, on a loader-built model,
against the same run with the loader off (docs/loading.md, "Between from_pretrained and prepare").

On 2 real gloo ranks through `patch()` and `accelerator.prepare`, one seed: every tensor after
prepare, the RNG stream after it and the losses of two steps are bit-equal under "broadcast" and
"sharded", or, where the op needs values no rank holds, every rank stops at prepare naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_offload_cfg.testing.compare import digest as _digest
from fsdp_offload_cfg.testing.configs import loader_config as _config
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.training import train_steps

pytestmark = pytest.mark.distributed

MODES = ["loader_off", "broadcast", "sharded"]


def _causal(path: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def _classifier(path: str) -> nn.Module:
    """A score head the checkpoint does not have: transformers draws it (rank 0's is sent)."""
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(path, num_labels=3, pad_token_id=0)


def _bf16(path: str) -> nn.Module:
    return _causal(path).to(torch.bfloat16)


def _bf16_norms_fp32(path: str) -> nn.Module:
    """LlamaFactory's `upcast_layernorm`: a bf16 model whose norms are kept in float32, their
    outputs cast back to bf16 by a forward hook."""
    model = _bf16(path)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.to(torch.float32)
            module.register_forward_hook(lambda _m, _args, out: out.to(torch.bfloat16))
    return model


def _compiled(path: str) -> nn.Module:
    """`torch.compile(model)` before prepare, as recipes with `torch_compile: true` do. The
    aot_eager backend traces forward and backward like inductor but compiles no C++ kernels: what
    the loader sees (the compiled wrapper around a loader-built model) is the same, in seconds."""
    return torch.compile(_causal(path), backend="aot_eager")


def _frozen_by_name(path: str) -> nn.Module:
    model = _causal(path)
    for name, p in model.named_parameters():
        p.requires_grad_("layers.1." in name or "lm_head" in name)
    return model


def _input_grads_and_checkpointing(path: str) -> nn.Module:
    model = _causal(path)
    model.enable_input_require_grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _checkpoint_wrapped(path: str) -> nn.Module:
    """Each decoder layer wrapped with torch's `checkpoint_wrapper` before prepare: its names hold
    `_checkpoint_wrapped_module`, which rank 0's description leaves out, as `state_dict()` does."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    model = _causal(path)
    model.config.use_cache = False  # a cache grown in forward fails the recompute (transformers 4 uses one)
    decoder = type(model.model.layers[0])
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, decoder))
    return model


def _two_adapters(path: str) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_causal(path), LoraConfig(r=4, target_modules=["q_proj"]))
    model.add_adapter("second", LoraConfig(r=2, target_modules=["v_proj"], init_lora_weights="gaussian"))
    model.set_adapter("second")
    return model


def _modules_to_save(path: str) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(_causal(path), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))


def _deep_copy(path: str) -> nn.Module:
    """A copy of the loaded model is what gets prepared (TRL's `create_reference_model`, a script's
    `ref = copy.deepcopy(model)`): under the loader it is a loaded model of its own."""
    import copy

    return copy.deepcopy(_causal(path))


def _mode_changes(path: str) -> nn.Module:
    """`eval()` then `train()` before prepare, as TRL's `create_reference_model` (`.eval()`) and a
    script's generation before training do. transformers 5.25 kernelizes again at a change of
    mode, for the model's device: a loader-built model is on meta there, which the kernels
    library refuses ("Unsupported device type 'meta'") unless the load kept the run's device."""
    model = _causal(path)
    model.eval()
    model.train()
    return model


def _upcast_trainable(path: str) -> nn.Module:
    """LlamaFactory's full fine-tune of a bf16 model upcasts each trainable parameter through
    `.data`: `param.data = param.data.to(torch.float32)` (from a float32 checkpoint: the values
    keep their bf16 rounding)."""
    model = _bf16(path)
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(torch.float32)
    return model


CASES: dict[str, Callable[[str], nn.Module]] = {
    "classifier_head": _classifier,
    "to_bf16": _bf16,
    "bf16_norms_fp32": _bf16_norms_fp32,
    "compiled": _compiled,
    "frozen_by_name": _frozen_by_name,
    "input_grads_and_checkpointing": _input_grads_and_checkpointing,
    "checkpoint_wrapped": _checkpoint_wrapped,
    "two_adapters": _two_adapters,
    "modules_to_save": _modules_to_save,
    "deep_copy": _deep_copy,
    "upcast_trainable": _upcast_trainable,
    "mode_changes": _mode_changes,
}


def _kernels(model: nn.Module) -> tuple[bool, str]:
    """Whether transformers kernelized the model and for which mode (5.25 with `kernels`; False
    and None elsewhere), read on the first `PreTrainedModel` inside any wrapper."""
    from transformers import PreTrainedModel

    top = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
    return bool(getattr(top, "use_kernels", False)), str(getattr(top, "kernels_mode", None))


def _worker(rank: int, world_size: int, mode: str, path: str) -> dict[str, Any]:
    from accelerate import Accelerator

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(_config(mode))
    out: dict[str, Any] = {}
    for case, build in CASES.items():
        accelerator = Accelerator()
        torch.manual_seed(5)  # one seed on every rank, as a training script sets it
        model = build(path)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        named = list(model.named_parameters())  # what the op and the optimizer left unread
        kernels = _kernels(model)
        meta = (sum(p.is_meta for _, p in named), sum("lora_" not in n and "score" not in n for n, _ in named))
        try:
            model, optimizer = accelerator.prepare(model, optimizer)
        except RuntimeError as exc:
            out[case] = {"error": str(exc)}
            continue
        state = {k: _digest(v) for k, v in accelerator.get_state_dict(model).items()}
        rng = torch.rand(4).tolist()
        model.train()
        labels = (lambda ids: ids[:, 0] % 3) if case == "classifier_head" else None
        losses = train_steps(accelerator, model, optimizer, rank, labels=labels)
        out[case] = {"state": state, "rng": rng, "losses": losses, "meta_before_prepare": meta, "kernels": kernels}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    from fsdp_offload_cfg.testing.models import save_llama

    path = save_llama(str(tmp_path_factory.mktemp("before_prepare") / "llama"))
    return {mode: run_workers(_worker, 2, mode, path, timeout=400) for mode in MODES}


EQUAL = [(case, mode) for case in CASES for mode in ("broadcast", "sharded")]


@pytest.mark.parametrize(("case", "mode"), EQUAL)
def test_the_op_gives_what_the_run_without_the_loader_gives(runs: dict[str, Any], case: str, mode: str):
    plain0, ours0 = runs["loader_off"][0][case], runs[mode][0][case]
    assert "error" not in plain0 and "error" not in ours0, (plain0.get("error"), ours0.get("error"))
    assert plain0["state"] and ours0["state"] == plain0["state"]  # get_state_dict gathers on rank 0
    for rank in (0, 1):
        plain, ours = runs["loader_off"][rank][case], runs[mode][rank][case]
        assert ours["rng"] == plain["rng"], f"rank {rank}: the RNG stream differs"
        assert ours["losses"] == plain["losses"], (rank, ours["losses"], plain["losses"])


@pytest.mark.parametrize(("case", "mode"), EQUAL)
def test_every_rank_is_kernelized_as_a_plain_load_kernelizes_it(runs: dict[str, Any], case: str, mode: str):
    """transformers 5.25 kernelizes a model in `from_pretrained` (layers swapped for hub kernels
    where the device has them) and again at each change of mode. A rank that builds the model
    from rank 0's description calls no `from_pretrained`: before, it kept torch's layers while
    rank 0 ran the kernels, and the ranks computed differently where a plain load on each agrees.
    On transformers without kernelization both runs read (False, 'None')."""
    for rank in (0, 1):
        plain, ours = runs["loader_off"][rank][case], runs[mode][rank][case]
        assert ours["kernels"] == plain["kernels"], (rank, ours["kernels"], plain["kernels"])


@pytest.mark.parametrize(("case", "mode"), EQUAL)
def test_the_op_reads_no_weight_before_prepare(runs: dict[str, Any], case: str, mode: str):
    """Under the loader every checkpoint tensor stays on meta until prepare on every rank (rank 0
    included: the checkpoint is safetensors), whatever the op did: a cast, `.data`, a copy, PEFT
    wrapping, an optimizer built on it. A tensor that read itself because its values were used
    (`loading/pending.py`) would be a full copy on every rank, the peak the loader exists to avoid.
    `modules_to_save` is the documented exception: rank 0 reads the base whole to copy the module."""
    for rank in (0, 1) if case != "modules_to_save" else (1,):  # rank 0 reads the base whole for the copy
        meta, checkpoint_backed = runs[mode][rank][case]["meta_before_prepare"]
        assert meta >= checkpoint_backed > 0, (rank, meta, checkpoint_backed)  # more: a head rank 0 sends


# --------------------------------------------------------------------------------------------
# a float32 checkpoint loaded in bfloat16, trained with mixed precision
# --------------------------------------------------------------------------------------------


def _mixed_precision_worker(rank: int, world_size: int, mode: str, path: str) -> dict[str, Any]:
    """The Trainer's `bf16=True` recipe: `from_pretrained(dtype=torch.bfloat16)`, then accelerate
    upcasts the trainable parameters to float32 master weights; and a model loaded in float32 and
    cast with `model.to(torch.bfloat16)` before prepare."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(_config(mode))
    out: dict[str, Any] = {}
    builds = {"loaded_bf16": lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16),
              "cast_bf16": lambda: _causal(path).to(torch.bfloat16)}
    for case, build in builds.items():
        accelerator = Accelerator(mixed_precision="bf16")
        model = build()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        out[case] = {k: (str(v.dtype), _digest(v)) for k, v in accelerator.get_state_dict(model).items()}
    return out


@pytest.fixture(scope="module")
def mixed_precision_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    from fsdp_offload_cfg.testing.models import save_llama

    path = save_llama(str(tmp_path_factory.mktemp("mixed_precision") / "llama"))  # float32 on disk
    return {mode: run_workers(_mixed_precision_worker, 2, mode, path, timeout=300)[0]
            for mode in ("loader_off", "broadcast", "sharded", "auto")}  # fmt: skip


@pytest.mark.parametrize("case", ["loaded_bf16", "cast_bf16"])
@pytest.mark.parametrize("mode", ["broadcast", "sharded", "auto"])
def test_master_weights_hold_the_values_the_loaded_dtype_rounded_to(mixed_precision_runs: dict[str, Any],
                                                                    mode: str, case: str) -> None:
    """A plain load rounds the float32 checkpoint to bfloat16, and the float32 master weights
    hold those rounded values. The loader read the file straight into float32 (the rounding
    lost: 16 of 21 tensors differed); it now reads through every dtype the tensor held.
    (accelerate upcasts to float32 since 1.14; with 1.10-1.13 the master weights stay bfloat16,
    and equal; `upcast_trainable` above upcasts by hand on every leg.)"""
    plain, ours = mixed_precision_runs["loader_off"][case], mixed_precision_runs[mode][case]
    assert plain and ours == plain, sorted(k for k in plain if plain[k] != ours.get(k))
