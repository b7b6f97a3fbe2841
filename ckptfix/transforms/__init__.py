"""Tree in, new tree out: prefixes and renames (``prefix``), ``--drop/--keep``/prune
(``select``), ``--sanitize``, device remapping (``devices``), ``--dtype`` (``cast``), storage
compaction before a .pth write (``compact``) and fitting to a model (``fit``).

Pure: nothing here reads or writes files; the pipeline does.
"""
