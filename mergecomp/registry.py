"""One registry class shared by compressors, memories, communicators and schedulers.

A registry maps a short name (``"topk"``) to a class.  Built-in components register
themselves with the :meth:`Registry.register` class decorator; third-party packages
register through a setuptools entry-point group (``mergecomp.compressors`` and so on),
which is read the first time a name is looked up and not found.

Every registry is also listed here by kind (:func:`registry_of`), so that a module below the
component packages (:mod:`mergecomp.plan`, which checks that a ``"compress:<name>"`` send mode
names a registered communicator) can look a name up without importing the package that fills
the registry.  ``import mergecomp`` imports every built-in component package, so the built-ins
are registered before any plan is checked.
"""
from __future__ import annotations

import difflib
import inspect
from importlib import metadata
from typing import Callable, Dict, List, Type


#: Every registry made, by kind (``"communicator"``).
_REGISTRIES: Dict[str, "Registry"] = {}


def registry_of(kind: str) -> "Registry":
    """The registry of components of ``kind`` (``"compressor"``, ``"memory"``,
    ``"communicator"``, ``"scheduler"``)."""
    try:
        return _REGISTRIES[kind]
    except KeyError:
        raise ValueError(f"no {kind} registry: known kinds are {sorted(_REGISTRIES)} "
                         f"(import mergecomp first)") from None


class Registry:
    """Name → class table for one kind of component.

    ``kind`` is used in messages ("compressor"), ``base`` is the class every entry must
    subclass, ``entry_point_group`` is where plugins are discovered.
    """

    def __init__(self, kind: str, base: type, entry_point_group: str):
        self.kind = kind
        self.kinds = kind[:-1] + "ies" if kind.endswith("y") else kind + "s"  # "memories"
        self.base = base
        self.entry_point_group = entry_point_group
        self._classes: Dict[str, type] = {}
        self._plugins_loaded = False
        _REGISTRIES[kind] = self

    def register(self, name: str, *aliases: str) -> Callable[[Type], Type]:
        """Class decorator: ``@compressors.register("topk")``.

        Registering a second class under a taken name raises, so a plugin cannot silently
        shadow a built-in component.
        """

        def decorator(cls: Type) -> Type:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(
                    f"cannot register {cls!r} as a {self.kind}: it must be a subclass of "
                    f"{self.base.__module__}.{self.base.__name__}")
            for key in (name, *aliases):
                if not isinstance(key, str) or not key:
                    raise ValueError(f"{self.kind} names must be non-empty strings, got {key!r}")
                existing = self._classes.get(key)
                if existing is not None and existing is not cls:
                    raise ValueError(
                        f"{self.kind} name {key!r} is already registered to "
                        f"{existing.__module__}.{existing.__qualname__}; choose another name")
                self._classes[key] = cls
            if "name" not in cls.__dict__:
                cls.name = name
            return cls

        return decorator

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for entry in metadata.entry_points(group=self.entry_point_group):
            if entry.name in self._classes:
                continue
            cls = entry.load()
            self.register(entry.name)(cls)

    def get(self, name: str) -> type:
        """The class registered under ``name``; ValueError with the closest match if none."""
        if name not in self._classes:
            self._load_plugins()
        try:
            return self._classes[name]
        except KeyError:
            names = self.available()
            close = difflib.get_close_matches(str(name), names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"unknown {self.kind} {name!r}: {hint}available {self.kinds} are "
                f"{', '.join(names)}") from None

    def create(self, name: str, **kwargs):
        """Instantiate the component registered under ``name`` with ``kwargs``."""
        cls = self.get(name)
        self.check_options(name, kwargs)
        try:
            return cls(**kwargs)
        except TypeError as error:
            raise TypeError(f"cannot create {self.kind} {name!r} with {kwargs}: {error}") from None

    def check_options(self, name: str, kwargs, supplied=()) -> None:
        """Refuse a keyword the class registered under ``name`` does not take, naming the
        ones it does (a class that takes ``**kwargs`` is not checked); the ``supplied``
        keywords are the caller's own to pass, so the user may not."""
        cls = self.get(name)
        try:
            parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
        except (TypeError, ValueError):  # no signature to read (a C-level __init__)
            return
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return
        accepted = [p.name for p in parameters if p.name not in supplied and p.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
        unknown = [key for key in kwargs if key not in accepted]
        if unknown:
            close = {key: difflib.get_close_matches(key, accepted, n=1) for key in unknown}
            hints = "".join(f" ({key!r}: did you mean {match[0]!r}?)" for key, match in close.items() if match)
            takes = f"its options are {', '.join(accepted)}" if accepted else "it takes none"
            raise TypeError(f"{self.kind} {name!r} takes no option {', '.join(map(repr, unknown))}{hints}; {takes}")

    def available(self) -> List[str]:
        """Every registered name, sorted (plugins included)."""
        self._load_plugins()
        return sorted(self._classes)

    def __contains__(self, name: str) -> bool:
        try:
            self.get(name)
        except ValueError:
            return False
        return True
