"""A random DeepSeek-V3-shaped Hugging Face directory for the generation benchmark (no hub access).

77M parameters: 6 layers of multi-head latent attention (16 heads, query bottleneck 192, latent 128,
32 rotary + 64 other channels per head, values of 64), a dense first layer then MoE layers of 8
experts (top-2), SmolLM2's 49,152-token vocabulary; transformers initialises the weights, and the
packaged SmolLM2-135M-Instruct lends its tokenizer and chat template, so ``bench_generate.py`` builds
its prompts as for any model. Both sides then decode the same weights: plait with its latent cache,
transformers with its expanded key/value cache.

Run (from the repository root, venv active)::

    python bench/deepseek_v3_dir.py /tmp/deepseek-v3-bench
    python bench/bench_generate.py --model /tmp/deepseek-v3-bench --dtypes fp32
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

#: the files of the packaged model's directory that describe its tokenizer and chat template
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="directory to create (must not exist)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out} exists; give a new directory")
    import transformers

    from plait.models.packaged import packaged_model_dir

    source = packaged_model_dir("smollm2-135m-instruct")
    config = transformers.DeepseekV3Config(
        vocab_size=49152, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=192, kv_lora_rank=128, qk_rope_head_dim=32,
        qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=2048, tie_word_embeddings=False, rope_interleave=False,
        num_nextn_predict_layers=0)
    torch.manual_seed(args.seed)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, args.out / name)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
