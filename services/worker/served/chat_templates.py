"""Whether a GGUF's chat template can call tools, and a ChatML tool format for those that can't.

llama.cpp learns a model's tool-call format from its chat template; a template with none
(SmolLM2's) makes its server drop ``tools`` without a word. For a ChatML template (the
``<|im_start|>`` turns SmolLM2, Qwen and many others use) the server is given the model's own
template wrapped in one that, only when tools are sent, renders them and the calls in the
Hermes format (``<tool_call>{"name": …, "arguments": …}</tool_call>``, as Qwen2.5's template
does): every chat without tools or tool calls renders exactly as the model's own template
renders it. A template that is neither tool-aware nor ChatML keeps its own, and requests
with tools are refused naming the field.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

KEY = "tokenizer.chat_template"

#: Qwen2.5's template (without its default system prompt) for a chat with tools or tool
#: calls, ending in the ``else`` under which the model's own template goes.
TOOLS = Path(__file__).with_name("chatml_tools.jinja")


#: GGUF value types and their sizes in bytes (8: string, 9: array, read apart).
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def own_template(gguf: Path) -> str | None:
    """The GGUF's chat template (None: it has none, or the file cannot be read). Only the
    header's key-value pairs are read: the ``gguf`` package's reader maps every tensor too,
    which took seconds."""
    try:
        with gguf.open("rb") as f:
            if f.read(4) != b"GGUF":
                return None
            _version, _tensors, count = struct.unpack("<IQQ", f.read(20))
            for _ in range(count):
                key = _string(f)
                kind = struct.unpack("<I", f.read(4))[0]
                if key == KEY and kind == 8:
                    return _string(f)
                _skip(f, kind)
    except (OSError, struct.error, UnicodeDecodeError, ValueError) as exc:
        log.warning("chat template not read", extra={"gguf": str(gguf), "error": repr(exc)})
    return None


def _string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode()


def _skip(f: BinaryIO, kind: int) -> None:
    if kind == 8:
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(length, 1)
    elif kind == 9:
        inner, count = struct.unpack("<IQ", f.read(12))
        if inner in SIZES:
            f.seek(SIZES[inner] * count, 1)
        else:
            for _ in range(count):
                _skip(f, inner)
    elif kind in SIZES:
        f.seek(SIZES[kind], 1)
    else:
        raise ValueError(f"GGUF value type {kind}")


def calls_tools(template: str) -> bool:
    """Whether the template renders tools itself (llama.cpp then parses its format)."""
    return "tools" in template or "tool_calls" in template


#: What ``tool_template`` found for each GGUF (reading one takes seconds on a busy host).
FOUND: dict[Path, tuple[Path | None, bool]] = {}


def tool_template(gguf: Path) -> tuple[Path | None, bool]:
    """A template file for ``--chat-template-file`` (None: keep the model's) and whether the
    server then honours ``tools`` (blocking: read once per GGUF, off the event loop)."""
    known = FOUND.get(gguf)
    if known is not None and (known[0] is None or known[0].exists()):
        return known
    FOUND[gguf] = found = _tool_template(gguf)
    return found


def _tool_template(gguf: Path) -> tuple[Path | None, bool]:
    own = own_template(gguf)
    if own is None:
        return None, False
    if calls_tools(own):
        return None, True
    if "<|im_start|>" not in own:
        return None, False
    text = TOOLS.read_text().rstrip("\n") + own + "{%- endif %}"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"tessera-chatml-tools-{digest}.jinja"
    if not path.exists():  # one file per template, shared by every server started here
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_text(text)
        partial.replace(path)
    return path, True
