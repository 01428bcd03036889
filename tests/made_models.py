"""Test models: random-weight GGUFs of several architectures, made offline at test time.

Every architecture Tessera claims to serve is tested on a real file of that architecture, with
no download. ``make_gguf`` writes one with the ``gguf`` package: the metadata
keys and tensors llama.cpp's loader requires for the architecture (``src/models/<arch>.cpp``),
random weights in the tensor type asked for (std ``GAIN / sqrt(width)``: finite, and greedy
tokens that vary with the prompt), norms in F32 (as llama.cpp's converters store them), and
every ``tokenizer.*`` field copied from the shipped SmolLM2 GGUF: the vocabulary is 49,152
tokens, text tokenizes for real and the chat template is a real one. ``llama_server_tokens`` is
the reference the serving tests compare against: llama.cpp's own server on the whole file.

Quantized weights are written as random blocks (random quants, a scale per block) rather than
by quantizing float arrays: a 1 GB file is then written in seconds, not a minute, and the
values are what the type can hold exactly. K-quants and i-quants (``QUANTIZED_TYPES``), which
the ``gguf`` package cannot write, are made as llama.cpp's users make them: an F16 file of the
same model quantized by llama.cpp's own ``llama-quantize`` (Q4_K_M mixes Q4_K and Q6_K, so
its layers differ in size, as real ones do).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from libs.models.shipped import gguf_path
from libs.runtime.procs import child_kwargs, free_port
from services.worker.rpc.server import llama_env
from services.worker.settings import WorkerSettings

ARCHS = ("llama", "qwen2", "gemma2", "phi3")
#: Types written here; K-quants are not (``gguf`` only dequantizes them).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
#: File types ``llama-quantize`` makes from an F16 file (its names), with the tensor types the
#: weight matrices then hold. Their blocks are 256 wide: ``hidden`` and ``ffn`` must be
#: multiples of 256 (llama-quantize would fall back to another type otherwise).
QUANTIZED_TYPES = {
    "Q4_K_M": ("Q4_K", "Q6_K"),
    "Q5_K_M": ("Q5_K", "Q6_K"),
    "Q6_K": ("Q6_K",),
    "IQ4_XS": ("IQ4_XS",),
}
#: A weight matrix's standard deviation is ``GAIN / sqrt(its input width)``: activations keep
#: about the same size through every layer, and greedy tokens follow the prompt and each other
#: (at 0.02, as first tried, most architectures repeated one token whatever the prompt).
GAIN = 2.0
VOCAB = 49152
FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
}
#: Per block type: header bytes (f16 scale ``d``, then ``m`` for the ``_1`` types), the quant
#: range's standard deviation (uniform quants) and the offset that centres it at zero.
QUANT_BLOCKS = {
    "Q8_0": (2, 73.9, 0.0),  # int8 q, value q*d
    "Q4_0": (2, 4.61, 0.0),  # nibble q, value (q-8)*d
    "Q4_1": (4, 4.61, -7.5),  # value q*d + m, m = -7.5 d
    "Q5_0": (2, 9.23, 0.0),  # 5-bit q, value (q-16)*d
    "Q5_1": (4, 9.23, -15.5),
}


@dataclass(frozen=True)
class Dims:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        return self.head_dim * self.kv_heads


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: its GGUF name, numpy shape (rows, columns) and type; ``fill`` is
    ``random`` (of standard deviation ``std``) or ``ones`` (norms)."""

    name: str
    shape: tuple[int, ...]
    type: str
    fill: str = "random"
    std: float = 0.0

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[Q[self.type]]
        return math.prod(self.shape) // block * size


