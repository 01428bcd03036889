"""Models the scheduler knows how to split: layer counts and the memory each part needs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder-only transformer, as far as placement cares.

    Memory of a shard = its layers × (weights + KV cache for the context) + the embeddings on
    the first shard + the LM head on the last + a fixed runtime overhead per process.
    ``gflop_per_layer_token`` is the forward cost of one layer for one token (≈ 2 × params).
    """

    name: str
    layers: int
    params_per_layer: float
    embedding_params: float
    head_params: float
    bytes_per_param: float
    kv_bytes_per_token_layer: float
    runtime_overhead_gb: float = 0.25
    #: The LM head is the embedding matrix: a shard holding both ends holds it once.
    tied: bool = False

    def __post_init__(self) -> None:
        if self.layers < 1 or self.params_per_layer <= 0 or self.bytes_per_param <= 0:
            raise ValueError(f"{self.name}: layers and sizes must be positive")

    def layer_gb(self, context_length: int) -> float:
        weights = self.params_per_layer * self.bytes_per_param
        return (weights + self.kv_bytes_per_token_layer * context_length) / GB

    def shard_gb(self, layers: int, first: bool, last: bool, context_length: int) -> float:
        extra = (self.embedding_params if first else 0.0) + (self.head_params if last else 0.0)
        if first and last and self.tied:
            extra = self.embedding_params
        return (
            layers * self.layer_gb(context_length)
            + extra * self.bytes_per_param / GB
            + self.runtime_overhead_gb
        )

    @property
    def gflop_per_layer_token(self) -> float:
        return 2.0 * self.params_per_layer / 1e9

    @property
    def params(self) -> float:
        return self.layers * self.params_per_layer + self.embedding_params

    @property
    def weights_gb(self) -> float:
        return self.params * self.bytes_per_param / GB


#: Bytes a weight takes in each precision of the CPU shard engine (int8's per-row scales add
#: 0.4 % for SmolLM2, left out as the catalogue's own figure does).
PRECISION_BYTES = {"int8": 1.0, "bfloat16": 2.0, "float32": 4.0}


def in_precision(spec: ModelSpec, precision: str | None) -> ModelSpec:
    """``spec`` with its weights counted in ``precision`` (None: as catalogued); the KV cache
    keeps its own width."""
    if precision is None:
        return spec
    return dataclasses.replace(spec, bytes_per_param=PRECISION_BYTES[precision])


CATALOGUE: dict[str, ModelSpec] = {
    # SmolLM2-135M-Instruct as the CPU worker runs it by default: int8 weights (one byte per
    # weight; the per-row scales and float32 norms add 0.4 %), a float32 KV cache, 30 layers,
    # tied embeddings (the last shard holds its own copy of the embedding matrix as LM head),
    # 3 KV heads × 64. A worker set to float32 (TESSERA_WORKER_PRECISION) needs 4 bytes.
    "smollm2-135m-instruct": ModelSpec(
        "smollm2-135m-instruct",
        30,
        3_540_096,
        28_311_552,
        28_311_552,
        1.0,
        2 * 3 * 64 * 4,
        tied=True,
    ),
    # Llama 3.2 1B in fp16: 16 layers, tied embeddings, 8 KV heads × 64.
    "llama-3.2-1b-instruct": ModelSpec(
        "llama-3.2-1b-instruct", 16, 60_817_408, 262_668_288, 262_668_288, 2.0, 2 * 8 * 64 * 2
    ),
    # Llama 3.1 in fp16 (8 KV heads × 128).
    "llama-3.1-8b-instruct": ModelSpec(
        "llama-3.1-8b-instruct", 32, 218_112_000, 525_336_576, 525_336_576, 2.0, 2 * 8 * 128 * 2
    ),
    "llama-3.1-70b-instruct": ModelSpec(
        "llama-3.1-70b-instruct",
        80,
        855_654_400,
        1_050_673_152,
        1_050_673_152,
        2.0,
        2 * 8 * 128 * 2,
    ),
}
