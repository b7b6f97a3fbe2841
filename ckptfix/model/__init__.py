"""The data model: the records the reader makes (``refs``), THE walk over a tree (``walk``),
dotted paths (``paths``), what a state dict looks like (``statedicts``), dtypes (``dtypes``)
and a tensor's bytes in C order (``data``).

No pickle protocol and no file formats here: those sit above, in ``pickling`` and ``formats``.
"""
