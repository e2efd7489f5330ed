"""A small tokenizer built locally, so demos, the simulator and tests need no download.

`build_tokenizer(target)` trains a byte-level BPE tokenizer (vocabulary 8,192) on this Python installation's own
standard-library sources, wraps it as a Hugging Face fast tokenizer with a chat template that supports tools, and
saves it to `target` (tokenizer.json, tokenizer_config.json, chat template). The result is deterministic for a
given Python installation. `ensure_tokenizer()` builds it once into a cache directory and reuses it.
Completion prompts get a BOS token (like Llama tokenizers); chat prompts carry it through the template, so the
engine — which tokenizes a rendered chat without adding special tokens — sees exactly one.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|tool|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nYou can call these tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['content'] is string %}{% set text = m['content'] %}"
    "{% elif m['content'] %}{% set text = m['content'] | map(attribute='text') | select('string') | join('') %}"
    "{% else %}{% set text = '' %}{% endif %}"
    "{{ '<|' + m['role'] + '|>\n' + text }}"
    "{% if m.get('tool_calls') %}{{ m['tool_calls'] | tojson }}{% endif %}"
    "{{ '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_TRAINING_FILES = 240


def _training_text() -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())[:_TRAINING_FILES]
    for path in files:
        try:
            yield path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue


def build_tokenizer(target: str | Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train and save the tokenizer into `target` (created; replaced atomically if it exists); another
    `vocab_size` makes another tokenizer (other token ids for the same text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    target = Path(target)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    wrapped = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
    try:
        wrapped.save_pretrained(str(staging))
        # mkdtemp makes the folder private (0700), while the files inside are world-readable: open the folder
        # too, because the image builds it as root for its non-root user.
        staging.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def cache_root() -> Path:
    override = os.environ.get("KVROUTER_CACHE_DIR")
    if override:
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvrouter"


def ensure_tokenizer(target: str | Path | None = None) -> Path:
    """The tiny tokenizer's directory, building it on first use."""
    directory = Path(target) if target is not None else cache_root() / "tiny-tokenizer"
    if (directory / "tokenizer.json").is_file() and (directory / "tokenizer_config.json").is_file():
        return directory
    return build_tokenizer(directory)
