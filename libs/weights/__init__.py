"""A model's weights moved between hosts: the cluster's object store (``object_store``: the
bucket, each model's layer index, this host's fetch locks), whole files put into it and fetched
from it (``whole_files``, read lean by ``bulk_fetch``), a torch shard's layer range
(``layer_ranges``), files lent from a device that holds them (``lending``, the asker's half in
``borrowing`` and ``stripes``) and what this host holds (``local_files``)."""
