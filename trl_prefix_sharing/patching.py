"""Reversible patches of one object's attribute (a model instance's `forward` or `generate`), never its class: the
instance's own value, or None where it had none (the class's applies), is kept in its `__dict__` under a key of the
patch, and put back from there."""

from __future__ import annotations


def keep_own(obj, name: str, key: str) -> None:
    """Remember `obj`'s own `name` (None: it has none) under `key`, before a patch replaces it."""
    obj.__dict__[key] = obj.__dict__.get(name)


def put_back_own(obj, name: str, key: str) -> None:
    """Undo a patch of `name` remembered by `keep_own` under `key`; nothing if there is none."""
    if key not in obj.__dict__:
        return
    own = obj.__dict__.pop(key)
    if own is None:
        obj.__dict__.pop(name, None)
    else:
        setattr(obj, name, own)
