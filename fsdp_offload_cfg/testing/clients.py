"""The tiny model the framework CLIs train in the client tests (LlamaFactory, ms-swift, axolotl):
a 2-layer Llama and a character-level tokenizer, saved locally. Imports nothing at module level
(the client legs pin older transformers and their own stacks)."""

from __future__ import annotations

import string
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0-3: pad, bos, eos, unk


def save_char_llama(path: str | Path, seed: int = 0, *, per_character: bool = True) -> Path:
    """A tiny Llama (hidden size 32, 2 layers, untied) and a tokenizer with one token per printable
    character, in `path`; returns `path`. Every prompt and answer of a test tokenizes to real
    tokens, never to `<unk>`.

    `per_character=False` leaves the tokenizer without its pre-tokenizer, so a whole text is one
    `<unk>`: for axolotl's test, whose alpaca template alone is about 150 characters while its
    `sequence_len` is 64, and axolotl drops every sample longer than that."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    characters = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    vocab = {token: i for i, token in enumerate(SPECIALS + characters)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    if per_character:
        tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        tokenizer.decoder = decoders.Fuse()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)
    return path


def assert_the_estimate_holds_the_preference_run(real: dict, estimated: dict, forward_batch: int) -> None:
    """A preference run (DPO: a reference model, each sample's chosen and rejected completions in
    one forward) as the Trainer probe read rank 0 after its training (`real`), against the
    estimate's JSON of the same file (`estimated`): the forward's batch, the reference model's
    bytes and the model's; and the reference holds nothing whole after its forwards."""
    assert real["forward_batch"] == estimated["inputs"]["batch_size"] == forward_batch, (real, estimated["inputs"])
    assert real["reference_gathered"] == [], real
    assert real["reference_param_bytes"] == estimated["per_rank"]["reference_params_bytes"] > 0, \
        (real, estimated["per_rank"])
    assert real["param_bytes"] == estimated["per_rank"]["params_bytes"], (real, estimated["per_rank"])
