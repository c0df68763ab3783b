"""Name -> function registries, so configs pick an estimator or loss by name and users can add
their own (`ADVANTAGE_ESTIMATORS.register("mine")(fn)`) without touching the trainer."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

Fn = TypeVar("Fn", bound=Callable)


class Registry(Generic[Fn]):
    """A named collection of functions of one kind."""

    def __init__(self, kind: str):
        self.kind = kind
        self._functions: dict[str, Fn] = {}

    def register(self, name: str) -> Callable[[Fn], Fn]:
        """Decorator adding a function under `name` (a name can be registered once)."""
        def add(function: Fn) -> Fn:
            if name in self._functions and self._functions[name] is not function:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._functions[name] = function
            return function
        return add

    def get(self, name: str) -> Fn:
        if name not in self._functions:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {sorted(self._functions)}")
        return self._functions[name]

    def names(self) -> list[str]:
        return sorted(self._functions)

    def name_errors(self, field: str, name: str) -> list[str]:
        """The config error of `field` naming `name` when it is not registered (else none)."""
        if name in self._functions:
            return []
        return [f"{field}={name!r} is not a known {self.kind}; known: {', '.join(self.names())}"]
