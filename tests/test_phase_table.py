"""scripts/phase_table.py: each rollout's phase times and memory, read through the plots'
metrics reader (rollout order, a torn last line skipped), from a run folder or its file."""
import json

from scripts import phase_table


def test_rows_in_rollout_order_from_the_folder_or_the_file(tmp_path, capsys):
    rows = [{"rollout": r, "time/rollout_s": 2.0 * r, "mem/rollout_peak_gib": 1.5,
             "mismatch/kl": 0.25 * r} for r in (2, 1)]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"rollout": 3, "time/ro')
    assert phase_table.main([str(tmp_path), "--prefix", "mismatch/"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("---")] == [
        "--- rollout 1: phase times (s), GPU memory (GiB)",
        "--- rollout 2: phase times (s), GPU memory (GiB)"]
    assert "rollout              2.00     1.50      nan       nan" in out
    assert out.splitlines()[-1].split() == ["mismatch/kl", "0.5"]
    assert phase_table.main([str(tmp_path / "metrics.jsonl")]) == 0
    assert capsys.readouterr().out.count("--- rollout") == 2


def test_a_folder_without_metrics_is_one_line_and_exit_2(tmp_path, capsys):
    assert phase_table.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"phase_table: {tmp_path}: no metrics.jsonl (not a "
                                       "run's output_dir, or not started yet)\n")
