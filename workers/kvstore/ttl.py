"""How long a stored block lives after its last access, per traffic class, held as plain data.

The policy is a value, not code: admins will edit it in the control plane and push it to workers,
so it round-trips through JSON (`from_dict`/`to_dict`, `from_json`/`to_json`) and validates itself
on every construction and decode, so a bad edit fails where it is made, not in a GC run hours later.
The GC reads the policy at each run (`GarbageCollector.set_ttl_policy`), and expiry is computed
from `last_access` at that time, so an edited TTL applies to blocks already stored.

A block of a class the policy does not name gets the default class's TTL: a worker may store a
class before the policy that names it arrives, and such blocks must still expire.
"""

import math
from collections.abc import Mapping
from typing import Any

import msgspec

DAY_S = 86_400.0


def _default_ttl_s() -> dict[str, float]:
    # Agent loops re-send their prefixes within minutes or not at all; chat users come back days later.
    return {"agent": 3 * DAY_S, "chat": 7 * DAY_S}


class TTLPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """TTL in seconds per traffic class, plus the class whose TTL applies to unnamed classes.

    Treat `ttl_s` as read-only: change a policy by building a new one, so a GC run in progress
    keeps the policy it started with.
    """

    ttl_s: dict[str, float] = msgspec.field(default_factory=_default_ttl_s)
    default_class: str = "chat"

    def __post_init__(self) -> None:
        for name, ttl in self.ttl_s.items():
            if not name.strip():
                raise ValueError("traffic class names must be non-empty")
            if not (math.isfinite(ttl) and ttl > 0):
                raise ValueError(f"TTL of traffic class {name!r} must be a positive number of seconds, got {ttl}")
        if self.default_class not in self.ttl_s:
            known = ", ".join(sorted(self.ttl_s)) or "none"
            raise ValueError(f"default class {self.default_class!r} has no TTL (classes: {known})")

    def ttl_for(self, traffic_class: str) -> float:
        """Seconds a block of `traffic_class` lives after its last access."""
        ttl = self.ttl_s.get(traffic_class)
        return self.ttl_s[self.default_class] if ttl is None else ttl

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TTLPolicy":
        """Decode and validate, e.g. `{"ttl_s": {"chat": 604800}, "default_class": "chat"}`.

        Raises msgspec.ValidationError (a ValueError) naming the bad field.
        """
        return msgspec.convert(data, cls)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> "TTLPolicy":
        return msgspec.json.decode(data, type=cls)

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)
