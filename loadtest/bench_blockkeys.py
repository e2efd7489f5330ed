"""Chained block keys: C extension vs block-by-block hashing through the xxhash package, in one run.

Prints the median time per 1,000 tokens of `chain_keys` (kvrouter/_blockkeys.c) and of `python_chain_keys` for
block sizes 16 (vLLM's default: 72-byte inputs, XXH3's 17-128-byte path), 64 and 256 (264 and 1,032 bytes: the
long-input path where the official implementation's vector code runs), and the ratio. `--extension PATH` loads
another build of the extension (e.g. an older commit's .so) in place of the installed one, to compare builds
run after run: `python loadtest/bench_blockkeys.py --extension /tmp/old/_blockkeys.cpython-311-x86_64-linux-gnu.so`.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvrouter.blocks import python_chain_keys


def load_extension(path: Path | None) -> Callable[..., list[int]]:
    if path is None:
        from kvrouter._blockkeys import chain_keys

        return chain_keys
    spec = importlib.util.spec_from_file_location("kvrouter._blockkeys", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    chain: Callable[..., list[int]] = module.chain_keys
    return chain


def median_us_per_1k(run: Callable[[], object], tokens: int, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        samples.append((time.perf_counter() - started) * 1e6 * 1000 / tokens)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extension", type=Path, default=None, help="a build of kvrouter._blockkeys to load")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per call (default 16,384)")
    parser.add_argument("--repeat", type=int, default=201, help="timed calls per figure (default 201)")
    args = parser.parse_args(argv)
    native = load_extension(args.extension)
    rng = random.Random(0)
    tokens = [rng.randrange(200_000) for _ in range(args.tokens)]
    print(f"extension: {args.extension or 'installed'}; {args.tokens} tokens per call; median of {args.repeat}")
    print(f"{'block size':>10} {'C us/1k tok':>12} {'python us/1k tok':>17} {'python/C':>9}")
    for block_size in (16, 64, 256):
        assert native(tokens, block_size, 0, b"") == python_chain_keys(tokens, block_size, 0, b"")
        c = median_us_per_1k(lambda size=block_size: native(tokens, size, 0, b""), args.tokens, args.repeat)
        py = median_us_per_1k(
            lambda size=block_size: python_chain_keys(tokens, size, 0, b""), args.tokens, args.repeat // 4
        )
        print(f"{block_size:>10} {c:>12.2f} {py:>17.2f} {py / c:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
