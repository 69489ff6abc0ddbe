"""Build a tiny random model and byte-level BPE tokenizer, offline and deterministically.

- ``llama`` (the default): small enough for vLLM on a 2-core CPU (411k parameters, 1.6 MB), yet
  its weights are scaled up (N(0, 0.2)) so that greedy outputs are varied rather than one
  repeated token.
- ``gemma3``: a hybrid model, 4 layers alternating sliding-window (64 tokens) and full
  attention, so vLLM's hybrid KV-cache manager runs two KV-cache groups. Weights N(0, 0.1);
  Gemma's norms scale by 1 + w, so norm weights are drawn near 0.
- ``llama-wide``: KV heavy enough for a transfer to show beside a prefill: 8 layers of 8 KV
  heads of 64, float32, so 32 KiB of KV per token (the llama holds 1 KiB), and positions up
  to 16384. Weights N(0, 0.05).
- ``deepseek-v2``: multi-head latent attention (MLA, as DeepSeek-V2/V3): 3 layers caching a
  512-wide latent plus a 64-wide rotary key per token (one KV "head" of 576), dense MLPs
  throughout (no experts), served by vLLM's CPU MLA backend.
- ``nemotron-h``, ``qwen3-next``, ``lfm2``: hybrid state models in bf16 (what vLLM's CPU state
  kernels run in), attention beside Mamba2 layers (an fp32 ssm state beside a bf16 conv
  state), Gated DeltaNet layers (key and value head dims of 64, experts on every layer, as
  vLLM's Qwen3-Next wants) and short convolutions (one attention head: vLLM 0.32's CPU rotary
  op mis-rotates LFM2's multi-head query and key).
Two builds with the same recipe are byte-identical, so token ids from one build are valid for
another (both architectures share the tokenizer).

Usage: ``python -m hixl_connector.tools.demo.tiny_model DIR [--architecture gemma3]``. Building is
idempotent: a directory that already holds a complete build of the same recipe is left alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

# Bump when anything below changes the produced files.
RECIPE_VERSION = 1
STAMP_NAME = "hixl_tiny_model.json"

WORDS = (
    "the a of and to in is it that for on with as was at by an be this from or "
    "prefill decode cache block token layer model request transfer memory engine "
    "remote local pull key value head batch fast slow"
).split()
_FIXED_LINES = (
    "0 1 2 3 4 5 6 7 8 9 10 11 12 32 64 128 256 512 1024",
    "one, two; three: four. five! six? (seven) [eight] {nine} - ten / eleven",
    "\"quoted\" 'single' a+b=c x*y 50% #tag @name $5 & more ~ ^ _ | \\ < >",
    "user: hello\nassistant: hi\nsystem: be brief",
)
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_SEED_CORPUS = 1234
_SEED_WEIGHTS = 0
_INIT_STD = 0.2
# llama-kv4: the llama with 4 KV heads instead of 2, an incompatible peer for the handshake.
ARCHITECTURES = (
    "llama",
    "gemma3",
    "llama-kv4",
    "llama-wide",
    "deepseek-v2",
    "nemotron-h",
    "qwen3-next",
    "lfm2",
)
# Nemotron-H's layers: Mamba2 state, attention, MLPs.
NEMOTRON_H_LAYERS = ("mamba", "attention", "mlp", "mamba", "mlp")
WIDE_LAYERS = 8
WIDE_MAX_POSITIONS = 16384
_WIDE_INIT_STD = 0.05
GEMMA3_SLIDING_WINDOW = 64
MLA_KV_LORA_RANK = 512  # the latent D reads per token and layer, beside the rotary key
MLA_ROPE_DIM = 64
_GEMMA3_INIT_STD = 0.1
_GEMMA3_NORM_STD = 0.02


def _corpus() -> list[str]:
    rng = random.Random(_SEED_CORPUS)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(5000)]
    return list(_FIXED_LINES) + lines


def _build_tokenizer(out_dir: Path) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    wrapped.chat_template = _CHAT_TEMPLATE
    wrapped.save_pretrained(str(out_dir))
    return wrapped


def _shared_config(tokenizer: Any) -> dict[str, Any]:
    """What both tiny architectures have in common: the tokenizer's ids and the sizes."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def _save_random(
    model_class: Any, config: Any, out_dir: Path, std: float, std_1d: float, bf16: bool = False
) -> None:
    """Draws every matrix from N(0, std), and every vector from N(0, std_1d) unless 0; with
    ``bf16``, saved in bfloat16 (what vLLM's CPU state kernels run in)."""
    import torch

    torch.manual_seed(_SEED_WEIGHTS)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std)
            elif std_1d:
                param.normal_(0.0, std_1d)
    if bf16:
        model = model.to(torch.bfloat16)
        model.config.torch_dtype = model.config.dtype = "bfloat16"
    model.save_pretrained(str(out_dir), safe_serialization=True)


def _build_gemma3(out_dir: Path, tokenizer: Any) -> None:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **_shared_config(tokenizer),
        num_hidden_layers=4,
        head_dim=32,
        query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=GEMMA3_SLIDING_WINDOW,
    )
    _save_random(Gemma3ForCausalLM, config, out_dir, _GEMMA3_INIT_STD, _GEMMA3_NORM_STD)


