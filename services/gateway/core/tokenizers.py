"""Each model's tokenizer, loaded once and never on the event loop.

Loading may take seconds (preparing the model's files takes a file lock and, the first time,
a GGUF conversion; the fast tokenizer then reads them), so it runs in a thread: ``warm`` starts
it as soon as the gateway learns a model is deployed, and a request that arrives first waits
for that same load without blocking any other request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from libs.models.shipped import ModelMissing, prepare
from services.gateway.core.errors import ApiError

log = logging.getLogger(__name__)


def load_tokenizer(model: str) -> Any:
    """Blocking: the model's files (prepared once) and their tokenizer. The fast tokenizer's
    class is named, not found by ``AutoTokenizer``, whose imports pull in torch: a gateway
    started again answers its first request in about 1.5 s instead of 6 here."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(prepare(model))


class Tokenizers:
    def __init__(self) -> None:
        self._loads: dict[str, asyncio.Task[Any]] = {}

    def warm(self, model: str) -> None:
        """Start loading ``model``'s tokenizer in a thread, unless it is loaded or loading."""
        if model in self._loads:
            return
        task = asyncio.create_task(asyncio.to_thread(load_tokenizer, model))
        task.add_done_callback(lambda done: self._settled(model, done))
        self._loads[model] = task

    def _settled(self, model: str, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is not None:
            self._loads.pop(model, None)  # the next request tries again
            if not task.cancelled():
                log.warning(
                    "tokenizer not loaded", extra={"model": model, "error": repr(task.exception())}
                )

    async def get(self, model: str) -> Any:
        """The tokenizer; ``ApiError`` 503 when the model's files are not installed here."""
        self.warm(model)
        try:
            return await asyncio.shield(self._loads[model])
        except ModelMissing as exc:
            raise ApiError(503, str(exc), "server_error", "model_files_missing") from None

    async def close(self) -> None:
        for task in self._loads.values():
            task.cancel()
        await asyncio.gather(*self._loads.values(), return_exceptions=True)
