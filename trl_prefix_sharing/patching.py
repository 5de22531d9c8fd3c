"""Reversible patches of one object's attribute (a model instance's `forward` or `generate`), never its class: the
instance's own value, or None where it had none (the class's applies), is kept in its `__dict__` under a key of the
patch, with the patch itself, and put back from there.

A patch that something else has wrapped since (accelerate's mixed-precision wrapper around a model's `forward`, put
there when the trainer prepares the model) cannot be taken out without dropping that wrapper too: it stays beneath it,
and the caller is told so (every patch of this package passes its calls through unchanged when it is not asked for
prefix sharing)."""

from __future__ import annotations


_PATCH = ":patch"


def keep_own(obj, name: str, key: str) -> None:
    """Remember `obj`'s own `name` (None: it has none) under `key`, before a patch replaces it."""
    obj.__dict__[key] = obj.__dict__.get(name)


def mark_patched(obj, name: str, key: str) -> None:
    """Record `obj`'s current `name` as the patch remembered under `key` (after `keep_own` and the patch)."""
    obj.__dict__[key + _PATCH] = obj.__dict__.get(name)


def patch_own(obj, name: str, key: str, value) -> None:
    """Replace `obj`'s `name` by `value` on this instance, remembering its own value under `key`."""
    keep_own(obj, name, key)
    setattr(obj, name, value)
    mark_patched(obj, name, key)


def patch_of(obj, key: str):
    """The patch remembered under `key` (None: not patched), wherever it now sits."""
    return obj.__dict__.get(key + _PATCH)


def is_patched(obj, key: str) -> bool:
    return key in obj.__dict__


def put_back_own(obj, name: str, key: str) -> bool:
    """Undo a patch of `name` remembered under `key` where it is still `name`'s value. Returns False when something
    has wrapped the patch since (it then stays, beneath that wrapper); True when `obj` is free of it."""
    if key not in obj.__dict__:
        return True
    if (key + _PATCH) in obj.__dict__ and obj.__dict__.get(name) is not obj.__dict__[key + _PATCH]:
        return False
    own = obj.__dict__.pop(key)
    obj.__dict__.pop(key + _PATCH, None)
    if own is None:
        obj.__dict__.pop(name, None)
    else:
        setattr(obj, name, own)
    return True
