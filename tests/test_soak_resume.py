"""scripts/soak_resume.py: tiny runs SIGKILLed in each phase (start-up, rollout, update,
checkpoint save) and resumed, every step bounded in time; and its checks, each shown to
catch what it is for."""
import json
import signal
from pathlib import Path

import pytest

from scripts import soak_resume


def test_four_kills_one_per_phase_each_resumed_to_the_same_result(tmp_path, _minisparse_cache):
    """A reference run, four killed launches, one to the end (about 8 s of start-up each;
    under two minutes on an idle 2-core CPU). Nothing here depends on the machine's speed:
    each kill lands in its phase by construction, and the checks hold wherever in it."""
    report = soak_resume.soak(tmp_path, kills=4, rollouts=2, seed=1, step_timeout=300)
    assert not report.failures, soak_resume.summary(report)
    kills = [a for a in report.attempts if a.target != "end"]
    assert sorted(a.target.split()[0] for a in kills) == ["rollout", "save", "startup",
                                                          "update"]
    # inside its target phase: its timer fired there, or the phase ended first and the
    # kill came as it ended
    assert [a.landed for a in kills] == [a.target for a in kills], soak_resume.summary(report)
    # every resume reached a rollout (the one after its checkpoint), unless it was
    # itself killed in start-up
    resumes = [a for a in report.attempts if a.resumed]
    assert resumes and all(a.first_rollout_s is not None or a.target == "startup"
                           for a in resumes)
    assert report.runs >= 1  # a kill as save 2 ended finishes run_1; a new run goes on
    run = tmp_path / f"run_{report.runs}"
    assert soak_resume.metrics_rollouts(run) == [1, 2]  # nothing lost, nothing twice
    assert soak_resume.check_same_as(run, tmp_path / "reference") is None
    assert (run / "checkpoints" / "rollout_000002" / "COMPLETE").is_file()


def test_a_kill_whose_delay_outlasts_its_phase_comes_as_the_phase_ends(tmp_path,
                                                                      _minisparse_cache):
    """The event, not the timer, decides where such a kill lands: save 1 finishes (its
    checkpoint complete) and the process dies before the end of the phase is marked."""
    s = soak_resume.Soak(tmp_path, rollouts=2, seed=0, step_timeout=300, extra=[])
    launch = s.launch(tmp_path / "run", "save 1", delay=1e6)
    assert s.finish(launch) == -signal.SIGKILL, launch.log.read_text()[-3000:]
    marks = soak_resume.read_marks(launch.marks)
    assert [m[1:] for m in marks[-2:]] == [("start", "save", 1), ("kill", "save", 1)]
    assert soak_resume.landed(marks) == "save 1"
    assert soak_resume.newest_complete(tmp_path / "run").name == "rollout_000001"
    assert soak_resume.metrics_rollouts(tmp_path / "run") == [1]


def _checkpoint(out: Path, rollout: int, complete: bool = True, weights: bool = True) -> Path:
    d = out / "checkpoints" / f"rollout_{rollout:06d}"
    (d / "hf").mkdir(parents=True)
    (d / "ds" / "state").mkdir(parents=True)
    (d / "hf" / "config.json").write_text("{}")
    if weights:
        (d / "hf" / "model.safetensors").write_text("")
    (d / "trainer_state.json").write_text(json.dumps({"rollout": rollout}))
    if complete:
        (d / "COMPLETE").write_text("done\n")
    return d


def test_newest_complete_is_judged_by_contents(tmp_path):
    assert soak_resume.newest_complete(tmp_path) is None
    good = _checkpoint(tmp_path, 1)
    _checkpoint(tmp_path, 2, complete=False)  # killed before the marker
    _checkpoint(tmp_path, 3, weights=False)  # marked, but a file is missing
    (tmp_path / "checkpoints" / ".tmp_rollout_000004").mkdir()
    assert soak_resume.newest_complete(tmp_path) == good
    newer = _checkpoint(tmp_path, 5)
    assert soak_resume.newest_complete(tmp_path) == newer


