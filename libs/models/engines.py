"""What each worker engine runs: architectures and tensor types, so the scheduler places a
model only on devices whose engine serves it, and says why the others were left out.

* ``llamacpp``: every architecture and tensor type of the ``gguf`` package installed beside
  it. That package is llama.cpp's own (``gguf-py``, released with it), so its tables are the
  architectures and types llama.cpp's loader names; a build older than the package may lack
  the newest ones, and then its worker refuses the shard with llama-server's own error.
* ``torch``: what ``libs/models`` implements: the llama architecture (SmolLM2's), from the
  tensor types transformers dequantises; and, as its workers convert one folder
  (``libs/models/store.prepare``), the shipped model only.
* ``vllm``: the shipped model's folder only.
"""

from __future__ import annotations

import functools

from libs.contracts.models import ModelCard

#: Tensor types transformers' GGUF loader dequantises (what the torch engine can convert).
TORCH_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K"}
    | {"Q5_K", "Q6_K"}
)
TORCH_ARCHITECTURES = frozenset({"llama"})


@functools.cache
def llamacpp_architectures() -> frozenset[str]:
    from gguf import MODEL_ARCH_NAMES

    return frozenset(MODEL_ARCH_NAMES.values())


@functools.cache
def llamacpp_types() -> frozenset[str]:
    from gguf import GGMLQuantizationType

    return frozenset(t.name for t in GGMLQuantizationType)


def serves(engine: str) -> tuple[frozenset[str], frozenset[str]] | None:
    """(architectures, tensor types) ``engine`` runs; None: an engine this table does not know
    (it is then not held to one)."""
    if engine == "llamacpp":
        return llamacpp_architectures(), llamacpp_types()
    if engine == "torch":
        return TORCH_ARCHITECTURES, TORCH_TYPES
    return None


def unserved_reason(engine: str, card: ModelCard) -> str | None:
    """Why ``engine`` cannot run ``card``'s model (None: it can)."""
    from libs.models.store import MODEL_NAME

    if engine in ("vllm", "torch") and card.name != MODEL_NAME:
        # Their workers hold one converted folder, the shipped model's (store.prepare).
        return f"{engine} serves only {MODEL_NAME} here"
    declared = serves(engine)
    if declared is None:
        return None
    architectures, types = declared
    if card.architecture not in architectures:
        return f"{engine} does not run architecture {card.architecture}"
    missing = sorted(set(card.tensor_types) - types)
    if missing:
        return f"{engine} does not run tensor type {', '.join(missing)}"
    return None
