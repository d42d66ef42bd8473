"""Tiny Hugging Face models built from configs and saved locally (nothing is downloaded).

Each builder returns the directory it saved to. Sizes are kept to a few hundred KB so that a
multi-rank test can load every one of them in a couple of seconds. Other test modules may
import this file; keep the builders deterministic (fixed seeds) and side-effect free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import (
    CLIPVisionConfig,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)

_SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=97)


def _save(model: PreTrainedModel, path: str, dtype: torch.dtype | None = None) -> str:
    if dtype is not None:
        model = model.to(dtype)
        model.config.dtype = dtype
    model.save_pretrained(path)
    return path


def save_each(root: Any, names: list[str], build: Callable[[str], PreTrainedModel]) -> dict[str, str]:
    """`build(name).save_pretrained(root / name)` for each name; name -> its directory."""
    paths = {}
    for name in names:
        paths[name] = os.path.join(str(root), name)
        build(name).save_pretrained(paths[name])
    return paths


def llama_config(**overrides) -> LlamaConfig:
    """Untied Llama with an odd vocab (97 rows: uneven FSDP shards, one rank gets fewer rows)."""
    kwargs = dict(_SMALL, num_hidden_layers=2, max_position_embeddings=64, tie_word_embeddings=False)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def save_llama(path: str, dtype: torch.dtype | None = None, **overrides) -> str:
    torch.manual_seed(0)
    return _save(LlamaForCausalLM(llama_config(**overrides)), path, dtype)


WORD_VOCAB = 97  # the word tokenizer's size: ids "t3".."t96", after <pad>=0, <eos>=1, <unk>=2


def save_word_tokenizer(path: str) -> None:
    """A word-level tokenizer over "t0".."t96" (token ids = a `WORD_VOCAB`-sized model's), built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, WORD_VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>").save_pretrained(path)


def words(rng: Any, n: int) -> str:
    """`n` random words of the word tokenizer, drawn by a numpy `Generator`."""
    return " ".join(f"t{int(i)}" for i in rng.integers(3, WORD_VOCAB, n))


def save_qwen2_reward(path: str) -> str:
    """A Qwen2 reward model (one score, pad id 0): another architecture than the Llama policy, as
    GRPO users pair them."""
    torch.manual_seed(3)
    config = Qwen2Config(**_SMALL, num_hidden_layers=2, max_position_embeddings=64, num_labels=1, pad_token_id=0)
    return _save(Qwen2ForSequenceClassification(config), path)


def save_qwen2_tied(path: str) -> str:
    """Qwen2 with `tie_word_embeddings`: lm_head.weight is embed_tokens.weight."""
    torch.manual_seed(1)
    config = Qwen2Config(**_SMALL, num_hidden_layers=2, max_position_embeddings=64, tie_word_embeddings=True)
    return _save(Qwen2ForCausalLM(config), path)


def save_deepseek_v3(path: str, dtype: torch.dtype | None = torch.bfloat16) -> str:
    """Tiny DeepseekV3: MoE router with a persistent `e_score_correction_bias` holding stored
    non-zero values (`_init_weights` would zero it), yarn rope scaling, and the router bias in
    `_keep_in_fp32_modules_strict` (it stays fp32 when the rest is saved/loaded in bf16)."""
    torch.manual_seed(2)
    config = DeepseekV3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=256,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        tie_word_embeddings=False,
    )
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.linspace(0.1, 0.9, buf.numel()))
    return _save(model, path, dtype)


def save_llava(path: str) -> str:
    """Tiny Llava: CLIP vision tower + projector + Llama text model."""
    torch.manual_seed(3)
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=8
    )
    text = llama_config()
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=96)
    return _save(LlavaForConditionalGeneration(config), path)


