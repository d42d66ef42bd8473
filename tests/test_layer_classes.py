"""TRANSFORMER_BASED_WRAP with no `fsdp_transformer_layer_cls_to_wrap` (`fsdp_offload_cfg.layer_classes`).

accelerate wraps the classes `model._no_split_modules` names and raises if one is not in the
model. transformers 5 lists every sub-model class's names there, so Llava (`CLIPTextEmbeddings`),
Gemma 3 and PaliGemma (`SiglipTextEmbeddings`) failed in `accelerator.prepare` with "Could not
find the transformer layer class ... in the model"; on 4.57 Gemma3ForCausalLM does (its SigLIP
names), and Llava, which declares no class of its own, was one FSDP unit, gathered whole for every
forward. Now the run wraps the classes the model (or, where it declares none, its sub-models)
declares and has, exactly as the same run with those classes listed by hand, bit for bit; a model
whose list names only classes it lacks is refused on every rank with the key to set.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fsdp_offload_cfg.testing.configs import loader_config
from fsdp_offload_cfg.testing.dist import run_workers
from fsdp_offload_cfg.testing.models import save_each
from fsdp_offload_cfg.testing.training import train_steps

FAMILIES = ["LlavaForConditionalGeneration", "Gemma3ForConditionalGeneration", "Gemma3ForCausalLM"]
VOCAB = 90  # below every family's image token id: text-only batches


def _tiny(family: str) -> nn.Module:
    import transformers

    from fsdp_offload_cfg.testing.models import llama_config

    torch.manual_seed(0)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, vocab_size=128, max_position_embeddings=64)
    siglip = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    if family == "LlavaForConditionalGeneration":
        vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, image_size=16, patch_size=8)
        config = transformers.LlavaConfig(vision_config=vision, text_config=llama_config(), image_token_index=96)
    elif family == "Gemma3ForConditionalGeneration":
        config = transformers.Gemma3Config(text_config=text, vision_config=siglip, mm_tokens_per_image=4,
                                           image_token_index=120, boi_token_index=121, eoi_token_index=122)
    else:
        config = transformers.Gemma3TextConfig(**text)
    return getattr(transformers, family)(config)


def _present(model: nn.Module) -> list[str]:
    """The test's own reading of what a user would list: the classes the model or any of its
    sub-models declares, that the model builds."""
    built = {type(m).__name__ for m in model.modules()}
    declared = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    return sorted(declared & built)


FSDP1 = {"distributed_type": "FSDP", "mixed_precision": "no", "fsdp_config": {
    "fsdp_version": 1, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_sync_module_states": False,
    "fsdp_cpu_ram_efficient_loading": False, "fsdp_use_orig_params": True}}


def _units(model: nn.Module) -> list[str]:
    """The classes of the modules FSDP made units of: FSDP2's `FSDP<class>`, FSDP1's wrapped module.
    A checkpointed layer's unit is named by the layer: accelerate up to 1.15 shards the layer inside
    torch's `CheckpointWrapper`, 1.16 the wrapper around it (to keep FSDP's hooks out of compiled code)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1Unit

    def held(m: nn.Module) -> nn.Module:
        return getattr(m, "_checkpoint_wrapped_module", m)

    return sorted([f"FSDP{type(held(m)).__name__}" if held(m) is not m else type(m).__name__
                   for m in model.modules() if isinstance(m, FSDPModule)]
                  + [f"FSDP{type(m.module).__name__}" for m in model.modules() if isinstance(m, FSDP1Unit)])


