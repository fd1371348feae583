"""Tensor parallelism: the rank's group and its collectives (``state``), how heads, KV heads,
the MLP and the vocabulary split over ranks (``layout``), the sharded layers (``layers``), the
step message rank 0 sends (``step_channel``) and the worker processes rank 0 starts (``workers``; their main is ``engine/tp_worker.py``)."""
