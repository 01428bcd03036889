"""The pure scheduling core: capability model, DWPS, energy-aware plugins, partitioning,
classic policies, migration planning and the exact reference solver.

Nothing here does I/O; time (``now``) and randomness (``rng``) are passed in. The live
scheduler service and the simulator both drive these same objects.
"""