def test_rows_must_be_each_rollout_once_in_order(tmp_path):
    check = soak_resume.check_rows
    assert check([1, 2, 3]) is None and check([1, 2], upto=2) is None and check([]) is None
    assert "expected [1, 2, 3]" in check([1, 3, 2])
    assert "expected [1, 2]" in check([1, 1])
    assert "expected [1, 2, 3]" in check([1, 2], upto=3)
    (tmp_path / "metrics.jsonl").write_text('{"rollout": 1}\n{"rollout": 2}\n{"roll')
    assert soak_resume.metrics_rollouts(tmp_path) == [1, 2]  # the torn row is not counted


def test_a_resume_must_name_the_newest_complete_checkpoint_and_go_on_after_it(tmp_path):
    check, ckpt = soak_resume.check_resume, tmp_path / "rollout_000002"
    said = f"resumed from {ckpt} (rollout 2, step 4)\n"
    rollout = lambda r: [(0.0, "start", "rollout", r)]  # noqa: E731
    assert check(said, rollout(3), ckpt) is None
    assert check(said, [], ckpt) is None  # killed before its first rollout
    assert check("", [], ckpt) is None  # killed before it said anything
    assert check("", rollout(1), None) is None  # a fresh start
    assert "expected 3" in check(said, rollout(2), ckpt)
    assert "expected 3" in check("", rollout(3), ckpt)  # trained without resuming
    older = f"resumed from {tmp_path / 'rollout_000001'} (rollout 1, step 2)\n"
    assert "expected " in check(older, rollout(2), ckpt)
    assert "no complete checkpoint" in check(said, rollout(3), None)


def test_marks_say_where_a_kill_landed(tmp_path):
    marks = tmp_path / "marks"
    assert soak_resume.read_marks(marks) == [] and soak_resume.landed([]) == "startup"
    marks.write_text("0.5 start startup 0\n1.5 start rollout 1\n2.0 end rollout 1\n"
                     "2.1 start update 1\n2.2 end update 1\n2.3 start save 1\n2.4 end sa")
    read = soak_resume.read_marks(marks)
    assert len(read) == 6 and read[1] == (1.5, "start", "rollout", 1)  # the torn line is out
    assert soak_resume.landed(read) == "save 1"
    assert soak_resume.landed(read[:3]) == "after rollout 1"
    assert soak_resume.landed(read[:1]) == "startup"
    assert soak_resume.durations(read) == pytest.approx(
        {("startup", 0): 1.0, ("rollout", 1): 0.5, ("update", 1): 0.1})
    assert soak_resume.durations(read[:1]) == {}  # start-up never ended
    # a kill as the phase ended (its timer had not fired) is inside it, and ends nothing
    ended = read[:4] + [(2.25, "kill", "update", 1)]
    assert soak_resume.landed(ended) == "update 1"
    assert soak_resume.durations(ended) == soak_resume.durations(read[:4])
    assert soak_resume.landed([(0.5, "start", "startup", 0), (1.0, "kill", "startup", 0)]) \
        == "startup"


def test_rows_are_compared_with_the_reference_but_for_timings(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    for d, loss, secs in ((ref, 0.5, 1.0), (run, 0.5, 9.0)):
        d.mkdir()
        (d / "metrics.jsonl").write_text(json.dumps({"rollout": 1, "train/loss": loss,
                                                     "time/rollout_s": secs}) + "\n")
    assert soak_resume.check_same_as(run, ref) is None
    (run / "metrics.jsonl").write_text('{"rollout": 1, "train/loss": 0.6}\n')
    assert "differs from the uninterrupted run in ['train/loss']" in \
        soak_resume.check_same_as(run, ref)


def test_help(capsys):
    with pytest.raises(SystemExit) as info:
        soak_resume.main(["--help"])
    assert info.value.code == 0 and "--step-timeout" in capsys.readouterr().out
