"""A Hugging Face model folder's card (``format`` "hf"): what placement and the engines need,
read from its ``config.json`` and its safetensors files' headers (no weight is loaded).

Layers are the tensors ``*.layers.N.*`` (``model.layers.N`` in transformers' naming), the
output the LM head and the final norm, the embeddings everything else; each at its bytes as
stored. The folder's checksum is the sha256 of its files' names and sha256s, in name order, so
the same folder copied elsewhere has the same one. Errors name the folder and what it lacks.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import time
from pathlib import Path
from typing import Any

from libs.contracts.models import ModelCard, name_from_file
from libs.models.gguf_info import ModelFileError, Progress, sha256_of

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
OUTPUT = ("lm_head.", "model.norm.", "norm.")


def safetensors_header(path: Path) -> dict[str, Any]:
    """The tensors a safetensors file holds: name → dtype, shape, data offsets."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelFileError(f"{path}: not a safetensors file (shorter than its header)")
        (length,) = struct.unpack("<Q", raw)
        if length > 100_000_000:
            raise ModelFileError(f"{path}: not a safetensors file (a {length}-byte header)")
        try:
            header: dict[str, Any] = json.loads(f.read(length))
        except ValueError as exc:
            raise ModelFileError(f"{path}: not a safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    return header


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelFileError(
            f"{folder}: no config.json: not a Hugging Face model folder (a repository's whole "
            "folder holds one: `tessera models add hf:ORG/REPO` downloads it)"
        )
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except ValueError as exc:
        raise ModelFileError(f"{path}: not JSON ({exc})") from None
    text = config.get("text_config")  # a multimodal model's language part
    return {**config, **text} if isinstance(text, dict) else config


def folder_sha256(folder: Path, progress: Progress | None = None) -> tuple[str, int]:
    """The folder's checksum (its files' relative names and sha256s, in name order) and its
    size in bytes; ``progress`` over all its bytes."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and ".cache" not in p.parts)
    total = sum(p.stat().st_size for p in files)
    done, digest = 0, hashlib.sha256()
    for path in files:
        size = path.stat().st_size

        def step(read: int, _: int, before: int = done) -> None:
            if progress is not None:
                progress(before + read, total)

        digest.update(f"{path.relative_to(folder)}\0{sha256_of(path, step)}\n".encode())
        done += size
    return digest.hexdigest(), total


def read_folder_card(
    folder: Path | str,
    *,
    name: str | None = None,
    source: str | None = None,
    origin_host: str | None = None,
    progress: Progress | None = None,
    expect_sha256: str | None = None,
    now: float | None = None,
) -> ModelCard:
    """The card of the Hugging Face model folder ``folder``. Raises ``ModelFileError``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFileError(f"{folder}: no such folder")
    config = read_config(folder)
    architectures = config.get("architectures") or []
    layers = int(config.get("num_hidden_layers") or 0)
    if not architectures or layers < 1:
        raise ModelFileError(
            f"{folder}/config.json names no architecture or no num_hidden_layers: "
            "not a causal language model's config"
        )
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelFileError(f"{folder}: no .safetensors weights (a .bin checkpoint is not read)")
    layer_bytes, layer_params = [0] * layers, [0] * layers
    sizes = {"embedding": [0, 0], "output": [0, 0]}
    types: set[str] = set()
    for shard in shards:
        for tensor, info in safetensors_header(shard).items():
            start, end = info["data_offsets"]
            count = math.prod(info["shape"])
            types.add(info["dtype"])  # safetensors' names are GGUF's (F32, F16, BF16, …)
            found = LAYER.search(tensor)
            if found and int(found[1]) < layers:
                layer_bytes[int(found[1])] += end - start
                layer_params[int(found[1])] += count
                continue
            part = sizes["output" if tensor.startswith(OUTPUT) else "embedding"]
            part[0], part[1] = part[0] + end - start, part[1] + count
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // heads)
    digest, size = folder_sha256(folder, progress)
    if expect_sha256 is not None and digest != expect_sha256.lower():
        raise ModelFileError(
            f"{folder}: its checksum is {digest}, not the {expect_sha256} expected"
        )
    return ModelCard(
        name=name or name_from_file(folder.resolve().name),
        format="hf",
        source=source or str(folder.resolve()),
        origin_host=origin_host or os.uname().nodename,
        file_name=folder.resolve().name,
        sha256=digest,
        size_bytes=size,
        architecture=str(architectures[0])[:64],
        layers=layers,
        layer_bytes=tuple(layer_bytes),
        layer_params=tuple(layer_params),
        embedding_bytes=sizes["embedding"][0],
        embedding_params=sizes["embedding"][1],
        output_bytes=sizes["output"][0],
        output_params=sizes["output"][1],
        tied=bool(config.get("tie_word_embeddings", False)),
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * 2,
        context_train=int(config.get("max_position_embeddings") or 0),
        tensor_types=tuple(sorted(types)),
        params=sum(layer_params) + sizes["embedding"][1] + sizes["output"][1],
        **tokenizer_fields(folder),
        added_ts=time.time() if now is None else now,
    )


def tokenizer_fields(folder: Path) -> dict[str, Any]:
    """The chat template (the tokenizer config's, or ``chat_template.jinja`` as transformers
    now writes it) and the BOS and EOS tokens the folder's tokenizer config holds."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    fields: dict[str, Any] = {}
    template = config.get("chat_template")
    if not isinstance(template, str) and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if isinstance(template, str) and len(template) <= 200_000:
        fields["chat_template"] = template
    for key in ("bos_token", "eos_token"):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and len(token) <= 256:
            fields[key] = token
    if "eos_token" in fields:
        fields["stop_tokens"] = (fields["eos_token"],)
    return fields
