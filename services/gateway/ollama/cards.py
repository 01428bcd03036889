"""A model registry's card as Ollama's model endpoints show it: ``/api/tags``' entries, the
details, ``model_info`` and ``parameters`` of ``/api/show``. A model the registry has no card
of (a removal in flight) gets empty details."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from libs.contracts.models import ModelCard

#: A deployment is not unloaded for being idle (Ollama's ``keep_alive`` -1 reads the same).
NEVER = "2318-01-01T00:00:00Z"


def stamp(ts: float | None = None) -> str:
    when = datetime.fromtimestamp(ts, UTC) if ts is not None else datetime.now(UTC)
    return when.isoformat().replace("+00:00", "Z")


def parameter_size(params: int) -> str:
    """Ollama's way of writing a parameter count: "134.52M", "7.6B"."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if params >= size:
            return f"{params / size:.2f}".rstrip("0").rstrip(".") + unit
    return str(params)


def quantization(card: ModelCard) -> str:
    """The file's quantization as Ollama names it: the tensor type its file name names
    ("…-Q8_0.gguf"), else the first type that is not F32 (norms stay F32 in every file)."""
    named = [t for t in card.tensor_types if t.lower() in card.file_name.lower()]
    others = [t for t in card.tensor_types if t != "F32"]
    return (named or others or list(card.tensor_types) or [""])[0]


def details(card: ModelCard | None) -> dict[str, Any]:
    if card is None:
        return {
            "parent_model": "",
            "format": "gguf",
            "family": "",
            "families": None,
            "parameter_size": "",
            "quantization_level": "",
        }
    return {
        "parent_model": "",
        "format": "gguf",
        "family": card.architecture,
        "families": [card.architecture],
        "parameter_size": parameter_size(card.params),
        "quantization_level": quantization(card),
    }


def entry(name: str, card: ModelCard | None) -> dict[str, Any]:
    """A model as ``/api/tags`` lists it."""
    return {
        "name": name,
        "model": name,
        "modified_at": stamp(card.added_ts if card else None),
        "size": card.size_bytes if card else 0,
        "digest": card.sha256 if card else "",
        "details": details(card),
    }


def model_info(card: ModelCard | None, context: int) -> dict[str, Any]:
    """Ollama's ``model_info``: GGUF's own keys, as Ollama shows them."""
    if card is None:
        return {"general.architecture": "", "context_length": context}
    arch = card.architecture
    info: dict[str, Any] = {
        "general.architecture": arch,
        "general.parameter_count": card.params,
        f"{arch}.context_length": card.context_train,
        f"{arch}.block_count": card.layers,
    }
    if card.tokenizer_model:
        info["tokenizer.ggml.model"] = card.tokenizer_model
    return info


def parameters(card: ModelCard | None, context: int) -> str:
    """Ollama's ``parameters`` text: the deployment's context and the model's stop tokens."""
    lines = [f"num_ctx {context}"]
    lines += [f'stop "{token}"' for token in (card.stop_tokens if card else ())]
    return "\n".join(lines)
