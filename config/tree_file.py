"""Deprecated module: its names moved (``config/moved.py`` says where). Importing one from here still works, with a
``DeprecationWarning`` naming its new module."""

from config.moved import forward as _forward

__all__: list[str] = []


def __getattr__(name: str):
    return _forward(__name__, name)
