"""Where a model's shards can go: the candidate placements each engine family allows, the
devices left out and why, and the context a deployment gets. No I/O: it reads the cluster's
view (scored devices and what their workers announce), the registered models' cards and the
deployment book it is handed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Mapping, Sequence

from libs.contracts import DeploymentState, ModelCard, Speed
from libs.core.catalogue import ModelSpec
from libs.core.model import Device
from libs.core.partition import Preview, Step, whole_models_only
from libs.core.predict import (
    RING_TRIPS_PER_STEP,
    Stage,
    corrected,
    factor_of,
    placement_step_ms,
    predict,
    stages_of,
)
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
        #: How much slower than predicted each model measured on each device
        #: (``predict.corrected``: ``MODEL@DEVICE``, with the device's, the model's and the
        #: default for what was not measured): the predictions and the splits weigh speeds by
        #: it. Kept in the scheduler's checkpoints.
        self.factors: dict[str, float] = {}

    def corrected(self, device: Device, model: str) -> Device:
        """``device`` at the speed its measurements showed for ``model`` (its calibrated
        speed and bandwidth over its factor)."""
        factor = factor_of(self.factors, device.device_id, model)
        if factor == 1.0:
            return device
        return dataclasses.replace(
            device, speed=device.speed / factor, memory_gbps=device.memory_gbps / factor
        )

    @staticmethod
    def step(family: str) -> Step:
        """The estimate of a decode step a family's splits are weighed and compared by
        (``libs/core/predict.py``)."""
        if family == "llamacpp":
            return placement_step_ms
        return functools.partial(placement_step_ms, trips=RING_TRIPS_PER_STEP)

    def devices(self, book: DeploymentBook, now: float, moving: str | None = None) -> list[Device]:
        """The fleet as the core sees it; memory held by deployments is not free, except that
        of deployment ``moving`` (being re-placed: its old shards are dropped)."""
        return self.view.devices(
            self.load(now),
            book.reserved_gb(without=moving),
            vram=book.reserved_gb(without=moving, vram=True),
        )

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
            group = [self.corrected(d, model) for d in group]
            options += fit.told_options(
                spec, group, context_length, max_shards, shard_count, told, without,
                self.step(family),
            )  # fmt: skip
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

    def _stages(
        self,
        model: str,
        route: Sequence[tuple[str, int]],
        devices: Mapping[str, Device],
        precision: str | None,
        card: ModelCard | None = None,
    ) -> tuple[ModelSpec, list[Stage]] | None:
        """``model`` as llama.cpp holds it and ``route``'s stages (each device with its
        layers, in pipeline order); None where the model has no card, a device is unknown or
        one runs another engine than llama.cpp's (the predictor is fitted to it)."""
        card = card or self.cards.get(model)
        if card is None or not route or any(d not in devices for d, _ in route):
            return None
        if any(self.family(d) != "llamacpp" for d, _ in route):
            return None
        spec = fit.spec_for(card, "llamacpp", 8, precision)
        return spec, stages_of([devices[d] for d, _ in route], [n for _, n in route])

    def predicted(
        self,
        model: str,
        route: Sequence[tuple[str, int]],
        devices: Mapping[str, Device],
        precision: str | None = None,
        card: ModelCard | None = None,
    ) -> Speed | None:
        """The speed ``route`` (each device with its layers, in pipeline order) is predicted to
        serve ``model`` at: tokens/s at 1 and 8 streams, the time to a first token of 64 and
        the watts (``libs/core/predict.py``, its devices' speeds corrected by what they
        measured); None where ``_stages`` has none."""
        found = self._stages(model, route, devices, precision, card)
        if found is None:
            return None
        guess = predict(*found, (1, 8), prompt_tokens=64, factors=self.factors)
        return Speed(
            tokens_per_s_1=round(guess.tokens_per_s[1], 2),
            tokens_per_s_8=round(guess.tokens_per_s[8], 2),
            ttft_ms=round(guess.ttft_ms, 1),
            watts_1=round(guess.watts[1], 1),
            watts_8=round(guess.watts[8], 1),
        )

    def learn(
        self, deployment: DeploymentState, measured: Speed, devices: Mapping[str, Device]
    ) -> dict[str, float] | None:
        """Correct the factors of ``deployment``'s devices by what it measured at one stream
        (``predict.corrected``): the new factors, or None where it has no prediction."""
        found = self._stages(deployment.model, route_of(deployment), devices, deployment.precision)
        if found is None or measured.tokens_per_s_1 <= 0:
            return None
        spec, stages = found
        at_one = predict(spec, stages, (1,), factors=self.factors).tokens_per_s[1]
        self.factors = corrected(
            self.factors, stages, at_one, measured.tokens_per_s_1, deployment.model
        )
        return self.factors


def route_of(deployment: DeploymentState) -> list[tuple[str, int]]:
    """Its devices in pipeline order, each with its layer count."""
    ordered = sorted(deployment.assignments, key=lambda a: a.shard_index)
    return [(a.device_id, a.layer_end - a.layer_start) for a in ordered]
