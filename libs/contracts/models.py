"""A model the cluster knows: its card, read once from its GGUF and kept in the registry.

Placement needs only sizes, and every size is read from the file itself (``libs/models/
gguf_info.py``), so any architecture and any tensor type llama.cpp stores is placed the same
way: no table of known models. The card travels in each shard task, so a worker learns what
it serves (its file, its architecture) without asking anyone.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field

from libs.contracts.base import DeviceId, ModelName, Timestamp, WireModel

#: What a registered model may be called: lower-case letters, digits, ``.``, ``_`` and ``-``
#: (a name goes into Redis keys, URLs and the OpenAI API's ``model`` field).
MODEL_NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,127}$"
Bytes = Annotated[int, Field(ge=0, le=1 << 50)]
#: Text of a token (a stop or special token), as the tokenizer stores it.
TokenText = Annotated[str, Field(max_length=256)]


def name_from_file(file_name: str) -> str:
    """The default name of a model added from ``file_name``: its stem, lower-cased, with
    anything a name may not hold turned into ``-`` ("Qwen2.5-0.5B-Instruct-Q8_0.gguf" →
    "qwen2.5-0.5b-instruct-q8_0")."""
    stem = file_name.rsplit("/", 1)[-1]
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    name = re.sub(r"[^a-z0-9_.-]+", "-", stem.lower()).strip("-._")
    return name[:128] or "model"


class ModelCard(WireModel):
    """What placement, engines and the API need to know of one model file (a GGUF) or folder
    (a Hugging Face model's: ``format`` "hf", read by ``libs/models/hf_info.py``)."""

    name: Annotated[ModelName, Field(pattern=MODEL_NAME_PATTERN)]
    #: "gguf": one GGUF file (llama.cpp's, and torch's for the shipped model); "hf": a Hugging
    #: Face folder (config.json and safetensors), which vLLM serves where the folder lies.
    format: Literal["gguf", "hf"] = "gguf"
    #: Where it was added from: a path on ``origin_host``, a URL, or ``hf:ORG/REPO[/FILE]``.
    source: Annotated[str, Field(min_length=1, max_length=4096)]
    #: The host where the file was added (its file is there; others receive it).
    origin_host: Annotated[str, Field(min_length=1, max_length=253)]
    file_name: Annotated[str, Field(min_length=1, max_length=1024)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    size_bytes: Bytes
    architecture: Annotated[str, Field(min_length=1, max_length=64)]
    layers: Annotated[int, Field(ge=1, le=100_000)]
    #: Bytes of each layer (tensors ``blk.N.*``) as stored in the file, in layer order.
    layer_bytes: tuple[Bytes, ...] = Field(max_length=100_000)
    #: Weights of each layer (elements of its tensors), in layer order.
    layer_params: tuple[Bytes, ...] = Field(max_length=100_000)
    #: Everything before the first layer: the token embeddings and any other tensor that is
    #: neither a layer's nor the output's.
    embedding_bytes: Bytes
    embedding_params: Bytes
    #: The output norm and LM head (``output*``); with ``tied`` the LM head is the embedding
    #: matrix, counted again where the last shard is not the first.
    output_bytes: Bytes
    output_params: Bytes
    tied: bool
    #: The KV cache of one token across all layers, K and V in f16.
    kv_bytes_per_token: Bytes
    context_train: Annotated[int, Field(ge=0)]
    #: The tensor types the file holds ("Q8_0", "F16", "Q4_K", …).
    tensor_types: tuple[Annotated[str, Field(max_length=32)], ...] = Field(max_length=64)
    #: The layers' weights by tensor type ({"Q4_K": …, "Q6_K": …}; the norms' F32 too): each
    #: type's kernels run at their own speed (``libs/core/predict.py``). Empty where unread.
    layer_type_params: dict[Annotated[str, Field(max_length=32)], Bytes] = Field(
        default_factory=dict, max_length=64
    )
    #: The tensor type of the output layer's matrix (the token embeddings' where tied).
    output_type: Annotated[str, Field(max_length=32)] = ""
    params: Bytes
    chat_template: Annotated[str, Field(max_length=200_000)] | None = None
    bos_token: TokenText | None = None
    eos_token: TokenText | None = None
    #: Tokens that end a generation (eos, end of turn, …), as text.
    stop_tokens: tuple[TokenText, ...] = Field(default=(), max_length=64)
    #: The tokenizer's kind as GGUF names it (``tokenizer.ggml.model``: "gpt2", "llama", …).
    tokenizer_model: Annotated[str, Field(max_length=64)] | None = None
    added_ts: Timestamp

    @property
    def weights_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embedding_bytes + self.output_bytes


class WeightsWant(WireModel):
    """A device asks the devices that hold a model's file to lend it (``WEIGHTS_WANT``, on a
    subject naming the asker: only it may send it). A holder answers on the reply subject with
    a ``WeightsOffer``; the asker checks what it receives against ``sha256``."""

    device_id: DeviceId
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    size_bytes: Bytes


class WeightsOffer(WireModel):
    """A holder's answer to a ``WeightsWant``: where to read the file (``host:port`` of its
    lender) and a ticket that lets the asker, and no one else, read that one file there once,
    within seconds (``libs/weights/lending.py``)."""

    device_id: DeviceId
    endpoint: Annotated[str, Field(min_length=3, max_length=300)]
    ticket: Annotated[str, Field(pattern=r"^[0-9a-f]{32,128}$")]
