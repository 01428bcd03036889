"""A model's card from its GGUF file: everything placement and the engines need, read from the
file's header, metadata and tensor table (the ``gguf`` package maps the file; no weight is
read), for any architecture and any tensor type.

Each layer's bytes are the sizes of its tensors (``blk.N.*``) as stored, so a quantised file
is counted as it is held; tensors outside the layers are the embedding's (before the first
layer) or the output's (``output*``, after the last). The KV cache per token is llama.cpp's
default f16 cache: K and V of ``head_count_kv`` heads of ``key_length``/``value_length``
(else ``embedding_length / head_count``) per layer. The file's sha256 is taken while reading
it once, so a file cut short or changed after it was read is caught when it moves.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.contracts.models import ModelCard, name_from_file

#: (bytes read so far, bytes in all): called as the checksum is taken.
Progress = Callable[[int, int], None]
MAGIC = b"GGUF"
CHUNK = 8 << 20
LAYER = re.compile(r"^blk\.(\d+)\.")


class ModelFileError(ValueError):
    """The file is not a GGUF this reader can take: not one at all, cut short, or
    inconsistent. The message names the file and the cause."""


def sha256_of(path: Path, progress: Progress | None = None) -> str:
    """The file's sha256, read in chunks (``progress`` after each)."""
    total, done, digest = path.stat().st_size, 0, hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    return digest.hexdigest()


