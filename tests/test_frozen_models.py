"""A frozen model sharded beside the trained one: ms-swift's reference model, teacher and reward
models (its `prepare_fsdp` calls accelerate's `fsdp2_prepare_model`), LlamaFactory's DPO
reference model, TRL's through its own `prepare_fsdp`.

Such a model runs forwards under `no_grad` and never a backward, and FSDP2 reshards after
backward what a unit keeps gathered from its forward. Before, what each unit kept stayed
gathered on every rank for the rest of the run: accelerate 1.14+'s final norm and output head
(its tail group, `reshard_after_forward=False`), and under `reshard_after_forward: false` every
layer, the whole model. Checked on 2 real gloo ranks: after a forward under `no_grad`, every
parameter of the frozen model is a sharded DTensor again, and its logits are a plain model's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_offload_cfg.testing.configs import loader_config
from fsdp_offload_cfg.testing.dist import run_workers

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from fsdp_offload_cfg.testing.models import save_llama

    return save_llama(str(tmp_path_factory.mktemp("frozen") / "llama"))  # its head untied: a unit of its own


def _worker(rank: int, world_size: int, path: str, reshard: bool, via: str) -> dict[str, Any]:
    import transformers
    from accelerate import Accelerator
    from accelerate.utils import fsdp_utils
    from torch.distributed.tensor import DTensor

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(loader_config("loader_off", reshard_after_forward=reshard))
    accelerator = Accelerator()
    policy = transformers.AutoModelForCausalLM.from_pretrained(path)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    accelerator.prepare(policy, optimizer)  # the trained model, prepared first as the frameworks do
    frozen = transformers.AutoModelForCausalLM.from_pretrained(path)
    if via == "accelerate":  # as ms-swift's `prepare_fsdp` and LlamaFactory's reference model
        frozen = fsdp_utils.fsdp2_prepare_model(accelerator, frozen.requires_grad_(False).eval())
    else:  # TRL's reference models keep `requires_grad` (`create_model_from_path`): no backward reaches them
        from trl.models.utils import prepare_fsdp

        frozen = prepare_fsdp(frozen, accelerator)
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = frozen(input_ids=ids).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(path)(input_ids=ids).logits
    gathered = [n for n, p in frozen.named_parameters() if not isinstance(p, DTensor)]
    return {"gathered": gathered, "logits_off": (logits - plain).abs().max().item()}


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "reshard_after_forward_false"])
@pytest.mark.parametrize("via", ["accelerate", "trl"])
def test_a_frozen_model_holds_only_its_shards_after_a_forward_without_gradients(llama: str, reshard: bool,
                                                                                   via: str):
    if via == "trl":
        pytest.importorskip("trl")
    results = run_workers(_worker, 2, llama, reshard, via)
    for result in results:
        assert result["gathered"] == [], result["gathered"]
        assert result["logits_off"] < 1e-5, result
