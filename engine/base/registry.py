"""A small typed registry: names to plug-ins, refusing duplicates and listing names in errors.

Policies, workloads and executors each have one (mini-sglang's registry pattern): a module
registers itself with a decorator at import time, the CLI lists `names()` in its errors and the
tuner iterates them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from engine.base.errors import unknown_choice

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `@POLICIES.register("gllm")`. A second registration of a name is an error."""

        def wrap(obj: T) -> T:
            self.add(name, obj)
            return obj

        return wrap

    def add(self, name: str, obj: T) -> None:
        if not name or not isinstance(name, str):
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._items:
            raise ValueError(f"duplicate {self.kind} name {name!r}: already registered as {self._items[name]!r}")
        self._items[name] = obj

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise unknown_choice(self.kind, name, self._items) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)
