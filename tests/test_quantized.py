"""A quantized model under meta loading is refused on every rank before any rank loads it.

A quantized model's weights are made by transformers while it loads (bitsandbytes' `Params4bit`
and its quant state), so the loader cannot build them on meta and fill them at prepare. It used to
find out after rank 0 had loaded, and quantized, the whole model, and said "quantized models are
not supported by the rank-0 meta loader; turn it off", naming no key. On 2 real gloo ranks through
`patch()`: bitsandbytes is not installed here, so transformers' own load stops at once with an
ImportError; the refusal coming instead shows it comes before the load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fsdp_offload_cfg.testing.configs import loader_config
from fsdp_offload_cfg.testing.dist import run_workers

pytestmark = pytest.mark.distributed

MODES = ["loader_off", "auto", "broadcast", "sharded"]
BNB_4BIT = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_quant_storage": "bfloat16"}


def _worker(rank: int, world_size: int, plain: str, prequantized: str, config_file: str) -> dict[str, str]:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import fsdp_offload_cfg

    def never_prepared() -> None:  # a teacher's shape: loaded whole where the run never prepares it
        with fsdp_offload_cfg.local_loading():
            AutoModelForCausalLM.from_pretrained(prequantized)

    calls = {
        "prequantized": lambda: AutoModelForCausalLM.from_pretrained(prequantized),
        # as a dict: transformers 4.57's BitsAndBytesConfig wants bitsandbytes installed to be made
        "quantization_config": lambda: AutoModelForCausalLM.from_pretrained(plain, quantization_config=BNB_4BIT),
        "local_loading": never_prepared,
    }
    out = {}
    for mode in MODES:
        path = Path(config_file.replace(".yaml", f"_{mode}.yaml"))
        path.write_text(json.dumps(loader_config(mode)))  # JSON is YAML: a file, as users name one
        with fsdp_offload_cfg.patch(str(path)):
            for case, call in calls.items():
                try:
                    call()
                    out[f"{mode}/{case}"] = "no error"
                except Exception as exc:  # noqa: BLE001
                    out[f"{mode}/{case}"] = f"{type(exc).__name__}: {exc}"
                dist.barrier()  # no rank was left in a collective: the ranks meet here, in step
    return out


def test_a_quantized_load_is_refused_on_every_rank_before_it_starts_naming_the_key_and_file(tmp_path: Path):
    from fsdp_offload_cfg.testing.models import save_llama

    plain = save_llama(str(tmp_path / "llama"))
    prequantized = tmp_path / "llama_bnb"
    shutil.copytree(plain, prequantized)
    config = json.loads((prequantized / "config.json").read_text())
    (prequantized / "config.json").write_text(json.dumps({**config, "quantization_config": BNB_4BIT}))

    results = run_workers(_worker, 2, plain, str(prequantized), str(tmp_path / "fsdp2.yaml"), timeout=180)
    for rank, out in enumerate(results):
        for case, method in (("prequantized", "the model config's quantization_config (bitsandbytes)"),
                             ("quantization_config", "quantization_config (bitsandbytes)")):
            stock = out[f"loader_off/{case}"]  # meta loading off: transformers' own load, as without the plugin
            assert "bitsandbytes" in stock and "meta loading" not in stock, (rank, stock)  # ImportError, or its subclass
            for mode in MODES[1:]:
                said = out[f"{mode}/{case}"]
                assert said.startswith(f"NotImplementedError: {plain if case != 'prequantized' else prequantized} "
                                       f"loads quantized ({method}), which meta loading cannot build"), (rank, mode, said)
                fix = f"set fsdp_cpu_ram_efficient_loading: false in {tmp_path / f'fsdp2_{mode}.yaml'}: every rank"
                assert fix in said and "`with fsdp_offload_cfg.local_loading():`" in said, (rank, mode, said)
        for mode in MODES:  # inside local_loading() the load is transformers' own, meta loading on or off
            said = out[f"{mode}/local_loading"]
            assert "bitsandbytes" in said and "meta loading" not in said, (rank, mode, said)


def test_how_a_load_quantizes_is_read_from_the_call_and_from_the_checkpoint(tmp_path: Path):
    """The words of the refusal, from each place a load takes its quantization: the call's
    `quantization_config` (a config object or its dict), a `config=` object, the checkpoint's
    config.json; nothing where none quantizes or config.json cannot be read (the load says why)."""
    from transformers import AutoConfig

    from fsdp_offload_cfg.loading.quantized import quantization_of
    from fsdp_offload_cfg.testing.models import save_llama

    plain = save_llama(str(tmp_path / "llama"))
    assert quantization_of(plain, {}) is None
    assert quantization_of(str(tmp_path / "missing"), {}) is None
    assert quantization_of(plain, {"quantization_config": {"quant_method": "torchao"}}) == "quantization_config (torchao)"
    # a method that may load its weights plain is left to the load: asked to (gpt-oss from its MXFP4
    # checkpoint with dequantize=True), or by transformers where the kernels are missing
    assert quantization_of(plain, {"quantization_config": {"quant_method": "mxfp4", "dequantize": True}}) is None
    assert quantization_of(plain, {"quantization_config": {"quant_method": "mxfp4"}}) is None
    assert quantization_of(plain, {"quantization_config": {"quant_method": "compressed-tensors"}}) is None
    assert quantization_of(plain, {"quantization_config": {"quant_method": "not-a-method"}}) is None
    config = AutoConfig.from_pretrained(plain)
    assert quantization_of(plain, {"config": config}) is None
    config.quantization_config = BNB_4BIT
    said = "the model config's quantization_config (bitsandbytes)"
    assert quantization_of(plain, {"config": config}) == said
    config.save_pretrained(tmp_path / "prequantized")
    assert quantization_of(str(tmp_path / "prequantized"), {}) == said
    assert quantization_of("ignored", {"config": str(tmp_path / "prequantized")}) == said
    try:
        from transformers import BitsAndBytesConfig

        given = BitsAndBytesConfig(load_in_4bit=True)
    except ImportError:  # transformers 4.57 wants bitsandbytes installed to make one
        return
    assert quantization_of(plain, {"quantization_config": given}) == "quantization_config=BitsAndBytesConfig (bitsandbytes)"
