"""The planted bugs of scripts/mutants.py stay plantable: each one's text is where it says, once.

An edit that moves or re-indents a guarded line would otherwise only show when `.ci/run` runs
the mutants (the bounded subset) or someone runs them all.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mutants() -> list[object]:
    spec = importlib.util.spec_from_file_location("relay_mutants", ROOT / "scripts" / "mutants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["relay_mutants"] = module
    spec.loader.exec_module(module)
    return list(module.MUTANTS)


MUTANTS = _mutants()


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)  # type: ignore[attr-defined]
def test_each_mutants_text_is_in_its_file_exactly_once(mutant: object) -> None:
    path, old = mutant.path, mutant.old  # type: ignore[attr-defined]
    assert (ROOT / path).read_text().count(old) == 1, f"{path}: {old!r}"


def test_mutant_names_are_unique_and_each_names_its_tests() -> None:
    names = [m.name for m in MUTANTS]  # type: ignore[attr-defined]
    assert len(names) == len(set(names))
    for m in MUTANTS:
        assert m.tests, m.name  # type: ignore[attr-defined]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)  # type: ignore[attr-defined]
def test_each_mutants_tests_exist(mutant: object) -> None:
    """A renamed or removed test would otherwise show only as a red baseline of a mutant run."""
    for target in mutant.tests:  # type: ignore[attr-defined]
        path, _, node = target.partition("::")
        assert (ROOT / path).is_file(), target
        if node:
            name = node.split("::")[-1].split("[")[0]
            assert re.search(rf"^(async )?def {name}\(", (ROOT / path).read_text(), re.M), target