def _run_worker(rank: int, world_size: int, mode: str, ac: bool, paths: dict[str, str]) -> dict[str, Any]:
    import transformers
    from accelerate import Accelerator
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(FSDP1 if mode == "fsdp1" else loader_config(mode, fsdp_activation_checkpointing=ac))
    results: dict[str, Any] = {}
    for family, path in paths.items():
        for listed in (False, True):
            accelerator = Accelerator()
            plugin = accelerator.state.fsdp_plugin  # the singleton keeps what the last prepare set
            plugin.auto_wrap_policy = transformer_auto_wrap_policy
            model = getattr(transformers, family).from_pretrained(path)
            declared = sorted(model._no_split_modules or [])
            plugin.transformer_cls_names_to_wrap = _present(model) if listed else None
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            try:
                model, optimizer = accelerator.prepare(model, optimizer)
            except Exception as exc:  # noqa: BLE001 - what this rank saw is the result
                results[family, listed] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            units = _units(model)
            losses = train_steps(accelerator, model, optimizer, rank, vocab=VOCAB, use_cache=False)
            results[family, listed] = {"error": None, "units": units, "losses": losses, "declared": declared,
                                       "after": sorted(accelerator.unwrap_model(model)._no_split_modules or [])}
    # a model whose list names only classes it does not build (a remote-code model's stale names)
    plugin.transformer_cls_names_to_wrap, plugin.auto_wrap_policy = None, transformer_auto_wrap_policy
    model = transformers.Gemma3ForCausalLM.from_pretrained(paths["Gemma3ForCausalLM"])
    model._no_split_modules = ["GPT2Block"]
    try:
        accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
        results["none_left"] = "prepared"
    except ValueError as exc:
        results["none_left"] = str(exc)
    plugin.transformer_cls_names_to_wrap = ["GemmaDecoderLayer"]  # listed by the user's code, misspelt
    model = transformers.Gemma3ForCausalLM.from_pretrained(paths["Gemma3ForCausalLM"])
    try:
        accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
        results["misspelt"] = "prepared"
    except ValueError as exc:
        results["misspelt"] = str(exc)
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return save_each(tmp_path_factory.mktemp("layer_classes"), FAMILIES, _tiny)


@pytest.mark.distributed
@pytest.mark.parametrize(("mode", "ac"), [("loader_off", False), ("sharded", True), ("fsdp1", False)])
def test_default_wrap_takes_the_declared_classes_the_model_has(checkpoints: dict[str, str], mode: str,
                                                                ac: bool) -> None:
    """Each family prepares and trains with no layer classes set, and its FSDP units and losses
    are those of the same run with the classes listed by hand; with activation checkpointing and
    the loader too, and under FSDP1 (accelerate reads the classes in the same place)."""
    results = run_workers(_run_worker, 2, mode, ac, checkpoints)
    changed_somewhere = False
    for family in FAMILIES:
        by_default, by_hand = results[0][family, False], results[0][family, True]
        assert by_default["error"] is None, (family, by_default["error"])
        assert by_hand["error"] is None, (family, by_hand["error"])
        model = _tiny(family)
        present = _present(model)
        changed_somewhere |= present != sorted(model._no_split_modules or [])  # names left out, or taken from sub-models
        assert by_default["units"] == by_hand["units"], family
        assert {f"FSDP{name}" for name in present} <= set(by_default["units"]), family
        for rank in (0, 1):  # bit for bit, on every rank
            assert results[rank][family, False]["losses"] == results[rank][family, True]["losses"], family
        assert by_default["after"] == by_default["declared"], "the model's own list is given back"
    assert changed_somewhere, "every family's own list is right on this transformers: the test would pass vacuously"
    for rank in (0, 1):
        message = results[rank]["none_left"]
        assert "Gemma3ForCausalLM" in message and "GPT2Block" in message, message
        assert "fsdp_transformer_layer_cls_to_wrap" in message and "<dict>" in message, message
        assert "Gemma3DecoderLayer" in message, message  # the class it repeats, to list
        assert results[rank]["misspelt"] == (
            "transformer_cls_names_to_wrap on accelerate's FSDP plugin (set in code) names GemmaDecoderLayer, which is not a module class of Gemma3ForCausalLM; its layer classes are "
            "Gemma3DecoderLayer (fix the list, or remove it to wrap those)"), results[rank]["misspelt"]


STUDENT_AND_TEACHER = ["LlamaForCausalLM", "Qwen2ForCausalLM"]


