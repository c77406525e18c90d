import json

from minisparse.trainer.logger import MetricsLogger, reduce_metrics, summary_legend, summary_line


def test_jsonl_rows_and_drop_after(tmp_path):
    log = MetricsLogger(tmp_path, {}, None, tensorboard=True, wandb=False, wandb_project="x")
    for r in (1, 2, 3):
        log.log(r, {"rollout/reward_mean": r / 10})
    log.drop_after(2)
    log.log(3, {"rollout/reward_mean": 0.9})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["rollout"], r["rollout/reward_mean"]) for r in rows] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.9),
    ]
    assert any((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_drop_after_skips_a_torn_last_line(tmp_path):
    """A run killed in the middle of a write leaves half a row; resume drops it."""
    log = MetricsLogger(tmp_path, {}, None, tensorboard=False, wandb=False, wandb_project="x")
    for r in (1, 2):
        log.log(r, {"a": float(r)})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"rollout": 3, "a": 3.')
    log.drop_after(2)
    log.log(3, {"a": 30.0})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["rollout"], r["a"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert not list(tmp_path.glob("*.tmp"))


def test_disabled_logger_writes_nothing(tmp_path):
    log = MetricsLogger(
        tmp_path / "x", {}, None, tensorboard=True, wandb=False, wandb_project="x", enabled=False
    )
    log.log(1, {"a": 1.0})
    assert not (tmp_path / "x").exists()


def test_single_process_reduce_keeps_values_and_order():
    m = {"time/rollout_s": 2.0, "rs/vetoed_seqs": 1.0, "a": 0.5}
    assert list(reduce_metrics(m).items()) == list(m.items())


COLUMNS = (("reward", "rollout/reward_mean", "mean reward"), ("acc", "rollout/accuracy", "right"),
           ("kl", "train/kl", "KL"))


def test_summary_line_and_legend():
    line = summary_line(3, {"rollout/reward_mean": 0.5, "train/kl": 0.001, "time/update_s": 1.25},
                        COLUMNS)
    assert line == "rollout 3 | reward 0.5 | kl 0.001 | time update=1.2s"
    assert summary_line(3, {"rollout/accuracy": 0.25}, COLUMNS, total=10) == "rollout 3/10 | acc 0.25"
    assert summary_legend(COLUMNS) == ("each rollout's line: reward = mean reward,\n"
                                       "  acc = right, kl = KL; time = seconds per phase")


def test_reduce_over_ranks_follows_the_value_type(monkeypatch):
    """Two ranks with equal values: Sum doubles, Max and plain floats keep the value."""
    import minisparse.trainer.logger as logger
    from minisparse.utils.distributed import Max, Sum

    monkeypatch.setattr(logger, "world_size", lambda: 2)
    monkeypatch.setattr(logger, "all_reduce",
                        lambda t, op="sum": t.clone() if op == "max" else 2 * t)
    m = {"x/count": Sum(3), "x/peak": Max(7.5), "x/mean": 0.25}
    assert reduce_metrics(m) == {"x/count": 6.0, "x/peak": 7.5, "x/mean": 0.25}


def test_no_events_file_before_the_first_row(tmp_path):
    """A run that stops before logging (a finished run started again, a failed start)
    leaves no empty TensorBoard events file behind."""
    log = MetricsLogger(tmp_path, {}, None, tensorboard=True, wandb=False, wandb_project="x")
    log.close()
    assert not list(tmp_path.glob("tensorboard/events.out.tfevents.*"))
    log = MetricsLogger(tmp_path, {}, None, tensorboard=True, wandb=False, wandb_project="x")
    log.log(1, {"a": 1.0})
    log.close()
    assert len(list(tmp_path.glob("tensorboard/events.out.tfevents.*"))) == 1
