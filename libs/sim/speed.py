"""How fast an emulated device serves a model: a roofline per device.

Decoding one step reads every weight once (memory bound) or does 2 × params FLOPs per request
in the batch (compute bound), whichever is slower; prefill is compute bound. Efficiency
factors are the share of peak a real runtime reaches. The clock share (DVFS hint, or 0.5
while throttled by heat) scales both.
"""

from __future__ import annotations

from dataclasses import dataclass

from libs.contracts import Capabilities
from libs.core.catalogue import ModelSpec

BANDWIDTH_EFFICIENCY = 0.6
COMPUTE_EFFICIENCY = 0.35


@dataclass(frozen=True, slots=True)
class SpeedModel:
    model: ModelSpec

    def step_s(self, caps: Capabilities, batch: int, clock: float) -> float:
        memory = self.model.weights_gb / (caps.memory_bandwidth_gbps * BANDWIDTH_EFFICIENCY)
        compute = batch * 2.0 * self.model.params / (caps.fp32_tflops * 1e12 * COMPUTE_EFFICIENCY)
        return max(memory, compute) / clock

    def prefill_s(self, caps: Capabilities, prompt_tokens: int, clock: float) -> float:
        flops = prompt_tokens * 2.0 * self.model.params
        return flops / (caps.fp32_tflops * 1e12 * COMPUTE_EFFICIENCY) / clock

    def service_s(
        self, caps: Capabilities, prompt: int, output: int, batch: int, clock: float
    ) -> tuple[float, float]:
        """(time to first token, total time) for one request joining a batch of ``batch``."""
        first = self.prefill_s(caps, prompt, clock) + self.step_s(caps, batch, clock)
        return first, first + (output - 1) * self.step_s(caps, batch, clock)

    def memory_gb(self, prompt: int, output: int) -> float:
        """Weights + runtime + KV cache for one request's context."""
        return self.model.shard_gb(self.model.layers, True, True, prompt + output)

    def kv_gb(self, prompt: int, output: int) -> float:
        return self.model.layers * self.model.kv_bytes_per_token_layer * (prompt + output) / 1e9
