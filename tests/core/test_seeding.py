"""agentrl.seeding.derive_seed: the one seed derivation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agentrl.seeding import derive_seed


def test_the_same_parts_give_the_same_seed_in_every_process():
    code = "from agentrl.seeding import derive_seed; print(derive_seed(7, 'eval', 3))"
    seen = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": salt}).stdout.strip()
        for salt in ("1", "2", "random")
    }
    assert seen == {str(derive_seed(7, "eval", 3))}


def test_seeds_differ_by_every_part_and_by_order():
    seeds = {derive_seed(0, p, s, t) for p in range(8) for s in range(8) for t in range(8)}
    assert len(seeds) == 512 and all(0 <= x < 2**31 for x in seeds)
    assert derive_seed(1, 2) != derive_seed(2, 1) and derive_seed(1, "2") != derive_seed(1, 2)


@pytest.mark.parametrize("bad", [(), (1.5,), (True,), (None,)])
def test_only_ints_and_strings(bad):
    with pytest.raises(TypeError, match="ints and strings"):
        derive_seed(*bad)
