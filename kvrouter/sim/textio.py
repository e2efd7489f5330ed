"""Text in and out of a simulated replica: prompts to token ids the way vLLM makes them, and generated text.

Prompts: a completion string is tokenized with special tokens added (vLLM's default for /v1/completions); a chat
is rendered with the tokenizer's own chat template (`add_generation_prompt=True`, tools passed through) and the
rendered text tokenized without adding special tokens (vLLM's default for /v1/chat/completions). Tokenization
runs in a thread pool, off the event loop.

Outputs: the simulator does not run a model; each request "generates" tokens drawn from a fixed table of plain
word tokens of the vocabulary, with a random source seeded per request, so output text decodes cleanly and blocks
filled during decode carry real token ids.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any


class SimTokenizer:
    def __init__(self, directory: str | Path, executor: Executor | None = None, vocabulary_size: int = 512) -> None:
        from transformers import AutoTokenizer

        self.directory = str(directory)
        self._tokenizer: Any = AutoTokenizer.from_pretrained(self.directory)
        self._executor = executor
        self._words = self._word_tokens(vocabulary_size)
        self.word_ids = [token_id for token_id, _ in self._words]
        self._text = dict(self._words)

    def _word_tokens(self, limit: int) -> list[tuple[int, str]]:
        special = set(self._tokenizer.all_special_ids)
        words: list[tuple[int, str]] = []
        for token_id in range(len(self._tokenizer)):
            if token_id in special:
                continue
            text = self._tokenizer.decode([token_id])
            if len(text) >= 3 and text[0] == " " and text[1:].isalpha() and text.isascii():
                words.append((token_id, text))
                if len(words) >= limit:
                    break
        if not words:
            raise ValueError(f"{self.directory}: no plain word tokens found to generate from")
        return words

    # -- prompts -------------------------------------------------------------------------------------------

    def encode_completion(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> list[int]:
        rendered = self._tokenizer.apply_chat_template(
            list(messages), tools=tools, add_generation_prompt=True, tokenize=False
        )
        return list(self._tokenizer(rendered, add_special_tokens=False)["input_ids"])

    async def completion_ids(self, text: str) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.encode_completion, text)

    async def chat_ids(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.encode_chat, messages, tools)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [str(s) for s in self._tokenizer.convert_ids_to_tokens(list(token_ids))]

    # -- outputs -------------------------------------------------------------------------------------------

    def sample_outputs(self, seed: str, count: int) -> list[int]:
        return random.Random(seed).choices(self.word_ids, k=count)

    def text_of(self, token_id: int) -> str:
        return self._text.get(token_id, "")
