"""What a shard task holds in its device's host memory, as the placement counts it: the
worker's own check of its memory (``ServedWorker.no_room``) adds these up."""

from __future__ import annotations

from libs.contracts import DEFAULT_CONTEXT_TOKENS, ShardTask
from libs.core.catalogue import card_spec
from libs.core.partition import gpu_held_gb


def held_gb(task: ShardTask) -> float:
    """GB of host memory that ``task``'s layers hold on its device, as the placement counts
    them (``card_spec``: the file's bytes of those layers as stored, the embeddings on the
    first shard, the output on the last), with one request's KV cache at the task's context,
    less the layers it put in the device's VRAM; 0 for a task that carries no card."""
    card = task.card
    if card is None:
        return 0.0
    spec = card_spec(card, "llamacpp", slots=1)
    first, last = task.shard_index == 0, task.shard_index == task.shard_count - 1
    context = task.context_length or DEFAULT_CONTEXT_TOKENS
    layers = task.layer_end - task.layer_start
    held = spec.shard_gb(layers, first, last, context, start=task.layer_start)
    if task.gpu_layers:  # the placement put its last layers in the device's VRAM
        start, end = task.layer_start, task.layer_end
        held -= gpu_held_gb(spec, start, end, last, context, task.gpu_layers)
    return max(0.0, held)
