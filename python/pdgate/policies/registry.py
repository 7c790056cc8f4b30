"""Name -> policy class registry."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

_REGISTRY: dict[str, type[Any]] = {}

T = TypeVar("T")


def register(name: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: make a policy available under ``name``.

    Raises:
        ValueError: ``name`` is already registered to another class.
    """

    def deco(cls: type[T]) -> type[T]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"policy {name!r} registered twice")
        _REGISTRY[name] = cls
        return cls

    return deco


def available_policies() -> dict[str, type[Any]]:
    """All registered policies by name (a copy)."""
    return dict(_REGISTRY)


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