def _student_or_teacher(name: str) -> nn.Module:
    import transformers

    from fsdp_offload_cfg.testing.models import llama_config

    torch.manual_seed(1)
    if name == "LlamaForCausalLM":
        return transformers.LlamaForCausalLM(llama_config())
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
        num_hidden_layers=2, max_position_embeddings=64, tie_word_embeddings=False))


def _teacher_ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


def _student_and_teacher_worker(rank: int, world_size: int, mode: str, paths: dict[str, str]) -> dict[str, Any]:
    """Distillation into a model of another architecture, with no layer class listed: the student
    through `prepare`, then the teacher sharded by the same Accelerator, the way frameworks shard
    their second model (FSDP2: `fsdp2_prepare_model`, as LlamaFactory and TRL-style trainers do;
    FSDP1: `prepare_model`)."""
    import transformers
    from accelerate import Accelerator

    import fsdp_offload_cfg

    fsdp_offload_cfg.patch(FSDP1 if mode == "fsdp1" else loader_config(mode))
    from accelerate.utils import fsdp2_prepare_model  # after patch(), as a script that imports it binds ours
    accelerator = Accelerator()
    student = transformers.LlamaForCausalLM.from_pretrained(paths["LlamaForCausalLM"])
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    student, optimizer = accelerator.prepare(student, optimizer)
    teacher = transformers.Qwen2ForCausalLM.from_pretrained(paths["Qwen2ForCausalLM"])
    try:
        teacher = accelerator.prepare_model(teacher) if mode == "fsdp1" else fsdp2_prepare_model(accelerator, teacher)
    except Exception as exc:  # noqa: BLE001 - what this rank saw is the result
        return {"error": f"{type(exc).__name__}: {exc}"}
    with torch.no_grad():
        logits = teacher(input_ids=_teacher_ids(), use_cache=False).logits
    return {"error": None, "units": {"student": _units(student), "teacher": _units(teacher)},
            "logits": logits.tolist(), "losses": train_steps(accelerator, student, optimizer, rank, use_cache=False)}


@pytest.fixture(scope="module")
def student_and_teacher(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return save_each(tmp_path_factory.mktemp("student_and_teacher"), STUDENT_AND_TEACHER, _student_or_teacher)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["sharded", "fsdp1"])
def test_a_second_model_of_another_class_wraps_its_own_layers(student_and_teacher: dict[str, str],
                                                              mode: str) -> None:
    """accelerate keeps the first model's default classes on the plugin: a teacher of another
    architecture was refused under FSDP2 ("Could not find the transformer layer class
    LlamaDecoderLayer in the model"), and under FSDP1 became one unit (the first model's policy
    matches none of its modules). Each model now wraps its own classes, and the teacher's logits
    are those of the same model unsharded."""
    import transformers

    results = run_workers(_student_and_teacher_worker, 2, mode, student_and_teacher)
    teacher = transformers.Qwen2ForCausalLM.from_pretrained(student_and_teacher["Qwen2ForCausalLM"])
    with torch.no_grad():
        expected = teacher(input_ids=_teacher_ids(), use_cache=False).logits.tolist()
    for rank in (0, 1):
        assert results[rank]["error"] is None, results[rank]["error"]
        units = results[rank]["units"]
        assert units["student"].count("FSDPLlamaDecoderLayer") == 2, units
        assert units["teacher"].count("FSDPQwen2DecoderLayer") == 2, units
        assert "FSDPLlamaDecoderLayer" not in units["teacher"], units
        assert results[rank]["logits"] == expected
        assert len(results[rank]["losses"]) == 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)


class Net(nn.Module):
    _no_split_modules = ["Block", "TextEmbeddings"]  # noqa: RUF012 - a class attribute, as transformers 4.x keeps it

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])


def _plugin(**kwargs: Any) -> Any:
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(**{"fsdp_version": 2, "auto_wrap_policy": "transformer_based_wrap", **kwargs})


