"""Name -> policy class registry (one registry for every policy kind)."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

_REGISTRY: dict[str, type[Any]] = {}

T = TypeVar("T")


def register(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: make a policy available under ``name``.

    The class's ``kind`` attribute (``instance``, ``route``, ``admission``;
    default ``instance``) says where it may be configured.

    Raises:
        ValueError: ``name`` is already registered to another class.
    """

    def deco(cls: type[T]) -> type[T]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"policy {name!r} registered twice")
        _REGISTRY[name] = cls
        return cls

    return deco


def policy_kind(cls: type[Any]) -> str:
    return str(getattr(cls, "kind", "instance"))


def available_policies(kind: str | None = None) -> dict[str, type[Any]]:
    """Registered policies by name (a copy), optionally only those of ``kind``."""
    return {n: c for n, c in _REGISTRY.items() if kind is None or policy_kind(c) == kind}


def create_policy(name: str, **kwargs: Any) -> Any:
    """Instantiate the policy registered as ``name``.

    Raises:
        KeyError: unknown policy name.
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; available: {sorted(_REGISTRY)}") from None
    return cls(**kwargs)
