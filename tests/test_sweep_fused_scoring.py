"""scripts/sweep_fused_scoring.py on the CPU, the kernel under Triton's interpreter: one
row an event and kind of keys, a time for the rule's path and for every tile, and the
kernel's shipped tiles and compaction's choice of scorer back as they were."""
from __future__ import annotations

import pytest

from minisparse.engine import compaction
from triton_interpreter import import_interpreted


def test_sweep_times_every_tile_and_restores_the_shipped_ones(capsys):
    pytest.importorskip("triton")
    import_interpreted("minisparse.compression.triton_redundancy")
    ts = import_interpreted("minisparse.engine.triton_scores")
    from scripts import sweep_fused_scoring as sweep

    shipped, choose = dict(ts._TILES), compaction.fused_scorer
    sweep.main(["--device", "cpu", "--model", "tiny", "--events", "48x2,64x3", "--repeats",
                "1", "--tiles", "16,16,16,4,1", "--tiles", "32,32,32,4,0"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("| keys | entries x sequences | rule | (16, 16, 16, 4, True) | "
                        "(32, 32, 32, 4, False) |")
    rows = [line.split(" | ") for line in lines[3:]]
    assert [(r[0], r[1]) for r in rows] == [("| random", "48 x 2"), ("| random", "64 x 3"),
                                            ("| shared", "48 x 2"), ("| shared", "64 x 3")]
    assert all(float(x.rstrip(" |")) > 0 for r in rows for x in r[2:])
    assert ts._TILES == shipped and compaction.fused_scorer is choose
