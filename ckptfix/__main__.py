"""``python -m ckptfix``: the same as the ``ckptfix`` command."""

from .cli import main

if __name__ == "__main__":
    main()
