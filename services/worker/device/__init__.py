"""What every worker shares, whatever runs the model: the device it stands for and its
shard-task consumer (``worker.py``), metrics, GPU readings, the refusal of an engine of token
ids, and what an engine run as a process of its own needs (``processes.py``)."""
