"""Read-only views of checkpoints: ``inspect``, ``diff``, ``verify`` and ``scan``. They return
records (and a ``render`` for humans); they never write a checkpoint.
"""
