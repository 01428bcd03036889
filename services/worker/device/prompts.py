"""What an engine of token ids (the torch ring, vLLM) answers a request it cannot honour.

The gateway sends a request both as token ids (where it has the model's tokenizer) and as
OpenAI's fields (``Prompt``), not knowing which engine serves it. An engine of token ids runs
the ids; a field it cannot honour (tools, a response format, log-probabilities, …) is refused
with its name, so the user gets a 400 saying so, never an answer that silently ignored it.
"""

from __future__ import annotations

import time

from libs.contracts import GenerationRequest, TokenChunk


def refusal(request: GenerationRequest, engine: str) -> TokenChunk | None:
    """The final chunk refusing ``request`` on ``engine`` (which takes token ids only), or
    None when it can run it."""
    prompt = request.prompt
    if prompt is None:
        return None
    if prompt.kind == "embed":
        field = "model"
        message = f"embeddings are served by the llamacpp engine, not {engine}, here"
    elif prompt.fields:
        field = prompt.fields[0]
        message = (
            f"{field} is not supported by the {engine} engine serving this model (it runs "
            "token ids with the gateway's chat template; deploy on the llamacpp engine)"
        )
    elif not request.prompt_token_ids:
        field = "model"
        message = f"the {engine} engine needs the model's tokenizer on the gateway"
    else:
        return None
    index = len(request.generated_token_ids)
    return TokenChunk.failure(
        request.request_id, index, request.epoch, message, time.time(), invalid=field
    )
