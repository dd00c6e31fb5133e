"""Name -> class registries (attention variants, output layers), one implementation."""

from __future__ import annotations

import contextlib


class Registry:
    """`register(name)` decorates a class; `get(name)` fails with the valid names listed."""

    def __init__(self, kind: str):
        self.kind = kind  # "attention variant", "output layer": used in messages
        self._classes: dict[str, type] = {}

    def register(self, name: str):
        def wrap(cls):
            if name in self._classes:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            cls.registry_name = name
            self._classes[name] = cls
            return cls

        return wrap

    @contextlib.contextmanager
    def registered(self, name: str, cls: type):
        """`cls` under `name` for the duration of a `with` block only (a benchmark's bound
        row, say), then gone from `names()` again."""
        self.register(name)(cls)
        try:
            yield cls
        finally:
            del self._classes[name]

    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str) -> type:
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {self.names()}") from None