def read_card(
    path: Path | str,
    *,
    name: str | None = None,
    source: str | None = None,
    origin_host: str | None = None,
    progress: Progress | None = None,
    checksum: bool = True,
    expect_sha256: str | None = None,
    now: float | None = None,
) -> ModelCard:
    """The card of the GGUF at ``path`` (``name``: default from the file name; ``checksum``
    False leaves the sha256 zero, for a quick look; ``expect_sha256``: the file must hash to
    it, as its publisher gave it). Raises ``ModelFileError``."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (it starts {head!r}, a GGUF starts b'GGUF')")
    fields, tensors = _read(path)
    sizes = _sizes(path, fields, tensors, size)
    digest = sha256_of(path, progress) if checksum else "0" * 64
    if checksum and path.stat().st_size != size:
        raise ModelFileError(f"{path}: the file changed while it was read")
    if expect_sha256 is not None and digest != expect_sha256.lower():
        raise ModelFileError(
            f"{path}: corrupt: its sha256 is {digest}, not the {expect_sha256} expected"
        )
    return ModelCard(
        name=name or name_from_file(path.name),
        source=source or str(path.resolve()),
        origin_host=origin_host or os.uname().nodename,
        file_name=path.name,
        sha256=digest,
        size_bytes=size,
        added_ts=time.time() if now is None else now,
        **sizes,
    )


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str
    n_elements: int
    n_bytes: int
    data_offset: int


def _read(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """The file's metadata (key → value) and tensor infos (no tensor's data is mapped, so a
    file cut inside its weights still reads, and is then found short)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class InfoReader(GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            self.infos: list[TensorInfo] = []
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                try:
                    kind = GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise ValueError(f"tensor type id {int(raw_type[0])} is unknown") from None
                block, size = GGML_QUANT_SIZES[kind]
                elements = int(np.prod(dims))
                self.infos.append(
                    TensorInfo(
                        str(bytes(name), encoding="utf-8"),
                        kind.name,
                        elements,
                        elements * size // block,
                        int(start_offs + offset[0]),
                    )
                )
            self.tensors = []

    try:
        reader = InfoReader(path)
    except Exception as exc:  # the reader's own errors are bare (struct, numpy, value)
        raise ModelFileError(
            f"{path}: its GGUF header cannot be read: cut short or corrupt "
            f"({type(exc).__name__}: {exc})"
        ) from None
    fields: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores"):
            fields[key] = field  # large arrays: read the few entries needed only
            continue
        if key.startswith("tokenizer.ggml.token_type"):
            continue
        try:
            fields[key] = field.contents()
        except Exception:  # a value this reader cannot decode is not one placement needs
            continue
    return fields, reader.infos


def _sizes(
    path: Path, fields: dict[str, Any], tensors: Sequence[TensorInfo], size: int
) -> dict[str, Any]:
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(f"{path}: no general.architecture in its metadata")
    layers = fields.get(f"{arch}.block_count")
    if not isinstance(layers, int) or layers < 1:
        raise ModelFileError(f"{path}: no {arch}.block_count in its metadata")
    if not tensors:
        raise ModelFileError(f"{path}: no tensors")
    layer_bytes, layer_params = [0] * layers, [0] * layers
    embedding = [0, 0]
    output = [0, 0]
    types: set[str] = set()
    by_type: dict[str, int] = {}  # the layers' weights by tensor type
    end = 0
    for tensor in tensors:
        n_bytes, n_elements = tensor.n_bytes, tensor.n_elements
        end = max(end, tensor.data_offset + n_bytes)
        types.add(tensor.type_name)
        match = LAYER.match(tensor.name)
        if match:
            index = int(match.group(1))
            if index >= layers:
                raise ModelFileError(
                    f"{path}: tensor {tensor.name} is past the {layers} layers it declares"
                )
            layer_bytes[index] += n_bytes
            layer_params[index] += n_elements
            by_type[tensor.type_name] = by_type.get(tensor.type_name, 0) + n_elements
        elif tensor.name.startswith("output"):
            output[0] += n_bytes
            output[1] += n_elements
        else:
            embedding[0] += n_bytes
            embedding[1] += n_elements
    if end > size:
        raise ModelFileError(
            f"{path}: truncated: its tensors end at byte {end:,} but the file has {size:,}"
        )
    if min(layer_bytes) == 0:
        empty = layer_bytes.index(0)
        raise ModelFileError(f"{path}: layer {empty} of {layers} has no tensors")
    named = {t.name: t.type_name for t in tensors}
    tied = "output.weight" not in named
    tokens = fields.get("tokenizer.ggml.tokens")
    eos = _token(tokens, fields.get("tokenizer.ggml.eos_token_id"))
    stops = [
        text
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (text := _token(tokens, fields.get(f"tokenizer.ggml.{key}"))) is not None
    ]
    template = fields.get("tokenizer.chat_template")
    return {
        "architecture": arch,
        "layers": layers,
        "layer_bytes": tuple(layer_bytes),
        "layer_params": tuple(layer_params),
        "embedding_bytes": embedding[0],
        "embedding_params": embedding[1],
        "output_bytes": output[0],
        "output_params": output[1],
        "tied": tied,
        "kv_bytes_per_token": _kv_bytes(fields, arch, layers),
        "context_train": _int(fields.get(f"{arch}.context_length")),
        "tensor_types": tuple(sorted(types)),
        "layer_type_params": dict(sorted(by_type.items())),
        "output_type": named.get("output.weight", named.get("token_embd.weight", "")),
        "params": sum(layer_params) + embedding[1] + output[1],
        "chat_template": template if isinstance(template, str) and template else None,
        "bos_token": _token(tokens, fields.get("tokenizer.ggml.bos_token_id")),
        "eos_token": eos,
        "stop_tokens": tuple(dict.fromkeys(stops)),
        "tokenizer_model": _str(fields.get("tokenizer.ggml.model")),
    }


def _kv_bytes(fields: dict[str, Any], arch: str, layers: int) -> int:
    """K and V of one token over all layers, f16 (2 bytes): per layer ``head_count_kv`` ×
    (key_length + value_length); a per-layer array of head counts is summed as it is."""
    heads = fields.get(f"{arch}.attention.head_count")
    width = _int(fields.get(f"{arch}.embedding_length"))
    kv = fields.get(f"{arch}.attention.head_count_kv", heads)
    per_layer = kv if isinstance(kv, list) else [kv] * layers
    head = _first(heads)
    default = width // head if head else 0
    key = _int(fields.get(f"{arch}.attention.key_length")) or default
    value = _int(fields.get(f"{arch}.attention.value_length")) or default
    return sum(_int(n) * (key + value) * 2 for n in per_layer[:layers])


def _token(tokens: Any, token_id: Any) -> str | None:
    """The text of token ``token_id`` (None when there is none)."""
    if tokens is None or not isinstance(token_id, int):
        return None
    if not 0 <= token_id < len(tokens.data):
        return None
    raw = tokens.parts[tokens.data[token_id]]
    return bytes(raw).decode("utf-8", errors="replace")[:256]


def _first(value: Any) -> int:
    return _int(value[0] if isinstance(value, list) and value else value)


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
