"""Bytes and files: byte ranges and copies (``ranges``), the zip container torch uses
(``ziparchive``), atomic outputs (``atomic``), strict JSON (``strictjson``) and sizes (``sizes``).

The bottom layer: it knows nothing of tensors, pickles or checkpoint formats.
"""
