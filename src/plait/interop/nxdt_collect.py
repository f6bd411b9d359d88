"""Bookkeeping of an NxDT import: which NxDT key became which plait field, and which did not.

Every leaf key of the NxDT configuration ends up in exactly one :class:`Entry`: mapped (with the
plait fields it sets), ignored (with the reason it does not matter to plait) or not mapped (with
the reason plait cannot express it). Keys no handler looked at are reported as not mapped at
the end (:meth:`Collector.finish`), so the report is complete by construction rather than by
keeping a list of known keys in sync.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from plait.config.schema import SECTIONS

Kind = Literal["mapped", "ignored", "not mapped"]
_MISSING = object()


@dataclass
class Entry:
    """One NxDT key (dotted path) and what became of it."""

    key: str
    kind: Kind
    value: Any
    fields: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


def leaf_keys(data: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted paths of the values of ``data`` that are not mappings (an empty mapping counts as one)."""
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from leaf_keys(value, path + ".")
        else:
            yield path


class Collector:
    """The entries of one import and the recipe fields they set (the last setter of a field wins)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = config
        self.entries: list[Entry] = []
        self._consumed: set[str] = set()
        self._owner: dict[str, Entry] = {}

    # ------------------------------------------------------------------ reading the NxDT config
    def get(self, key: str, default: Any = None) -> Any:
        """The value at dotted ``key`` (``default`` when a part is missing)."""
        node: Any = self.config
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node

    def has(self, key: str) -> bool:
        return self.get(key, _MISSING) is not _MISSING

    def section(self, key: str) -> Mapping[str, Any]:
        """The mapping at ``key`` (empty when absent or not a mapping)."""
        value = self.get(key)
        return value if isinstance(value, Mapping) else {}

    def done(self, key: str) -> bool:
        """True when ``key`` (or a mapping above it) already has an entry."""
        parts = key.split(".")
        return any(".".join(parts[:i]) in self._consumed for i in range(1, len(parts) + 1))

    # ------------------------------------------------------------------ recording
    def _add(self, key: str, kind: Kind, value: Any, fields: dict[str, Any], reason: str) -> Entry:
        entry = Entry(key, kind, value, dict(fields), reason)
        self._consumed.add(key)
        self.entries.append(entry)
        return entry

    def map(self, key: str, fields: dict[str, Any], note: str = "", value: Any = _MISSING) -> Entry:
        """Record that ``key`` sets the plait ``fields`` (``{"section.field": value}``).

        A field set earlier by another key is taken over; that key is then reported as
        overridden (e.g. a ``model_config`` value overridden by the same key written inline).
        """
        entry = self._add(key, "mapped", self.get(key) if value is _MISSING else value, fields, note)
        for name in fields:
            previous = self._owner.get(name)
            if previous is not None and previous is not entry:
                del previous.fields[name]
                if not previous.fields:
                    previous.kind, previous.reason = "ignored", f"overridden by {key}"
            self._owner[name] = entry
        return entry

    def ignore(self, key: str, reason: str) -> Entry:
        """Record that ``key`` does not matter to plait, and why."""
        return self._add(key, "ignored", self.get(key), {}, reason)

    def unmap(self, key: str, reason: str, value: Any = _MISSING) -> Entry:
        """Record that ``key`` could not be expressed in a plait recipe, and why."""
        return self._add(key, "not mapped", self.get(key) if value is _MISSING else value, {}, reason)

    def drop(self, entry: Entry, reason: str) -> None:
        """Withdraw every field ``entry`` set (its value is not valid for plait) and report why."""
        for name in entry.fields:
            if self._owner.get(name) is entry:
                del self._owner[name]
        entry.kind, entry.reason, entry.fields = "not mapped", reason, {}

    def owner(self, name: str) -> Entry | None:
        """The entry that sets the plait field ``name``, if any."""
        return self._owner.get(name)

    def value(self, name: str, default: Any = None) -> Any:
        """The value the import gives the plait field ``name`` so far."""
        entry = self._owner.get(name)
        return entry.fields[name] if entry is not None else default

    def finish(self) -> None:
        """Report every leaf key no handler looked at as not mapped."""
        for key in leaf_keys(self.config):
            if not self.done(key):
                self.unmap(key, "no plait equivalent is known")

    def recipe(self) -> dict[str, dict[str, Any]]:
        """The plait recipe data the mapped entries describe, in the schema's section and field order."""
        out: dict[str, dict[str, Any]] = {}
        for section, cls in SECTIONS.items():
            values = {name: self.value(f"{section}.{name}") for name in cls.model_fields
                      if f"{section}.{name}" in self._owner}
            if values:
                out[section] = values
        extra = [name for name in self._owner if name.split(".")[0] not in SECTIONS
                 or name.split(".")[1] not in SECTIONS[name.split(".")[0]].model_fields]
        for name in extra:  # a field this plait does not have: validation reports it, and it is dropped
            section, _, rest = name.partition(".")
            out.setdefault(section, {})[rest] = self.value(name)
        return out
