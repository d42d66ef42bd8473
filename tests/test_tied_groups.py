"""Ties beyond a causal LM's two embeddings under FSDP2 (`fsdp_offload_cfg.tie_groups`): T5 and
BART (`shared` tied to both stacks' `embed_tokens` and the `lm_head`), BERT and RoBERTa MLM heads
(the decoder's weight tied to the word embeddings, its bias to the head's own `bias`).

accelerate's `fsdp2_prepare_model` keeps only an input and an output embedding together, so on
these models FSDP2 refused the tie ("shared with a parameter already managed by another FSDP
group") or crashed on it (`_init_sharding_spec_tp`), with the loader on or off. On 2 real gloo
ranks through `patch()` and `accelerator.prepare`: every tensor after prepare equals a plain
load, each tie is one parameter, two AdamW steps give the same losses with the loader off,
"broadcast" and "sharded", and the saved checkpoint loads back tied. The same families through
the Trainer (its `fsdp_config`, its own prepare) and as TRL reference models (`prepare_fsdp`).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_offload_cfg.testing.compare import digest as _digest
from fsdp_offload_cfg.testing.configs import loader_config
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.models import save_each
from fsdp_offload_cfg.testing.training import train_steps

pytestmark = pytest.mark.distributed

MODES = ["loader_off", "broadcast", "sharded"]
# each family's layer classes, as a user lists them (transformers 4.57's RoBERTa names a class it
# no longer has in `_no_split_modules`, which accelerate would wrap by default)
LAYERS = {"T5ForConditionalGeneration": ["T5Block"],
          "BartForConditionalGeneration": ["BartEncoderLayer", "BartDecoderLayer"],
          "BertForMaskedLM": ["BertLayer"], "RobertaForMaskedLM": ["RobertaLayer"]}
FAMILIES = list(LAYERS)
STEPS = 2


def _tiny(family: str) -> nn.Module:
    import transformers

    small = {"vocab_size": 64}
    configs = {
        "T5ForConditionalGeneration": transformers.T5Config(
            d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0, **small),
        "BartForConditionalGeneration": transformers.BartConfig(
            d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, **small),
        "BertForMaskedLM": transformers.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, **small),
        "RobertaForMaskedLM": transformers.RobertaConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=66, **small),
    }
    torch.manual_seed(0)
    return getattr(transformers, family)(configs[family])


def _ties(model: nn.Module) -> list[tuple[str, ...]]:
    from fsdp_offload_cfg.tie_groups import tied_holders

    return sorted(tuple(name for name, _ in found) for found in tied_holders(model).values())


def _config(mode: str) -> dict[str, Any]:
    return loader_config(mode, fsdp_state_dict_type="SHARDED_STATE_DICT")


def _run_worker(rank: int, world_size: int, mode: str, paths: dict[str, str], out_root: str) -> dict[str, Any]:
    import transformers
    from accelerate import Accelerator

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(_config(mode))
    results: dict[str, Any] = {}
    for family, path in paths.items():
        accelerator = Accelerator()
        accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = LAYERS[family]  # the singleton keeps the first
        model = getattr(transformers, family).from_pretrained(path)
        ties = _ties(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        try:
            model, optimizer = accelerator.prepare(model, optimizer)
        except Exception as exc:  # noqa: BLE001 - what this rank saw is the result
            results[family] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        prepared = accelerator.get_state_dict(model)  # every rank takes part
        one_parameter = [all(model.get_parameter(n) is model.get_parameter(tie[0]) for n in tie) for tie in ties]
        losses = train_steps(accelerator, model, optimizer, rank, steps=STEPS, vocab=64)
        trained = accelerator.get_state_dict(model)
        reference = _trl_reference(family, path, accelerator, ties)
        out = os.path.join(out_root, mode, family)
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(out, state_dict=trained)
        accelerator.wait_for_everyone()
        results[family] = {
            "error": None,
            "ties": ties,
            "one_parameter": one_parameter,
            "losses": losses,
            "prepared": {k: _digest(v) for k, v in prepared.items()} if rank == 0 else None,
            "trained": {k: _digest(v) for k, v in trained.items()} if rank == 0 else None,
            "saved_to": out,
            "reference": reference if rank == 0 or reference is None else {**reference, "prepared": None},
        }
    return results


def _trl_reference(family: str, path: str, accelerator: Any, ties: list[tuple[str, ...]]) -> dict[str, Any] | None:
    """The same checkpoint as a reference model through TRL's `prepare_fsdp` (its own
    `fully_shard`, no optimizer): ties kept, a forward runs (FSDP2 checks shared parameters at
    its first forward), every tensor as a plain load. None where TRL is not installed."""
    import importlib.util

    import transformers

    if importlib.util.find_spec("trl") is None:
        return None
    from trl.models.utils import prepare_fsdp

    reference = prepare_fsdp(getattr(transformers, family).from_pretrained(path), accelerator)
    one_parameter = [all(reference.get_parameter(n) is reference.get_parameter(tie[0]) for n in tie) for tie in ties]
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        loss = reference(input_ids=ids, labels=ids).loss.item()
    prepared = accelerator.get_state_dict(reference)
    return {"one_parameter": one_parameter, "loss": loss, "prepared": {k: _digest(v) for k, v in prepared.items()}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return save_each(tmp_path_factory.mktemp("tied"), FAMILIES, _tiny)


@pytest.fixture(scope="module")
def runs(checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = str(tmp_path_factory.mktemp("trained"))
    return {mode: run_workers(_run_worker, 2, mode, checkpoints, out, timeout=300) for mode in MODES}


def _plain(path: str, family: str) -> nn.Module:
    import transformers

    return getattr(transformers, family).from_pretrained(path)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_prepare_keeps_every_tie_and_every_tensor_of_a_plain_load(runs: dict[str, Any], checkpoints: dict[str, str],
                                                                  mode: str, family: str):
    for rank in (0, 1):
        result = runs[mode][rank][family]
        assert result["error"] is None, (rank, result["error"])
        assert result["ties"], "the family ties nothing: the test would prove nothing"
        assert all(result["one_parameter"]), (rank, result["ties"], result["one_parameter"])
    plain = _plain(checkpoints[family], family).state_dict()
    assert runs[mode][0][family]["prepared"] == {k: _digest(v) for k, v in plain.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_losses_are_bit_equal_with_the_loader_off_broadcast_and_sharded(runs: dict[str, Any], family: str):
    for rank in (0, 1):
        losses = {mode: runs[mode][rank][family]["losses"] for mode in MODES}
        assert losses["broadcast"] == losses["loader_off"] == losses["sharded"], (rank, losses)
        assert losses["loader_off"][1] != losses["loader_off"][0]  # the step changed the weights


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_saved_checkpoint_loads_back_tied(runs: dict[str, Any], mode: str, family: str):
    result = runs[mode][0][family]
    reloaded = _plain(result["saved_to"], family)
    for tie in result["ties"]:
        assert all(reloaded.get_parameter(n) is reloaded.get_parameter(tie[0]) for n in tie), tie
    assert {k: _digest(v) for k, v in reloaded.state_dict().items()} == result["trained"]


def _split_worker(rank: int, world_size: int, path: str) -> str | None:
    """The word embeddings sharded by hand before prepare, then the model re-tied (its decoder now
    holds their DTensor): that tie can no longer be kept in one group. FSDP2 itself crashed in
    `_init_sharding_spec_tp` ("Invariant encountered: value was None")."""
    from accelerate import Accelerator
    from torch.distributed.fsdp import fully_shard
    from transformers import BertForMaskedLM

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(_config("loader_off"))
    accelerator = Accelerator()
    model = BertForMaskedLM.from_pretrained(path)
    fully_shard(model.bert.embeddings.word_embeddings)
    model.tie_weights()
    try:
        accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    except Exception as exc:  # noqa: BLE001 - what this rank saw is the result
        return f"{type(exc).__name__}: {exc}"
    return None


def test_a_tie_that_cannot_stay_in_one_group_stops_every_rank_naming_both(checkpoints: dict[str, str]):
    errors = run_workers(_split_worker, 2, checkpoints["BertForMaskedLM"], timeout=120)
    for error in errors:
        assert error is not None and error.startswith("TieGroupError: the tied parameters "), error
        assert "bert.embeddings.word_embeddings.weight" in error and "cls.predictions.decoder.weight" in error, error
        assert "transformer_layer_cls_to_wrap" in error, error


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_trl_reference_model_keeps_its_ties_too(runs: dict[str, Any], checkpoints: dict[str, str], mode: str,
                                                  family: str):
    """TRL shards reference models itself (`prepare_fsdp`, the loader's `trl-prepare-fsdp` patch)."""
    references = [runs[mode][rank][family]["reference"] for rank in (0, 1)]
    if references[0] is None:
        pytest.skip("TRL is not installed on this leg")
    for rank, reference in enumerate(references):
        assert all(reference["one_parameter"]), (rank, reference["one_parameter"])
    assert references[0]["loss"] == references[1]["loss"] == runs["loader_off"][0][family]["reference"]["loss"]
    plain = _plain(checkpoints[family], family).state_dict()
    assert references[0]["prepared"] == {k: _digest(v) for k, v in plain.items()}


# --------------------------------------------------------------------------------------------
# the Trainer's path: `fsdp_config` in TrainingArguments, its own Accelerator and prepare
# --------------------------------------------------------------------------------------------


def _trainer_worker(rank: int, world_size: int, mode: str, paths: dict[str, str], out_root: str) -> dict[str, Any]:
    """Each family trained two steps by the Trainer, the config in its `fsdp_config` (no config
    given to `patch()`), as a Trainer script writes it."""
    import transformers
    from accelerate.state import AcceleratorState

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch()
    results: dict[str, Any] = {}
    for family, path in paths.items():
        fsdp_config = {"version": 2, "cpu_ram_efficient_loading": mode != "loader_off",
                       "transformer_layer_cls_to_wrap": LAYERS[family], "state_dict_type": "SHARDED_STATE_DICT"}
        if mode != "loader_off":
            fsdp_config["load_strategy"] = mode
        args = transformers.TrainingArguments(
            output_dir=os.path.join(out_root, mode, family), per_device_train_batch_size=2, max_steps=STEPS,
            learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], seed=0, fsdp=True,
            fsdp_config=fsdp_config)
        g = torch.Generator().manual_seed(0)
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(1, 64, (4 * STEPS, 12), generator=g)]
        model = getattr(transformers, family).from_pretrained(path)
        ties = _ties(model)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        try:
            trainer.train()
        except Exception as exc:  # noqa: BLE001 - what this rank saw is the result
            results[family] = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            trained = trainer.model_wrapped
            results[family] = {
                "error": None,
                "ties": ties,
                "one_parameter": [all(trained.get_parameter(n) is trained.get_parameter(t[0]) for n in t) for t in ties],
                "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            }
        AcceleratorState._reset_state()  # the next family's Trainer builds its own plugin (layer classes)
    return results


@pytest.fixture(scope="module")
def trainer_runs(checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = str(tmp_path_factory.mktemp("trainer"))
    return {mode: run_workers(_trainer_worker, 2, mode, checkpoints, out, timeout=300) for mode in MODES}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_trainer_trains_each_family_the_same_with_the_loader_off_broadcast_and_sharded(
        trainer_runs: dict[str, Any], family: str):
    for rank in (0, 1):
        results = {mode: trainer_runs[mode][rank][family] for mode in MODES}
        for mode, result in results.items():
            assert result["error"] is None, (mode, rank, result["error"])
            assert result["ties"] and all(result["one_parameter"]), (mode, rank, result)
            assert len(result["losses"]) == STEPS, (mode, rank, result["losses"])
        losses = {mode: result["losses"] for mode, result in results.items()}
        assert losses["broadcast"] == losses["loader_off"] == losses["sharded"], (rank, losses)
