"""A tiny Llama config directory with a byte-level BPE tokenizer, built offline in ~10 ms.

The scheduler tests need a real ModelConfig but never load weights, so the directory holds
only config.json and the tokenizer files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

WORDS = "prefill decode cache block token layer lease pull remote local request engine".split()


def build_tiny_llama(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rng = random.Random(1234)
    corpus = [" ".join(rng.choices(WORDS, k=rng.randint(5, 20))) for _ in range(200)]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": 2048,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    model_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "bos_token_id": bos,
        "eos_token_id": tokenizer.token_to_id("</s>"),
        "pad_token_id": tokenizer.token_to_id("<pad>"),
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(model_config))
    return directory