def test_only_the_default_list_changes_and_only_for_the_call(capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_offload_cfg.layer_classes import DefaultLayers, default_layer_classes, present_classes_only

    net = Net()
    assert default_layer_classes(net) == DefaultLayers(["Block"], ["TextEmbeddings"], inherited=False)
    with present_classes_only(_plugin(), net, "a.yaml"):
        assert net._no_split_modules == ["Block"]
    assert "_no_split_modules" not in vars(net) and net._no_split_modules == Net._no_split_modules
    assert "Net: wrapping Block; its _no_split_modules also names TextEmbeddings" in capsys.readouterr().err

    net.__dict__["_no_split_modules"] = {"Block", "TextEmbeddings"}  # transformers 5: an instance set
    with present_classes_only(_plugin(), net, "a.yaml"):
        assert net._no_split_modules == ["Block"]
    assert net._no_split_modules == {"Block", "TextEmbeddings"}

    listed = _plugin(transformer_cls_names_to_wrap=["Block"])  # the user's own list stays theirs
    with present_classes_only(listed, net, "a.yaml"):
        assert net._no_split_modules == {"Block", "TextEmbeddings"}
    assert listed.transformer_cls_names_to_wrap == ["Block"]
    with present_classes_only(_plugin(auto_wrap_policy="size_based_wrap"), net, "a.yaml"):
        assert net._no_split_modules == {"Block", "TextEmbeddings"}


def test_a_model_with_no_declared_class_left_is_refused_with_the_key_and_its_blocks() -> None:
    from fsdp_offload_cfg.layer_classes import present_classes_only

    net = Net()
    net._no_split_modules = ["TextEmbeddings"]
    with pytest.raises(ValueError) as caught, present_classes_only(_plugin(), net, "fsdp2.yaml"):
        pass
    assert str(caught.value) == ("Net: TRANSFORMER_BASED_WRAP has no layer class to wrap: the model's "
                                 "_no_split_modules names TextEmbeddings, which it does not have. Set "
                                 "fsdp_transformer_layer_cls_to_wrap in fsdp2.yaml to its layer classes "
                                 "(it repeats Block).")
    assert net._no_split_modules == ["TextEmbeddings"]


def test_the_estimate_models_the_classes_the_run_wraps(tmp_path: Any) -> None:
    """`estimate` counts the FSDP units the run makes: the declared classes the model has; a model
    with none is refused as the run refuses it; a listed class it lacks names those it has."""
    from fsdp_offload_cfg.config import load_config
    from fsdp_offload_cfg.estimate.inputs import EstimateError
    from fsdp_offload_cfg.estimate.model import layer_class_names
    from fsdp_offload_cfg.estimate.report import build_report

    net = Net()
    assert layer_class_names(net, None) == ["Block"]
    assert layer_class_names(net, ("TextEmbeddings",)) == ["TextEmbeddings"]
    net._no_split_modules = ["TextEmbeddings"]
    with pytest.raises(EstimateError, match=r"fsdp_transformer_layer_cls_to_wrap in cfg.yaml .*it repeats Block"):
        layer_class_names(net, None, "cfg.yaml")

    path = str(tmp_path / "llava")
    _tiny("LlavaForConditionalGeneration").save_pretrained(path)
    config = load_config(loader_config("loader_off", fsdp_transformer_layer_cls_to_wrap="CLIPTextEmbeddings"))
    with pytest.raises(EstimateError) as caught:
        build_report(config, path, ranks=2, seq_len=16, batch_size=1, optimizer="adamw", device="cpu", dtype=None)
    assert ("<dict>: fsdp_transformer_layer_cls_to_wrap names CLIPTextEmbeddings, which is not a module class of "
            "LlavaForConditionalGeneration") in str(caught.value)
    listed = str(caught.value).split("its layer classes are ")[1]  # the declared ones it has (4.57 declares none:
    assert "LlamaDecoderLayer" in listed and "CLIPTextEmbeddings" not in listed, listed  # then the blocks it repeats)


class SubModel(nn.Module):
    _no_split_modules = ["Block", "VisionLayer"]  # noqa: RUF012 - as transformers declares it

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])


