"""Whether a path names a remote object (an fsspec URL) rather than a local file: the one test,
kept apart so local reads (ranges, detect) ask it without importing the remote machinery."""

from __future__ import annotations

import re

#: a scheme of two or more letters (then letters, digits, + . -) and "://": Windows drive
#: letters ("C:\\x") and plain names never match
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+://")


def is_url(path: object) -> bool:
    """Whether ``path`` names a remote location (``s3://``, ``https://``, ``file://``...)."""
    return isinstance(path, str) and "://" in path and _URL.match(path) is not None
