"""Models as placement sees them: layer counts and the memory each part needs (``ModelSpec``),
from a registered model's card (``card_spec``) or, for the simulator, written down
(``HYPOTHETICAL_MODELS``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

GB = 1e9


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder-only transformer, as far as placement cares.

    Memory of a shard = its layers' weights + their KV cache for the context + the embeddings
    on the first shard + the LM head on the last + a fixed runtime overhead per process.
    ``gflop_per_layer_token`` is the forward cost of one layer for one token (≈ 2 × params).
    Every layer weighs ``params_per_layer × bytes_per_param`` unless ``layer_bytes`` gives
    each its own (a mixed quantization such as Q4_K_M stores some layers wider than others).
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
    #: Each layer's weights in bytes, where they differ; empty: all the same.
    layer_bytes: tuple[float, ...] = ()
    #: The layers' weights by tensor type, as shares of them (("Q4_K", 0.8), ("Q6_K", 0.2)),
    #: and the output layer's type: the speed prediction runs each at its kernels' rate
    #: (``libs/core/predict.py``). Empty: not known (a catalogue model, the torch ring).
    layer_types: tuple[tuple[str, float], ...] = ()
    output_type: str = ""
    #: ``layer_bytes`` summed: element i is the bytes of layers 0..i-1.
    _before: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.layers < 1 or self.params_per_layer <= 0 or self.bytes_per_param <= 0:
            raise ValueError(f"{self.name}: layers and sizes must be positive")
        if self.layer_bytes and len(self.layer_bytes) != self.layers:
            raise ValueError(f"{self.name}: {len(self.layer_bytes)} layer sizes for {self.layers}")
        object.__setattr__(self, "_before", tuple(accumulate(self.layer_bytes, initial=0.0)))

    def layer_gb(self, context_length: int) -> float:
        """A layer of the mean size, with its KV cache."""
        weights = self.params_per_layer * self.bytes_per_param
        return (weights + self.kv_bytes_per_token_layer * context_length) / GB

    def layers_gb(self, start: int, end: int, context_length: int) -> float:
        """Layers ``start`` to ``end - 1``, each at its own size, with their KV cache."""
        if not self.layer_bytes:
            return (end - start) * self.layer_gb(context_length)
        weights = self._before[end] - self._before[start]
        return (weights + (end - start) * self.kv_bytes_per_token_layer * context_length) / GB

    def shard_gb(
        self, layers: int, first: bool, last: bool, context_length: int, start: int | None = None
    ) -> float:
        """A shard of ``layers`` layers from ``start`` (default: 0 for the first shard, the
        last ``layers`` for the last; a middle shard with no ``start``: the mean layer)."""
        extra = (self.embedding_params if first else 0.0) + (self.head_params if last else 0.0)
        if first and last and self.tied:
            extra = self.embedding_params
        if start is None:
            start = 0 if first else self.layers - layers if last else None
        body = (
            layers * self.layer_gb(context_length)
            if start is None
            else self.layers_gb(start, start + layers, context_length)
        )
        return body + extra * self.embedding_bytes / GB + self.runtime_overhead_gb

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
        layers = self._before[-1] or self.layers * self.params_per_layer * self.bytes_per_param
        return (layers + self.embedding_params * self.embedding_bytes) / GB


#: Bytes a weight takes in each precision of the CPU shard engine (int8's per-row scales add
#: 0.4 % for SmolLM2, left out as the catalogue's own figure does).
PRECISION_BYTES = {"int8": 1.0, "bfloat16": 2.0, "float32": 4.0}


class CardSizes(Protocol):
    """What placement reads of a registered model's card (``libs.contracts.ModelCard``):
    sizes as its GGUF stores them."""

    @property
    def name(self) -> str: ...
    @property
    def layers(self) -> int: ...
    @property
    def layer_bytes(self) -> tuple[int, ...]: ...
    @property
    def layer_params(self) -> tuple[int, ...]: ...
    @property
    def embedding_bytes(self) -> int: ...
    @property
    def embedding_params(self) -> int: ...
    @property
    def output_bytes(self) -> int: ...
    @property
    def tied(self) -> bool: ...
    @property
    def kv_bytes_per_token(self) -> int: ...
    @property
    def layer_type_params(self) -> Mapping[str, int]: ...
    @property
    def output_type(self) -> str: ...


def card_spec(card: CardSizes, family: str, slots: int, precision: str | None = None) -> ModelSpec:
    """A registered model as the engines of ``family`` hold it.

    ``llamacpp``: the GGUF's own bytes (each layer's as stored, where they differ; the
    embeddings and the output as stored: the LM head of a tied model is a copy of the
    embeddings on the last shard's device) and llama.cpp's f16 KV cache for each of ``slots``
    request slots. Otherwise (the torch ring): its weights in ``precision`` (default int8, the
    CPU worker's) and a float32 KV cache.
    """
    params = max(1.0, sum(card.layer_params) / card.layers)
    embedding_params = float(max(1, card.embedding_params))
    kv_layer = card.kv_bytes_per_token / card.layers
    if family != "llamacpp":
        return ModelSpec(
            card.name,
            card.layers,
            params,
            embedding_params,
            embedding_params,
            PRECISION_BYTES[precision or "int8"],
            kv_layer * 2,  # float32, where llama.cpp keeps f16
            tied=card.tied,
        )
    embedding_bytes = max(1, card.embedding_bytes) / embedding_params
    uneven = len(set(card.layer_bytes)) > 1
    head = card.output_bytes + (card.embedding_bytes if card.tied else 0)
    typed = sum(card.layer_type_params.values())
    return ModelSpec(
        card.name,
        card.layers,
        params,
        embedding_params,
        head / embedding_bytes,  # the head's bytes, counted at the embeddings' width
        sum(card.layer_bytes) / card.layers / params,
        kv_layer * slots,
        tied=card.tied,
        embedding_bytes_per_param=embedding_bytes,
        layer_bytes=tuple(float(b) for b in card.layer_bytes) if uneven else (),
        layer_types=tuple((t, n / typed) for t, n in card.layer_type_params.items() if typed),
        output_type=card.output_type,
    )


#: Models that exist only in the simulator, the benchmarks and the partitioner's tests: sizes
#: written down from their published configurations. Nothing here can be deployed: the
#: cluster's models are those of its registry (``libs/models/registry.py``), sized from their
#: files (``card_spec``).
HYPOTHETICAL_MODELS: dict[str, ModelSpec] = {
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
