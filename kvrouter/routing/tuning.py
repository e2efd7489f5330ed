"""Online tuning of kv_aware's cache-vs-load weight against measured time to first token.

`WeightTuner` runs a bounded experiment on a small share of traffic: of every `period` routing decisions, one
uses the current weight x (1 + `step`) and one x (1 - `step`); the rest use the current weight. Each request's
measured TTFT is reported back (`observe`) with the weight its decision used, normalised by the request's
prompt length (seconds per 1k prompt tokens, so a long prompt in one arm does not decide the experiment). After
`window` observations in each probe arm the tuner compares the arms' means with the current weight's and moves
toward a probe that beat it by more than `threshold` (relative), within [`low`, `high`]; then a new window
starts. Pure: the arm is a function of the decision counter, no random source, no clock.

Knobs: `period` [20] (2 probes in 20 = 10% of traffic), `step` [0.25], `window` [150], `threshold` [0.05],
`low` [1.0], `high` [8.0].
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TunerConfig:
    period: int = 20
    step: float = 0.25
    window: int = 150
    threshold: float = 0.05
    low: float = 1.0
    high: float = 8.0

    def __post_init__(self) -> None:
        if self.period < 3 or not 0 < self.step < 1 or self.window < 1 or self.threshold < 0:
            raise ValueError("period >= 3, 0 < step < 1, window >= 1, threshold >= 0")
        if not 0 <= self.low <= self.high:
            raise ValueError("0 <= low <= high")


@dataclass(slots=True)
class _Arm:
    count: int = 0
    total: float = 0.0

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass(slots=True)
class WeightTuner:
    weight: float
    config: TunerConfig = field(default_factory=TunerConfig)
    moves: list[float] = field(default_factory=list)
    """The weight after each move (a trace of the tuning)."""
    _arms: dict[str, _Arm] = field(default_factory=lambda: {"base": _Arm(), "up": _Arm(), "down": _Arm()})

    def __post_init__(self) -> None:
        self.weight = min(self.config.high, max(self.config.low, self.weight))

    def weight_for(self, turn: int) -> float:
        """The weight decision number `turn` uses."""
        slot = turn % self.config.period
        if slot == 0:
            return min(self.config.high, self.weight * (1 + self.config.step))
        if slot == self.config.period // 2:
            return max(self.config.low, self.weight * (1 - self.config.step))
        return self.weight

    def observe(self, used_weight: float, ttft_s: float, prompt_tokens: int) -> None:
        """A request routed with `used_weight` got its first token after `ttft_s`."""
        arms = {self.weight_for(0): "up", self.weight_for(self.config.period // 2): "down", self.weight: "base"}
        arm = arms.get(used_weight)
        if arm is None:
            return  # routed before the last move: it belongs to no arm of this window
        cost = ttft_s / max(1.0, prompt_tokens / 1000.0)
        record = self._arms[arm]
        record.count += 1
        record.total += cost
        up, down, base = self._arms["up"], self._arms["down"], self._arms["base"]
        if min(up.count, down.count) < self.config.window or base.count == 0:
            return
        best = min(("up", up.mean), ("down", down.mean), key=lambda item: item[1])
        if best[1] < base.mean * (1 - self.config.threshold):
            factor = 1 + self.config.step if best[0] == "up" else 1 - self.config.step
            self.weight = min(self.config.high, max(self.config.low, self.weight * factor))
            self.moves.append(self.weight)
        self._arms = {"base": _Arm(), "up": _Arm(), "down": _Arm()}
