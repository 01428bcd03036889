"""Where a model's shards can go: the candidate placements each engine family allows, the
devices left out and why, and the context a deployment gets. No I/O: it reads the cluster's
view (scored devices and what their workers announce), the registered models' cards and the
deployment book it is handed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from libs.contracts import ModelCard
from libs.core.catalogue import ModelSpec
from libs.core.model import Device
from libs.core.partition import Preview, whole_models_only
from libs.core.predict import Stage, predict
from libs.deployments import DeploymentBook
from services.scheduler import fit
from services.scheduler.replicas import ENGINE_SLOTS
from services.scheduler.view import ClusterView

#: Worker engines that run a layer range of a model (vLLM runs whole models only).
SPLITTING_ENGINES = {"torch", "llamacpp"}


class Planner:
    def __init__(self, view: ClusterView, load: Callable[[float], Mapping[str, int]]) -> None:
        """``load(now)``: the tasks each device runs (the scheduler's own placements)."""
        self.view, self.load = view, load
        #: The registered models' cards, as last read from the registry (``Scheduler.learn``).
        self.cards: dict[str, ModelCard] = {}

    def devices(self, book: DeploymentBook, now: float, moving: str | None = None) -> list[Device]:
        """The fleet as the core sees it; memory held by deployments is not free, except that
        of deployment ``moving`` (being re-placed: its old shards are dropped)."""
        return self.view.devices(self.load(now), book.reserved_gb(without=moving))

    def spec_of(
        self, model: str, precision: str | None = None, family: str = "ring"
    ) -> ModelSpec | None:
        """``model`` as the engines of ``family`` hold it (None: not registered)."""
        card = self.cards.get(model)
        if card is None:
            return None
        return fit.spec_for(card, family, ENGINE_SLOTS.get(family, 1), precision)

    def preview(
        self,
        book: DeploymentBook,
        model: str,
        context_length: int,
        max_shards: int,
        now: float,
        without: Collection[str] = frozenset(),
        precision: str | None = None,
        moving: str | None = None,
        shard_count: int | None = None,
        told: tuple[str, ...] = (),
        card: ModelCard | None = None,
    ) -> list[Preview]:
        """Candidate placements of registered ``model`` (on devices other than ``without``
        whose engine serves it; the memory of deployment ``moving`` counted free), its layers
        counted as each engine family holds them (``card_spec``: the torch ring in
        ``precision``); ``shard_count`` and ``told`` devices: exactly those. An infeasible
        option names the devices left out and why. ``card``: that of a model not registered
        (a preview before it is added), else the registered one's."""
        card = card or self.cards[model]
        candidates = self.model_devices(book, now, moving)
        refused = fit.left_out(card, candidates, self.view.announces, context_length)
        devices = [d for d in candidates if d.device_id not in refused]
        if not devices and refused:
            reason = f"no device can serve {model}: {fit.why_left(refused)}"
            return [Preview(model, (), (), False, reason, None)]
        families: dict[str, list[Device]] = {}
        for device in devices:  # a split runs on one engine: llama.cpp's, or the torch ring
            families.setdefault(self.family(device.device_id), []).append(device)
        if told:  # the told devices only, in their order (a family is still one engine)
            families = {f: g for f, g in families.items() if {d.device_id for d in g} & set(told)}
            if len(families) > 1:
                reason = "the told devices run different engines: a split runs on one"
                return [Preview(model, (), (), False, reason, None)]
        options: list[Preview] = []
        for family, group in (families or {"ring": []}).items():
            spec = fit.spec_for(card, family, self.slots(group, family), precision)
            usable = [d for d in group if d.device_id not in without]
            too_small = fit.fleet_too_small(spec, usable, context_length)
            if too_small and usable and not told and shard_count is None:
                options.append(Preview(model, (), (), False, too_small, None))
                continue
            options += fit.told_options(
                spec, group, context_length, max_shards, shard_count, told, without
            )
        whole_only = {
            d
            for d, a in self.view.announces.items()
            if a.engines and not SPLITTING_ENGINES & set(a.engines)
        }
        return [fit.explain(whole_models_only(o, whole_only), refused) for o in options]

    def context_for(
        self,
        book: DeploymentBook,
        model: str,
        asked: int | None,
        now: float,
        card: ModelCard | None = None,
    ) -> int:
        """The context a deployment of registered ``model`` (or of ``card``) gets: what it
        asks for, else ``fit.default_context`` over the devices that could hold it."""
        if asked is not None:
            return asked
        devices = self.model_devices(book, now)
        return fit.default_context(card or self.cards[model], devices, self.view.announces)

    def slots(self, devices: list[Device], family: str) -> int:
        """Request slots the engines of ``devices`` run, as their workers announce them (the
        most of them: the KV cache is sized for it), else the engine's default."""
        announced = [
            a.slots
            for d in devices
            if (a := self.view.announces.get(d.device_id)) is not None and a.slots
        ]
        return max(announced, default=ENGINE_SLOTS.get(family, 1))

    def family(self, device_id: str) -> str:
        """Which devices a split may combine: llamacpp workers with each other (llama.cpp's
        RPC backend), every other engine with the rest (the torch ring over NATS)."""
        announce = self.view.announces.get(device_id)
        return "llamacpp" if announce is not None and "llamacpp" in announce.engines else "ring"

    def model_devices(
        self, book: DeploymentBook, now: float, moving: str | None = None
    ) -> list[Device]:
        """Devices that can hold shards: those with a worker engine, when any device has one.
        The memory of deployment ``moving`` counts as free (its shards are being replaced).

        A fleet of emulated devices without workers (the simulator, scheduling demos) is
        planned on as a whole.
        """
        devices = self.devices(book, now, moving)
        serving = {d for d, a in self.view.announces.items() if a.engines}
        if not serving:
            return devices
        return [d for d in devices if d.device_id in serving]

    def no_worker(self) -> set[str]:
        """Devices with no worker engine: nothing loads there, nobody reports."""
        return {d for d, a in self.view.announces.items() if not a.engines}

    def predicted(
        self,
        option: Preview,
        devices: Mapping[str, Device],
        precision: str | None = None,
        card: ModelCard | None = None,
    ) -> dict[str, float] | None:
        """``option``'s predicted tokens/s at 1 and 8 streams and time to a first token of
        64 (``libs/core/predict.py``), from its devices' speeds and round trips; None where it
        is infeasible or runs on another engine than llama.cpp's (the model is fitted to it)."""
        if not option.feasible or self.family(option.devices[0]) != "llamacpp":
            return None
        spec = fit.spec_for(card or self.cards[option.model], "llamacpp", 8, precision)
        stages = [
            Stage(s.device_id, s.layer_start, s.layer_end, devices[s.device_id].speed,
                  devices[s.device_id].network_rtt_ms if s.shard_index else 0.0)
            for s in option.shards
        ]  # fmt: skip
        guess = predict(spec, stages, (1, 8), prompt_tokens=64)
        return {
            "tokens_per_s_1": round(guess.tokens_per_s[1], 2),
            "tokens_per_s_8": round(guess.tokens_per_s[8], 2),
            "ttft_ms": round(guess.ttft_ms, 1),
        }
