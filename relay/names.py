"""Names the relay builds SQL identifiers and channels from, validated once (DESIGN §3).

A leaf module: settings, the producer helper and migrations all check schema names here, so
none of them has to import another just for a regular expression."""

from __future__ import annotations

import re

SCHEMA_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,53}$")


def validate_schema_name(name: str) -> str:
    """Schema names are plain lowercase identifiers (the terminal channel is `<schema>_terminal`,
    which must fit PostgreSQL's 63-byte identifier limit)."""
    if not SCHEMA_NAME_RE.fullmatch(name) or name.startswith("pg_"):
        raise ValueError(
            f"schema {name!r} is not valid: use 1-54 characters of a-z, 0-9 and _, "
            "not starting with a digit or pg_"
        )
    return name
