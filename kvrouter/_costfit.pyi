from collections.abc import Sequence
from typing import Literal, Protocol

class _Observation(Protocol):
    @property
    def work_tokens(self) -> float: ...
    @property
    def short(self) -> float: ...
    @property
    def passes(self) -> float: ...
    @property
    def decoding(self) -> float: ...
    @property
    def ttft_s(self) -> float: ...

def fit(
    observations: Sequence[_Observation],
    pass_s: float,
    decode_s_per_request: float,
    prefill_tokens_per_s: float,
    prior_samples: float,
    iterations: int,
    /,
) -> tuple[float, float, float] | Literal[False] | None: ...