def _build_deepseek_v2(out_dir: Path, tokenizer: Any) -> None:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    layers = 3
    config = DeepseekV2Config(
        **{**_shared_config(tokenizer), "num_key_value_heads": 4},
        num_hidden_layers=layers,
        kv_lora_rank=MLA_KV_LORA_RANK,
        q_lora_rank=None,
        qk_rope_head_dim=MLA_ROPE_DIM,
        qk_nope_head_dim=32,
        v_head_dim=32,
        first_k_dense_replace=layers,  # every MLP dense: no experts to route
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    )
    _save_random(DeepseekV2ForCausalLM, config, out_dir, _INIT_STD, 0.0)


def _build_nemotron_h(out_dir: Path, tokenizer: Any) -> None:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        **{**_shared_config(tokenizer), "torch_dtype": "bfloat16"},
        layers_block_type=list(NEMOTRON_H_LAYERS),
        head_dim=32,
        mamba_num_heads=8,
        mamba_head_dim=32,
        ssm_state_size=64,
        n_groups=2,
        conv_kernel=4,
        chunk_size=128,
        mlp_hidden_act="relu2",
    )
    _save_random(NemotronHForCausalLM, config, out_dir, _INIT_STD, 0.0, bf16=True)


def _build_qwen3_next(out_dir: Path, tokenizer: Any) -> None:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **{**_shared_config(tokenizer), "torch_dtype": "bfloat16"},
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        head_dim=64,
        # vLLM's CPU Gated DeltaNet kernel takes key and value head dims of 64 or 128.
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_conv_kernel_dim=4,
        # Experts on every layer: vLLM's Qwen3-Next wants one MoE layer at least.
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    )
    _save_random(Qwen3NextForCausalLM, config, out_dir, _INIT_STD, 0.0, bf16=True)


def _build_lfm2(out_dir: Path, tokenizer: Any) -> None:
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(
        # One query and one KV head: vLLM 0.32's CPU rotary op mis-rotates the 3-D query and
        # key vLLM's LFM2 attention hands it when heads > 1 (outputs then depend on how the
        # prefill is chunked); with one head both forms agree.
        **{
            **_shared_config(tokenizer),
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": True,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
        },
        num_hidden_layers=4,
        layer_types=["conv", "full_attention"] * 2,
        conv_L_cache=3,
        conv_bias=False,
        block_auto_adjust_ff_dim=False,
        block_multiple_of=64,
        block_ffn_dim_multiplier=1.0,
        norm_eps=1e-5,
    )
    # vLLM reads these two (released LFM2 configs carry them); transformers does not.
    config.conv_dim = config.block_dim = config.hidden_size
    _save_random(Lfm2ForCausalLM, config, out_dir, _INIT_STD, 0.0, bf16=True)


def _build_model(out_dir: Path, tokenizer: Any, kv_heads: int = 2) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{**_shared_config(tokenizer), "num_key_value_heads": kv_heads}, num_hidden_layers=2
    )
    _save_random(LlamaForCausalLM, config, out_dir, _INIT_STD, 0.0)


def _build_wide(out_dir: Path, tokenizer: Any) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=WIDE_MAX_POSITIONS,
    )
    config = LlamaConfig(**{**_shared_config(tokenizer), **sizes}, num_hidden_layers=WIDE_LAYERS)
    _save_random(LlamaForCausalLM, config, out_dir, _WIDE_INIT_STD, 0.0)


def _recipe(architecture: str) -> dict[str, object]:
    # The llama stamp keeps its original form, so existing builds stay valid.
    if architecture == "llama":
        return {"recipe": RECIPE_VERSION}
    return {"recipe": RECIPE_VERSION, "architecture": architecture}


def is_built(model_dir: Path, architecture: str = "llama") -> bool:
    """True when ``model_dir`` holds a complete build of the current recipe version."""
    stamp = model_dir / STAMP_NAME
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    files = recorded.pop("files", [])
    return recorded == _recipe(architecture) and all((model_dir / f).is_file() for f in files)


def build_tiny_model(model_dir: str | os.PathLike[str], architecture: str = "llama") -> Path:
    """Build the model into ``model_dir`` unless an identical-recipe build is already there.

    The build goes into a sibling temporary directory that is renamed into place, so readers
    never see a half-written model and a crashed build leaves nothing behind.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    target = Path(model_dir).resolve()
    if is_built(target, architecture):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)
    try:
        tokenizer = _build_tokenizer(staging)
        if architecture == "gemma3":
            _build_gemma3(staging, tokenizer)
        elif architecture == "deepseek-v2":
            _build_deepseek_v2(staging, tokenizer)
        elif architecture == "llama-wide":
            _build_wide(staging, tokenizer)
        elif architecture == "nemotron-h":
            _build_nemotron_h(staging, tokenizer)
        elif architecture == "qwen3-next":
            _build_qwen3_next(staging, tokenizer)
        elif architecture == "lfm2":
            _build_lfm2(staging, tokenizer)
        else:
            _build_model(staging, tokenizer, kv_heads=4 if architecture == "llama-kv4" else 2)
        files = sorted(p.name for p in staging.iterdir() if p.is_file())
        stamp = {**_recipe(architecture), "files": files}
        (staging / STAMP_NAME).write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
        if target.exists():
            if is_built(target, architecture):  # another process finished first
                return target
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="directory to build the model into")
    parser.add_argument("--architecture", choices=ARCHITECTURES, default="llama")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.model_dir, args.architecture))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