def tensor_specs(arch: str, tensor_type: str, dims: Dims, tied: bool) -> list[TensorSpec]:
    """The tensors llama.cpp's loader requires for ``arch`` (``src/models/<arch>.cpp``)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}: one of {', '.join(ARCHS)}")
    if arch == "gemma2" and not tied:
        raise ValueError("gemma2's output is always its token embedding (llama.cpp ties it)")
    h, t = dims.hidden, tensor_type
    specs = [TensorSpec("token_embd.weight", (VOCAB, h), t)]
    if not tied:
        specs.append(TensorSpec("output.weight", (VOCAB, h), t))
    specs.append(TensorSpec("output_norm.weight", (h,), "F32", "ones"))
    for i in range(dims.layers):
        b = f"blk.{i}."
        layer = [TensorSpec(b + "attn_norm.weight", (h,), "F32", "ones")]
        if arch == "phi3":  # fused Q, K, V and fused gate+up, as Phi-3's GGUFs ship
            layer.append(TensorSpec(b + "attn_qkv.weight", (h + 2 * dims.kv_width, h), t))
        else:
            layer += [
                TensorSpec(b + "attn_q.weight", (h, h), t),
                TensorSpec(b + "attn_k.weight", (dims.kv_width, h), t),
                TensorSpec(b + "attn_v.weight", (dims.kv_width, h), t),
            ]
        if arch == "qwen2":
            layer += [
                TensorSpec(b + "attn_q.bias", (h,), "F32", std=0.02),
                TensorSpec(b + "attn_k.bias", (dims.kv_width,), "F32", std=0.02),
                TensorSpec(b + "attn_v.bias", (dims.kv_width,), "F32", std=0.02),
            ]
        layer.append(TensorSpec(b + "attn_output.weight", (h, h), t))
        if arch == "gemma2":
            layer.append(TensorSpec(b + "post_attention_norm.weight", (h,), "F32", "ones"))
        layer.append(TensorSpec(b + "ffn_norm.weight", (h,), "F32", "ones"))
        if arch == "phi3":
            layer.append(TensorSpec(b + "ffn_up.weight", (2 * dims.ffn, h), t))
        else:
            layer += [
                TensorSpec(b + "ffn_gate.weight", (dims.ffn, h), t),
                TensorSpec(b + "ffn_up.weight", (dims.ffn, h), t),
            ]
        layer.append(TensorSpec(b + "ffn_down.weight", (h, dims.ffn), t))
        if arch == "gemma2":
            layer.append(TensorSpec(b + "post_ffw_norm.weight", (h,), "F32", "ones"))
        specs += layer
    return [
        replace(spec, std=weight_std(arch, spec)) if spec.fill == "random" else spec
        for spec in specs
    ]


def weight_std(arch: str, spec: TensorSpec) -> float:
    """``GAIN / sqrt(input width)``; gemma2 multiplies its embeddings by ``sqrt(hidden)``, so its
    token embedding is that much smaller (or it drowns the layers: the prompt's last token
    came back forever). Biases keep the std they were given."""
    if spec.std:
        return spec.std
    width = spec.shape[-1]
    if arch == "gemma2" and spec.name == "token_embd.weight":
        return GAIN / width
    return GAIN / math.sqrt(width)


def random_tensor(rng: np.random.Generator, spec: TensorSpec) -> np.ndarray:
    """The tensor's data as the GGUF stores it: float values for F32/F16, raw bytes (one row of
    blocks per tensor row) for BF16 and the block types."""
    if spec.fill == "ones":
        return np.ones(spec.shape, np.float32)
    count = math.prod(spec.shape)
    if spec.type in QUANT_BLOCKS:
        header, spread, offset = QUANT_BLOCKS[spec.type]
        block, size = gguf.GGML_QUANT_SIZES[Q[spec.type]]
        blocks = random_bytes(rng, count // block * size).reshape(-1, size)
        # A scale of random sign per block: the quants' range is lopsided (-8..7 for Q4_0),
        # and a fixed sign would shift every weight's mean by half a step.
        scale = np.where(random_bytes(rng, len(blocks)) & 1, 1.0, -1.0) * (spec.std / spread)
        fields = np.stack([scale, offset * scale], axis=1)[:, : header // 2]
        blocks[:, :header] = fields.astype(np.float16).view(np.uint8)
        return blocks.reshape(spec.shape[0], -1)
    # Floats: each element one of 65,536 normal draws, picked by random 16-bit indices (a tenth
    # of the time of drawing each from the normal distribution).
    table = rng.standard_normal(65536, np.float32) * np.float32(spec.std)
    values = table[random_bytes(rng, count * 2).view(np.uint16)].reshape(spec.shape)
    if spec.type == "F32":
        return values
    if spec.type == "F16":
        return values.astype(np.float16)
    if spec.type == "BF16":
        raw = gguf.quants.quantize(values, Q.BF16)
        return np.asarray(raw).view(np.uint8).reshape(spec.shape[0], -1)
    raise ValueError(f"tensor type {spec.type!r} is not written here: one of {TENSOR_TYPES}")


def random_bytes(rng: np.random.Generator, count: int) -> np.ndarray:
    words = rng.integers(0, 2**64 - 1, size=-(-count // 8), dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:count]


@functools.cache
def smollm2_tokenizer() -> tuple[tuple[str, Any, gguf.GGUFValueType, Any], ...]:
    """Every ``tokenizer.*`` field of the shipped SmolLM2 GGUF: (key, value, type, item type).
    Read once per process (~3 s: ``GGUFReader`` parses the 100,000 strings)."""
    reader = gguf.GGUFReader(gguf_path())
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        if sub == gguf.GGUFValueType.STRING:
            value: Any = [bytes(field.parts[i]).decode() for i in field.data]
        elif sub is not None:
            value = [field.parts[i][0].item() for i in field.data]
        else:
            value = field.contents()
        fields.append((key, value, vtype, sub))
    return tuple(fields)


def file_bytes(specs: Sequence[TensorSpec]) -> int:
    """About the file's size: the tensors, their 32-byte alignment, and ~1.8 MB of metadata."""
    return sum(-(-s.nbytes // 32) * 32 for s in specs) + 1_770_000


def dims_for_size(arch: str, tensor_type: str, dims: Dims, tied: bool, target_bytes: int) -> Dims:
    """``dims`` widened until the file is about ``target_bytes``: the widest hidden size (whole
    heads and KV groups, the same head size, layers and FFN ratio) that stays under it, then
    the FFN grown 32 at a time to come closest."""

    def size(d: Dims) -> int:
        return file_bytes(tensor_specs(arch, tensor_type, d, tied))

    group = dims.heads // dims.kv_heads
    step = dims.head_dim * group  # whole heads, whole KV groups, a multiple of 32
    best = dims
    for n in range(1, 10_000):
        hidden = n * step
        ffn = max(32, hidden * dims.ffn // dims.hidden // 32 * 32)
        wider = replace(dims, hidden=hidden, heads=n * group, kv_heads=n, ffn=ffn)
        if size(wider) > target_bytes:
            break
        best = wider
    while size(replace(best, ffn=best.ffn + 32)) <= target_bytes:
        best = replace(best, ffn=best.ffn + 32)
    if target_bytes - size(best) > size(replace(best, ffn=best.ffn + 32)) - target_bytes:
        best = replace(best, ffn=best.ffn + 32)
    return best


def make_gguf(
    path: Path,
    arch: str,
    tensor_type: str = "F16",
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 512,
    context: int = 2048,
    seed: int = 0,
    target_bytes: int | None = None,
    tied: bool = True,
    chat_template: bool = True,
) -> Path:
    """Write a random-weight GGUF of ``arch`` (one of ``ARCHS``) that llama.cpp loads.

    Weights of ``tensor_type`` (one of ``TENSOR_TYPES``; or of ``QUANTIZED_TYPES``, made by
    ``quantized`` from the F16 file), norms F32. ``tied`` leaves out ``output.weight`` (the
    output is the token embedding; gemma2 is always tied). With
    ``target_bytes``, ``hidden``, ``heads``, ``kv_heads`` and ``ffn`` are resized (keeping
    ``layers``, the head size and the ratios) so the file is about that size. ``hidden`` and
    ``ffn`` must be multiples of 32 (the block size). ``chat_template=False`` leaves out
    SmolLM2's chat template (a base model's file). The same arguments give the same file.
    """
    if tensor_type in QUANTIZED_TYPES:
        if target_bytes is not None or hidden % 256 or ffn % 256:
            raise ValueError(f"{tensor_type}: hidden and ffn by 256, and no target_bytes")
        source = make_gguf(
            Path(path).with_suffix(".f16.tmp"), arch, "F16", layers, hidden, heads, kv_heads, ffn,
            context, seed, None, tied, chat_template,
        )  # fmt: skip
        try:
            return quantized(source, Path(path), tensor_type)
        finally:
            source.unlink()
    if tensor_type not in TENSOR_TYPES:
        known = (*TENSOR_TYPES, *QUANTIZED_TYPES)
        raise ValueError(f"tensor type {tensor_type!r} is not made here: one of {known}")
    if hidden % heads or heads % kv_heads or hidden % 32 or ffn % 32:
        raise ValueError("hidden must split into heads and heads into KV heads; hidden, ffn by 32")
    dims = Dims(layers, hidden, heads, kv_heads, ffn)
    if target_bytes is not None:
        dims = dims_for_size(arch, tensor_type, dims, tied, target_bytes)
    specs = tensor_specs(arch, tensor_type, dims, tied)
    path = Path(path)
    writer = gguf.GGUFWriter(path, arch)
    write_metadata(writer, arch, tensor_type, dims, context)
    for key, value, vtype, sub in smollm2_tokenizer():
        if key == "tokenizer.chat_template" and not chat_template:
            continue
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for spec in specs:
        # Shape in numpy order (the writer reverses it into GGUF's); dtype only needs to be
        # other than uint8 for the shape to be taken as the tensor's, not its bytes'.
        writer.add_tensor_info(
            spec.name, spec.shape, np.dtype(np.float32), spec.nbytes, raw_dtype=Q[spec.type]
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for spec in specs:  # one tensor in memory at a time
        writer.write_tensor_data(random_tensor(rng, spec))
    writer.close()
    return path


def quantized(source: Path, path: Path, file_type: str) -> Path:
    """``source`` (an F16 or F32 GGUF) quantized to ``file_type`` by llama.cpp's
    ``llama-quantize``, written to ``path``. Raises ``RuntimeError`` with its output's end."""
    binary = llama_binaries() / "llama-quantize"
    if not binary.exists():
        raise RuntimeError(f"{binary} not found: build it with `make llama`")
    done = subprocess.run(
        [str(binary), str(source), str(path), file_type, "1"],
        capture_output=True, text=True, env=llama_env(), timeout=120,
    )  # fmt: skip
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-10:])
        raise RuntimeError(f"llama-quantize {file_type} failed ({done.returncode}):\n{tail}")
    return path


def write_metadata(
    writer: gguf.GGUFWriter, arch: str, tensor_type: str, dims: Dims, context: int
) -> None:
    writer.add_type("model")
    # Not the architecture's name: llama.cpp gives a model named "phi3" Phi-3's special
    # tokens ("</s>"), which SmolLM2's vocabulary lacks (src/llama-vocab.cpp).
    writer.add_name(f"tessera-test-{dims.layers}x{dims.hidden}-{tensor_type.lower()}")
    writer.add_file_type(FILE_TYPES[tensor_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(VOCAB)
    writer.add_context_length(context)
    writer.add_block_count(dims.layers)
    writer.add_embedding_length(dims.hidden)
    writer.add_feed_forward_length(dims.ffn)
    writer.add_head_count(dims.heads)
    writer.add_head_count_kv(dims.kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(dims.head_dim)
    if arch == "gemma2":  # Gemma 2's published values; llama.cpp divides by the final cap
        writer.add_key_length(dims.head_dim)
        writer.add_value_length(dims.head_dim)
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
        writer.add_sliding_window(min(4096, context))


# -- llama.cpp's own server, the reference ------------------------------------------------------


def llama_binaries() -> Path:
    return WorkerSettings().llama_bin


@dataclass
class ReferenceServer:
    """A running ``llama-server`` on one GGUF, whole, one slot (``llama_server``)."""

    url: str
    log_path: Path

    def post(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def completion(
        self, prompt: str | Sequence[int], n: int, *, ignore_eos: bool = False
    ) -> dict[str, Any]:
        """llama-server's ``/completion`` answer to a greedy request (``tokens`` included)."""
        body = {
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "n_predict": n,
            "temperature": 0.0,
            "return_tokens": True,
            "cache_prompt": False,
            "ignore_eos": ignore_eos,
        }
        answer: dict[str, Any] = self.post("/completion", body)
        return answer

    def tokens(self, prompt: str | Sequence[int], n: int) -> list[int]:
        return [int(t) for t in self.completion(prompt, n)["tokens"]]

    def log_tail(self, lines: int = 10) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def llama_server(
    gguf_file: Path,
    *,
    context: int = 2048,
    threads: int = 1,
    timeout_s: float = 60.0,
    binaries: Path | None = None,
    gpu_layers: int = 0,
    rpc: str | None = None,
    offload: Sequence[str] = (),
) -> Iterator[ReferenceServer]:
    """llama.cpp's server on ``gguf_file``, whole, until the block ends: on the CPU, or with
    ``gpu_layers`` of its layers on the GPU (a CUDA build's ``binaries``; the rest on the CPU),
    or, given an ``rpc`` server's address, those layers on that server (this process sees no
    GPU); or, given ``offload`` (the worker's own flags after ``--rpc``), as those say, the GPU
    visible. Raises ``RuntimeError`` with its log's end when it exits or is not up within
    ``timeout_s``."""
    binary = (binaries or llama_binaries()) / "llama-server"
    if not binary.exists():
        raise RuntimeError(f"{binary} not found: build it with `make llama`")
    port = free_port()
    command = [
        str(binary),
        *("-m", str(gguf_file), "--host", "127.0.0.1", "--port", str(port)),
        *("-t", str(threads), "-c", str(context), "-np", "1"),
        *(("--rpc", rpc) if rpc else ()),
        *(
            offload
            or (("-ngl", str(gpu_layers)) if gpu_layers else ("-ngl", "0", "--device", "none"))
        ),
        *("--no-webui", "--no-warmup"),
    ]
    with tempfile.NamedTemporaryFile("wb", prefix="llama-ref-", suffix=".log", delete=False) as f:
        server = ReferenceServer(f"http://127.0.0.1:{port}", Path(f.name))
        proc = subprocess.Popen(
            command, stdout=f, stderr=subprocess.STDOUT,
            env=llama_env(gpu=bool(offload) or (gpu_layers > 0 and not rpc)),
            **child_kwargs(signal.SIGKILL),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited with {proc.returncode}:\n{server.log_tail()}"
                )
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(server.url + "/health", timeout=2) as response,
            ):
                if response.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not up in {timeout_s} s:\n{server.log_tail()}")
            time.sleep(0.1)
        yield server
    finally:
        proc.kill()
        proc.wait()
        server.log_path.unlink(missing_ok=True)


def llama_server_tokens(
    gguf_file: Path, prompt: str | Sequence[int], n: int, *, context: int = 2048
) -> list[int]:
    """The greedy token ids llama.cpp's own server gives for ``prompt`` on the whole file: the
    reference a split must equal. A text prompt is tokenized by the server, with the special
    tokens the GGUF asks for (SmolLM2's tokenizer adds no BOS); it stops at EOS or ``n``."""
    with llama_server(gguf_file, context=context) as server:
        return server.tokens(prompt, n)


# -- Hugging Face folders ------------------------------------------------------------------------

#: The shipped model's tokenizer files a made folder gets (its vocabulary: 49,152 tokens).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_hf_folder(folder: Path, *, layers: int = 2, hidden: int = 128, seed: int = 0) -> Path:
    """A Hugging Face folder of a small random-weight ``LlamaForCausalLM`` (float32
    safetensors, tied embeddings, heads of 64, SmolLM2's size: vLLM's CPU attention runs no
    head of 16), with the shipped SmolLM2's tokenizer, written by ``transformers`` offline: a
    model vLLM serves as any folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from libs.models.shipped import prepare

    config = LlamaConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # float32, as transformers makes it
    with torch.no_grad():  # weights that make greedy tokens follow the prompt (GAIN, above)
        for name, weight in model.named_parameters():
            if weight.dim() == 2:
                weight.normal_(0.0, GAIN / math.sqrt(weight.shape[1]))
            elif "norm" not in name:
                weight.zero_()
    model.save_pretrained(folder, safe_serialization=True)
    shipped = prepare()
    for name in TOKENIZER_FILES:
        if (shipped / name).exists():
            (folder / name).write_bytes((shipped / name).read_bytes())
    return folder
