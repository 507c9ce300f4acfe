"""`bench/default_run_range.py`: the table of the default run's seeds x device counts and its verdict (the README's
range comes from it), on summaries made here; and a finished run is read, not rerun."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import default_run_range  # noqa: E402


def _summary(start, evals, greedy=(0.5, 0.6), wall=100.0):
    return dict(warmstart_accuracy=start, final_accuracy=evals[-1], warmstart_greedy_accuracy=greedy[0],
                final_greedy_accuracy=greedy[1], wall_seconds=wall,
                evaluations=[dict(eval_accuracy=a) for a in (start, *evals)])


def test_the_table_gives_each_gain_and_the_ranges():
    lines, ok = default_run_range.table({(0, 1): _summary(0.5, [0.55, 0.625]), (1, 8): _summary(0.25, [0.4])},
                                        min_gain=0.10)
    assert ok
    assert lines[2] == "| 0 | 1 | 0.5000 | 0.5500 / 0.6250 | **+0.1250** | 0.500 → 0.600 | 100 |"
    assert lines[-1] == ("2 runs: warm start 0.2500-0.5000, gain +0.1250 to +0.1500 (mean +0.1375); "
                         "every gain >= 0.1: yes")


def test_a_small_gain_or_a_failed_run_fails_the_verdict():
    lines, ok = default_run_range.table({(0, 1): _summary(0.5, [0.55]), (1, 1): _summary(0.5, [0.7])}, 0.10)
    assert not ok and lines[-1].endswith("every gain >= 0.1: NO")
    lines, ok = default_run_range.table({(0, 1): {}, (1, 1): _summary(0.5, [0.7])}, 0.10)
    assert not ok and "| 0 | 1 | failed | | | | |" in lines


def test_a_finished_run_is_read_not_rerun(tmp_path, capsys):
    os.makedirs(tmp_path / "seed3_dev8")
    (tmp_path / "seed3_dev8" / "summary.json").write_text(json.dumps(_summary(0.4, [0.45, 0.55])))
    assert default_run_range.main([f"--out={tmp_path}", "--seeds=3", "--devices=8"]) == 0
    assert "| 3 | 8 | 0.4000 | 0.4500 / 0.5500 | **+0.1500** |" in capsys.readouterr().out
    assert default_run_range.main([f"--out={tmp_path}", "--seeds=3", "--devices=8", "--min_gain=0.2"]) == 1
