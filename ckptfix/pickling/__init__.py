"""The pickle protocol, both directions: the opcode VM and its budgets (``vm``), the restricted
reader and its allow-list (``reader``), record-don't-build mode for ``scan`` (``recording``),
the writer (``writer``) and the names a global may have (``names``).
"""