class Composite(nn.Module):
    _no_split_modules: list[str] = []  # noqa: RUF012 - transformers 4.x: Llava, Mistral3, InternVL declare none of their own

    def __init__(self) -> None:
        super().__init__()
        self.language_model = SubModel()


def test_a_model_declaring_none_takes_its_sub_models_classes(capsys: pytest.CaptureFixture[str]) -> None:
    """As transformers 5 does in `post_init`: else accelerate wraps nothing but the root."""
    from fsdp_offload_cfg.layer_classes import DefaultLayers, default_layer_classes, present_classes_only

    model = Composite()
    assert default_layer_classes(model) == DefaultLayers(["Block"], ["VisionLayer"], inherited=True)
    with present_classes_only(_plugin(), model, "a.yaml"):
        assert model._no_split_modules == ["Block"]
    assert model._no_split_modules == []
    assert "Composite declares no layer classes: wrapping its sub-models' Block" in capsys.readouterr().err


def test_a_model_with_nothing_declared_is_one_unit_and_rank_0_warns(capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_offload_cfg.layer_classes import present_classes_only

    model = Composite()
    model.language_model._no_split_modules = []  # a BERT-style model on transformers 4.x declares nothing
    with present_classes_only(_plugin(), model, "fsdp2.yaml"):
        assert model._no_split_modules == []
    assert ("Composite: TRANSFORMER_BASED_WRAP finds no layer class to wrap (the model declares none): the whole "
            "model is one FSDP unit, gathered whole for every forward; set fsdp_transformer_layer_cls_to_wrap in "
            "fsdp2.yaml (it repeats Block)") in capsys.readouterr().err


def test_a_listed_class_the_model_lacks_is_refused_naming_the_key_and_where_it_was_set() -> None:
    """accelerate says only "Could not find the transformer layer class X in the model"."""
    from fsdp_offload_cfg.layer_classes import present_classes_only

    net = Net()
    with pytest.raises(ValueError) as caught, present_classes_only(
            _plugin(transformer_cls_names_to_wrap=["LlamaDecoderLayer"]), net, "fsdp2.yaml", ("LlamaDecoderLayer",)):
        pass
    assert str(caught.value) == ("fsdp2.yaml: fsdp_transformer_layer_cls_to_wrap names LlamaDecoderLayer, which is not "
                                 "a module class of Net; its layer classes are Block (fix the list, or remove it to "
                                 "wrap those)")
    with (pytest.raises(ValueError, match=r"^transformer_cls_names_to_wrap on accelerate's FSDP plugin \(set in code"),
          present_classes_only(_plugin(transformer_cls_names_to_wrap=["Gone"]), net, "fsdp2.yaml", None)):
        pass


class OtherBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)


class OtherNet(nn.Module):
    _no_split_modules = ["OtherBlock"]  # noqa: RUF012 - as transformers declares it

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([OtherBlock(), OtherBlock()])


@pytest.mark.parametrize("version", [1, 2])
def test_each_model_gets_its_own_defaults_until_the_user_lists_classes(version: int) -> None:
    """What accelerate defaulted for one model is not the next model's list; a list set since,
    even one equal to it, is the user's and is checked as theirs."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from fsdp_offload_cfg.layer_classes import defaults_per_model, present_classes_only

    plugin = _plugin(fsdp_version=version)

    def set_policy(model: nn.Module) -> None:
        with defaults_per_model(plugin), present_classes_only(plugin, model, "a.yaml"):
            FullyShardedDataParallelPlugin.set_auto_wrap_policy(plugin, model)

    for model, expected in [(Net(), Block), (OtherNet(), OtherBlock), (Net(), Block)]:
        set_policy(model)
        assert plugin.transformer_cls_names_to_wrap == [expected.__name__]
        assert plugin.auto_wrap_policy.keywords["transformer_layer_cls"] == {expected}  # FSDP1 wraps with it
    plugin.transformer_cls_names_to_wrap = ["Block"]  # set in code: equal to the default, but theirs
    with pytest.raises(ValueError, match=r"\(set in code\) names Block, which is not a module class of OtherNet"):
        set_policy(OtherNet())
