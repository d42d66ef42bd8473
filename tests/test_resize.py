"""New tokens on a loader-built model: `resize_token_embeddings` between `from_pretrained` and
`prepare` gives the embeddings (and the head, tied or not) a plain run gives, bit for bit.

On 2 real gloo ranks through `patch()` and `accelerator.prepare`, one seed, the loader off,
"broadcast" and "sharded": every tensor after prepare, the RNG stream after it, and the losses of
two steps are equal. Every rank other than 0 used to die in transformers' mean resizing
("Tensor.item() cannot be called on meta tensors"), and every rank under "sharded".
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_offload_cfg.testing.compare import digest as _digest
from fsdp_offload_cfg.testing.configs import loader_config as _config
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.training import train_steps

pytestmark = pytest.mark.distributed

MODES = ["loader_off", "broadcast", "sharded"]
RESIZES = {  # (model, resize_token_embeddings keyword arguments)
    "llama_mean": ("llama", {"new_num_tokens": 104}),
    "qwen2_tied_mean": ("qwen2_tied", {"new_num_tokens": 101}),
    "llama_padded_plain_init": ("llama", {"new_num_tokens": 99, "pad_to_multiple_of": 8, "mean_resizing": False}),
    "qwen2_tied_plain_init": ("qwen2_tied", {"new_num_tokens": 103, "mean_resizing": False}),
}


def _worker(rank: int, world_size: int, mode: str, paths: dict[str, str]) -> dict[str, Any]:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(_config(mode))
    out: dict[str, Any] = {}
    for case, (name, kwargs) in RESIZES.items():
        accelerator = Accelerator()
        accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = None  # the singleton keeps the first
        torch.manual_seed(3)  # one seed on every rank, as a training script sets it
        model = AutoModelForCausalLM.from_pretrained(paths[name])
        model.resize_token_embeddings(**kwargs)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        state = {k: _digest(v) for k, v in accelerator.get_state_dict(model).items()}
        after = torch.rand(4).tolist()  # the RNG stream every rank continues with
        losses = train_steps(accelerator, model, optimizer, rank, vocab=model.config.vocab_size, use_cache=False)
        tied = model.get_input_embeddings().weight is getattr(model.get_output_embeddings(), "weight", None)
        out[case] = {"state": state, "rng": after, "losses": losses, "tied": tied,
                     "vocab": model.config.vocab_size}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    from fsdp_offload_cfg.testing.models import save_llama, save_qwen2_tied

    root = tmp_path_factory.mktemp("resize")
    paths = {"llama": save_llama(str(root / "llama")), "qwen2_tied": save_qwen2_tied(str(root / "qwen2"))}
    return {mode: run_workers(_worker, 2, mode, paths, timeout=300) for mode in MODES}


@pytest.mark.parametrize("mode", ["broadcast", "sharded"])
@pytest.mark.parametrize("case", list(RESIZES))
def test_resized_embeddings_equal_the_run_without_the_loader(runs: dict[str, Any], mode: str, case: str):
    plain0 = runs["loader_off"][0][case]
    assert plain0["state"], "get_state_dict gave nothing to compare"
    assert runs[mode][0][case]["state"] == plain0["state"]  # get_state_dict gathers on rank 0
    for rank in (0, 1):
        plain, ours = runs["loader_off"][rank][case], runs[mode][rank][case]
        assert ours["vocab"] == plain["vocab"] > 97
        assert ours["rng"] == plain["rng"], f"rank {rank}: the RNG stream after the resize differs"
        assert ours["losses"] == plain["losses"], (rank, ours["losses"], plain["losses"])
        assert ours["tied"] == plain["tied"] == case.startswith("qwen2_tied")
