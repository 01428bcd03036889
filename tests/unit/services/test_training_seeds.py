"""A training run's initial weights are its seed's alone, however many runs a batch worker's
threads start at once (``services/batch/training.py``: torch draws them from one global
generator)."""

from __future__ import annotations

import threading

from services.batch.training import make_model, weights_digest


def test_runs_started_side_by_side_draw_the_weights_of_their_own_seeds() -> None:
    alone = {seed: weights_digest(make_model(seed)) for seed in range(4)}
    start = threading.Barrier(4)
    found: dict[int, set[str]] = {seed: set() for seed in range(4)}

    def run(seed: int) -> None:
        start.wait()
        for _ in range(200):
            found[seed].add(weights_digest(make_model(seed)))

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert found == {seed: {digest} for seed, digest in alone.items()}
