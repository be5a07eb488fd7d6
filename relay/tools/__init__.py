"""The tools wing: what exists to demonstrate, test against or measure the relay.

Nothing in the production wing (`relay/*` outside this package) imports it; a test walks the
imports to keep it so (tests/test_layout.py). Its dependencies are extras, not the core install:

| module | extra |
|---|---|
| `relay.tools.sink` (the reference ingress, `relay sink`) | `ledger-relay[sink]` |
| `relay.tools.demo` (`relay demo`), `embedded`, `absurd` | `ledger-relay[demo]` |
| `relay.tools.bench` (`relay bench`) | `ledger-relay[bench]` |
"""