def save_llava_anyres(path: str, family: str = "llava_next") -> str:
    """Tiny LLaVA-NeXT or LLaVA-OneVision ('anyres': an image tiled over `image_grid_pinpoints`
    by its size), with the vision tower each ships with (CLIP; SigLIP, whose features have no CLS
    to drop), 4x4 patches a 16-pixel tile, three pinpoints."""
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
    )

    torch.manual_seed(3)
    tower = {"llava_next": "clip_vision_model", "llava_onevision": "siglip_vision_model"}[family]
    vision = {"model_type": tower, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 16, "patch_size": 4}
    config_cls, model_cls = {"llava_next": (LlavaNextConfig, LlavaNextForConditionalGeneration),
                             "llava_onevision": (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration)}[family]
    config = config_cls(vision_config=vision,
                        text_config=llama_config(), image_token_index=96,
                        image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]])
    return _save(model_cls(config), path)


def save_qwen2_vl(path: str) -> str:
    """Tiny Qwen2-VL: patches flattened with an `image_grid_thw` (4x4 patches of 4 pixels, merged
    2x2: 4 image tokens, id 120), M-RoPE text model."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(5)
    vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, in_channels=3, mlp_ratio=2)  # fmt: skip
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64,
                rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})  # fmt: skip
    config = Qwen2VLConfig(vision_config=vision, text_config=text, image_token_id=120, video_token_id=121,
                           vision_start_token_id=122, vision_end_token_id=123)  # fmt: skip
    return _save(Qwen2VLForConditionalGeneration(config), path)


class TinyBufferConfig(PretrainedConfig):
    model_type = "tiny_buffer_test"

    def __init__(self, hidden_size: int = 24, vocab_size: int = 31, **kwargs):
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        super().__init__(**kwargs)


class TinyBufferModel(PreTrainedModel):
    """A model whose buffers are int64 and bool, persistent and not, with stored values that no
    `_init_weights` could recompute; `norm` is kept in fp32 (`_keep_in_fp32_modules_strict`)."""

    config_class = TinyBufferConfig
    base_model_prefix = "tiny"
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["norm"]

    def __init__(self, config: TinyBufferConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size)
        self.register_buffer("token_map", torch.arange(config.vocab_size, dtype=torch.int64))
        self.register_buffer("mask", torch.ones(config.vocab_size, dtype=torch.bool))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("scale", torch.full((config.hidden_size,), 0.5), persistent=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if module is self:
            # Not what was saved: a loader that re-initialises instead of loading is caught.
            nn.init.zeros_(self.token_map)
            nn.init.zeros_(self.mask)
            # transformers 5 leaves non-persistent buffers as uninitialised memory on load unless
            # `_init_weights` sets them (it recomputes RoPE's inv_freq the same way).
            nn.init.constant_(self.step, 7)
            nn.init.constant_(self.scale, 0.5)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> None:
        return None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = self.token_map[input_ids]
        h = self.embed(ids) * self.mask[input_ids].unsqueeze(-1) * self.scale
        return self.norm(self.proj(h))


def save_tiny_buffers(path: str) -> str:
    torch.manual_seed(4)
    model = TinyBufferModel(TinyBufferConfig())
    with torch.no_grad():
        model.token_map.copy_(torch.randperm(model.config.vocab_size))
        model.mask.copy_(torch.arange(model.config.vocab_size) % 3 != 0)
    return _save(model, path)


# Llama shapes of the loading benchmarks at the sizes users load (`write_llama_checkpoint`).
LLAMA_SHAPES = {
    "300m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
                 num_attention_heads=16, num_key_value_heads=16),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                 num_attention_heads=12, num_key_value_heads=4),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),  # Llama-3-8B
}  # fmt: skip


def save_llama_300m(path: str, dtype: torch.dtype = torch.float32) -> str:
    """~320M-parameter Llama for the loading benchmark (1.2 GiB of fp32 safetensors)."""
    config = LlamaConfig(**LLAMA_SHAPES["300m"], max_position_embeddings=2048, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
        model.model.rotary_emb.__init__(config)  # recompute inv_freq after to_empty
    return _save(model, path, dtype)


# a Qwen3-MoE of about 290M parameters, 85% of them in 32 experts per layer (Qwen3-30B-A3B's
# proportions at a size the loading benchmark runs on 2 cores)
QWEN3_MOE_300M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                      num_attention_heads=12, num_key_value_heads=4, head_dim=64, num_experts=32,
                      num_experts_per_tok=8, moe_intermediate_size=384, decoder_sparse_step=1)  # fmt: skip


def save_qwen3_moe_300m(path: str, dtype: torch.dtype = torch.float32) -> str:
    """The Qwen3-MoE of `QWEN3_MOE_300M` (1.1 GiB in fp32), saved as transformers saves it: one
    tensor per expert (`mlp.experts.7.gate_proj.weight`), the hub's layout, which transformers 5
    stacks into one tensor per layer on load."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**QWEN3_MOE_300M, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(5)
    return _save(Qwen3MoeForCausalLM(config), path, dtype)


