"""Standard Webhooks signature verification, the rules the relay signs by (DESIGN §5).

The HMAC itself is the production signer's (`relay.edges.ingress.signature`): one definition of what
a signature is, so the reference ingress cannot drift from the relay.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Iterable, Sequence

from relay.edges.ingress import signature as webhook_signature
from relay.settings import Secret

SIGNATURE_TOLERANCE = 300.0  # seconds either side of now, as in the Standard Webhooks libraries


def signing_keys(secrets: Iterable[str | Secret]) -> tuple[bytes, ...]:
    """The HMAC keys of `whsec_...` secrets (the prefix is optional, as in the reference
    libraries); raises ValueError on a secret that is not base64."""
    keys = []
    for secret in secrets:
        text = secret.reveal() if isinstance(secret, Secret) else secret
        try:
            key = base64.b64decode(text.strip().removeprefix("whsec_"), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("a signing secret must be whsec_ followed by base64") from None
        if not key:
            raise ValueError("a signing secret must not be empty")
        keys.append(key)
    return tuple(keys)


def verify_signature(
    keys: Sequence[bytes], headers: dict[str, str], body: bytes, now: float, tolerance: float
) -> str | None:
    """Standard Webhooks verification, the rules `relay.edges.ingress.sign` signs by: the three
    `webhook-*` headers present, the timestamp within `tolerance` seconds of `now`, and any
    `v1,` signature of the space-separated list equal (constant-time) to the HMAC-SHA256 of
    `{id}.{timestamp}.{body}` under any key. Returns None when it verifies, else the reason."""
    msg_id = headers.get("webhook-id")
    stamp = headers.get("webhook-timestamp")
    given = headers.get("webhook-signature")
    if not msg_id or not stamp or not given:
        return "missing_headers"
    try:
        timestamp = int(stamp.strip())
    except ValueError:
        return "bad_timestamp"
    if abs(now - timestamp) > tolerance:
        return "timestamp_out_of_tolerance"
    expected = [webhook_signature(key, msg_id, timestamp, body) for key in keys]
    ok = False
    for item in given.split():
        version, _, signature = item.partition(",")
        if version != "v1":
            continue
        candidate = signature.encode("utf-8", "surrogatepass")
        for want in expected:
            # No early exit: every comparison runs, so timing says nothing about which matched.
            ok |= hmac.compare_digest(candidate, want)
    return None if ok else "bad_signature"
