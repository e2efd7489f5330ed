"""A tiny LoRA adapter for the tiny test model, written locally (no download): PEFT's file layout
(adapter_config.json, adapter_model.safetensors) with small random rank-8 weights on every layer's q_proj and
v_proj, which vLLM loads with `--enable-lora --lora-modules NAME=DIR`. The shapes follow build_tiny_model.py
(hidden 256, 4 layers, 4 key-value heads of 64)."""

from __future__ import annotations

import json
from pathlib import Path

RANK = 8
HIDDEN = 256
LAYERS = 4


def write_tiny_adapter(target: Path, base_model: Path, seed: int = 0) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    target.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(LAYERS):
        for projection in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{projection}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((RANK, HIDDEN)) * 0.01).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((HIDDEN, RANK)) * 0.01).astype(np.float32)
    save_file(tensors, str(target / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": str(base_model),
    }
    (target / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return target