def in_qwen3_vl_moe_hub_layout(path: str, hidden_size: int) -> str:
    """Rewrite a saved Qwen3-VL-MoE's experts as the hub's files hold them, `gate_up_proj` `[E,
    hidden, 2 * intermediate]` and `down_proj` `[E, intermediate, hidden]`, where this transformers
    saved them in its own layout (5.x: dims 1 and 2 swapped, which it swaps back on load)."""
    from safetensors.torch import load_file, save_file

    def hub(key: str, t: torch.Tensor) -> torch.Tensor:
        turned = ((key.endswith("mlp.experts.gate_up_proj") and t.shape[1] != hidden_size)
                  or (key.endswith("mlp.experts.down_proj") and t.shape[2] != hidden_size))
        return t.transpose(1, 2).contiguous() if turned else t

    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            file = os.path.join(path, name)
            save_file({k: hub(k, t) for k, t in load_file(file).items()}, file, metadata={"format": "pt"})
    return path


def save_qwen3_vl_moe_300m(path: str, dtype: torch.dtype = torch.float32) -> str:
    """A Qwen3-VL-MoE whose language model is `QWEN3_MOE_300M`'s with narrower experts (plus a small
    vision tower), with its experts in the hub's layout (`in_qwen3_vl_moe_hub_layout`)."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    # 2 x 320 against 768 hidden: gate_up_proj not square, so its transpose shows in the shapes
    # (on a square one transformers' `check_dims` cannot tell the layouts apart, and reads as stored)
    text = dict(QWEN3_MOE_300M, moe_intermediate_size=320, max_position_embeddings=2048,
                rope_scaling={"rope_type": "default", "mrope_section": [8, 12, 12]})
    vision = dict(depth=2, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=768, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[1])
    torch.manual_seed(5)
    model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(text_config=text, vision_config=vision,
                                                                tie_word_embeddings=False))
    _save(model, path, dtype)
    return in_qwen3_vl_moe_hub_layout(path, QWEN3_MOE_300M["hidden_size"])


HF_MAX_FILE_BYTES = 5 * 10**9  # `save_pretrained`'s default `max_shard_size` ("5GB")


def write_llama_checkpoint(path: str, shape: str, dtype: torch.dtype = torch.bfloat16,
                           max_file_bytes: int = HF_MAX_FILE_BYTES, min_files: int = 1, seed: int = 0) -> str:  # fmt: skip
    """A Llama checkpoint of `LLAMA_SHAPES[shape]` in `save_pretrained`'s multi-file layout
    (`model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`), every weight drawn
    uniformly in [-0.03, 0.03) from a seed per tensor.

    Why not `save_pretrained`: an 8B model would be built whole in host memory first (16 GB in
    bf16, 32 GB to initialise in float32); here only one file's tensors (at most
    `max_file_bytes`) exist at a time, so the checkpoint can be written on the machine that then
    measures loading it, beside nothing else of its size. `min_files` splits a checkpoint too small
    to fill that many files of `max_file_bytes` into that many or more, as a large one is split."""
    from safetensors.torch import save_file

    config = LlamaConfig(**LLAMA_SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False)
    config.dtype = dtype
    config.architectures = ["LlamaForCausalLM"]  # as a model's save_pretrained writes it: scripts read the class there
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in LlamaForCausalLM(config).state_dict().items()}
    order = {name: i for i, name in enumerate(shapes)}
    total = sum(s.numel() * dtype.itemsize for s in shapes.values())
    if -(-total // max_file_bytes) < min_files:  # too small to make `min_files` files of the size limit
        max_file_bytes = -(-total // min_files)
    files: list[list[str]] = [[]]  # names per file, in the model's order, as `save_pretrained` groups them
    size = 0
    for name, tensor_shape in shapes.items():
        nbytes = tensor_shape.numel() * dtype.itemsize
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)

    def draw(name: str) -> torch.Tensor:  # one thread each (torch lets go of the GIL): 8B in seconds, not a minute
        gen = torch.Generator().manual_seed(seed + order[name])
        return torch.empty(shapes[name], dtype=dtype).uniform_(-0.03, 0.03, generator=gen)

    weight_map = {}
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        for k, file_names in enumerate(files, start=1):
            file = f"model-{k:05d}-of-{len(files):05d}.safetensors"
            save_file(dict(zip(file_names, pool.map(draw, file_names))), os.path.join(path, file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(file_names, file))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return path


BUILDERS = {
    "llama": save_llama,
    "qwen2_tied": save_qwen2_tied,
    "deepseek_v3": save_deepseek_v3,
    "llava": save_llava,
    "tiny_buffers": save_tiny_buffers,
    "llama_bf16": lambda p: save_llama(p, dtype=torch.bfloat16),
}


def build_all(root: str, names: list[str] | None = None) -> dict[str, str]:
    """Save every tiny model under `root/<name>`; returns {name: path}."""
    return {n: BUILDERS[n](os.path.join(root, n)) for n in (names or list(BUILDERS))}


# ---- checkpoint layouts for load_strategy "sharded" (each rank reads its own slices) ----


def save_glm4_moe(path: str, dtype: torch.dtype | None = torch.bfloat16) -> str:
    """Tiny GLM-4.5 MoE (one dense layer, one MoE layer), saved in bf16: transformers 5.24 keeps
    its router gate (`mlp.gate.weight`) and `e_score_correction_bias` in float32."""
    torch.manual_seed(6)
    config = Glm4MoeConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = Glm4MoeForCausalLM(config)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.linspace(-0.3, 0.3, buf.numel()))
    return _save(model, path, dtype)


def _resave_in_model_layout(path: str, cls: type[PreTrainedModel]) -> str:
    """Rewrite the checkpoint at `path` in the model's own key layout (experts fused into
    `gate_up_proj`/`down_proj`): transformers loads it without a WeightConverter, so a per-rank
    slice reader can read it. (`save_pretrained` writes per-expert keys, which are fused on load.)"""
    from safetensors.torch import save_file

    model = cls.from_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    return path


def save_deepseek_v3_fused(path: str) -> str:
    """The tiny DeepseekV3 of `save_deepseek_v3` in the model's own key layout."""
    return _resave_in_model_layout(save_deepseek_v3(path), DeepseekV3ForCausalLM)


