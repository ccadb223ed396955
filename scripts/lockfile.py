"""Pure logic behind scripts/lock and scripts/check-newest: reading the pins of a lock (a `uv pip compile`
requirements file), comparing two locks, and the project's requirements with their upper bounds lifted."""

from __future__ import annotations

import re
from collections.abc import Iterable

from packaging.requirements import Requirement

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;#]+)")


def normalize(name: str) -> str:
    """A distribution name as the package index compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(text: str) -> dict[str, str]:
    """{name: version} of every `name==version` line of a lock (markers and comments ignored). A package pinned
    twice under different markers is kept at the first version; the lock is made with one version a package."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        match = _PIN.match(line.strip())
        if match:
            pins.setdefault(normalize(match.group(1)), match.group(3))
    return pins


def changed_pins(locked: dict[str, str], newest: dict[str, str]) -> list[tuple[str, str | None, str | None]]:
    """(name, locked version, newest version) for every package whose version differs, or that only one side
    has, sorted by name."""
    names = sorted(set(locked) | set(newest))
    return [(n, locked.get(n), newest.get(n)) for n in names if locked.get(n) != newest.get(n)]


def lift_upper_bounds(requirements: Iterable[str], keep: Iterable[str] = ()) -> list[str]:
    """The requirements with their `<`, `<=` and `==` bounds removed (the lower bounds and markers kept), except
    for the packages named in `keep`: what the newest releases on the registry would be, beyond what was checked."""
    kept = {normalize(name) for name in keep}
    lifted = []
    for text in requirements:
        req = Requirement(text)
        if normalize(req.name) not in kept:
            req.specifier = type(req.specifier)(
                ",".join(str(s) for s in req.specifier if s.operator not in ("<", "<=", "==", "~=", "==="))
            )
        lifted.append(str(req))
    return lifted


def freeze_matches(lock: dict[str, str], frozen: dict[str, str]) -> list[str]:
    """Packages installed at another version than the lock names (`uv pip freeze` against the lock): what a fresh
    install must never show. Packages the lock names but that are not installed (another platform's, another
    extra's) do not count."""
    return [
        f"{n}: locked {v}, installed {frozen[n]}" for n, v in sorted(lock.items()) if n in frozen and frozen[n] != v
    ]
