"""The scheduler: live placements in decision cycles, migration, checkpoints, modes."""