def save_glm4_moe_fused(path: str) -> str:
    """The tiny GLM-4.5 MoE of `save_glm4_moe` in the model's own key layout."""
    return _resave_in_model_layout(save_glm4_moe(path), Glm4MoeForCausalLM)


def save_llama_multi_file(path: str) -> str:
    """The tiny Llama of `save_llama`, split over several safetensors files with an index."""
    torch.manual_seed(0)
    LlamaForCausalLM(llama_config()).save_pretrained(path, max_shard_size="40KB")
    return path


def save_llama_bin(path: str) -> str:
    """The tiny Llama as a legacy `pytorch_model.bin` (transformers 5 no longer writes one)."""
    from safetensors.torch import load_file

    save_llama(path)
    weights = os.path.join(path, "model.safetensors")
    torch.save(load_file(weights), os.path.join(path, "pytorch_model.bin"))
    os.remove(weights)
    return path


SHARDED_BUILDERS = {
    "deepseek_v3_fused": save_deepseek_v3_fused,
    "llama_multi_file": save_llama_multi_file,
    "llama_bin": save_llama_bin,
}


def shard_by_layer(model: nn.Module) -> nn.Module:
    """`fully_shard` each decoder layer (`model.model.layers`), then the root, as accelerate's
    `transformer_based_wrap` does for a causal LM; returns the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)
