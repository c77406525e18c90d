"""Kill-and-resume soak: tiny CPU runs SIGKILLed at random points, resumed, and checked."""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from minisparse.plot.metrics import read_rows

REPO = Path(__file__).resolve().parents[1]
PHASES = ("startup", "rollout", "update", "save")
TRACED = {"rollout": "rollout_phase", "reward": "reward_phase", "logprobs": "logprob_phase",
          "update": "update_phase", "save": "save_phase"}
RESUMED = re.compile(r"^resumed from (\S+) \(rollout (\d+), step \d+\)$", re.M)
CHECKPOINT = re.compile(r"^rollout_(\d{6})$")
# Run-to-run noise; every other metric of a resumed run equals the reference's.
VOLATILE = ("time/", "mem/", "perf/", "reward/grade_s")
# (time.time(), 'start' | 'end' | 'kill', phase, rollout); 'kill': at the phase's end
Mark = tuple[float, str, str, int]


HOW = """\
One uninterrupted run first: the reference. Then, per kill, a launch with resume=auto is
SIGKILLed at a random point of one phase (start-up, rollout, update or checkpoint save;
each once per four kills, in random order; a uniform delay into it, up to the shortest
time it has taken so far, or at its end when it is over sooner) and the next launch
resumes. Checked after every kill and resume: the resume continued from the newest
complete checkpoint (never a half-written one), metrics.jsonl holds rollouts 1..n once
each and in order, and no step (start-up, or one phase to the next) took longer than
--step-timeout. A run that ends is checked row for row against the reference and a new
one starts. Exit status 1, with the failures listed, when any check fails. Logs and
phase marks: OUT/logs/.

    python -m scripts.soak_resume --kills 20 --out /tmp/soak
"""


class SoakFailure(RuntimeError):
    pass


# ---------------------------------------------------------------- the traced child process


def child(marks: str, target: str, delay: float, argv: list[str],
          signum: int = signal.SIGKILL) -> None:
    """train.main() with a line in `marks` as start-up and each traced phase start and
    end (a write is a system call: every line before the kill is there), sent `signum`
    `delay` s into `target` ('startup', 'update 3', ...; 'end': never) by a timer thread
    armed as the target starts, or at the target's end when it is over sooner (the
    machine got faster, or less busy): every kill lands inside its target. From inside,
    the kill lands within a few ms of its mark; an outside poller on a busy 2-core
    machine misses a 50 ms update phase. (The stop tests send SIGTERM this way.)"""
    out = open(marks, "a", buffering=1)
    out.write(f"{time.time():.6f} start startup 0\n")

    sent, lock = [], threading.Lock()  # one signal, whichever of timer and end comes first

    def kill() -> bool:
        with lock:
            if sent:
                return False
            sent.append(1)
        os.kill(os.getpid(), signum)
        return True

    def arm(point: str) -> None:
        if point == target:
            threading.Timer(delay, kill).start()

    def over(point: str, rollout: int) -> None:
        """`point` ends: the kill, if it aims there and its timer has not fired (a
        SIGTERM's run goes on after the signal: it must not get a second one here)."""
        if point == target and not sent:
            out.write(f"{time.time():.6f} kill {point.split()[0]} {rollout}\n")
            kill()

    arm("startup")
    import train

    current = {"rollout": 0}

    def traced(phase: str, fn):
        def wrapper(run, *args):
            if phase == "rollout":
                over("startup", 0)  # start-up ends as the first rollout starts
                current["rollout"] = args[0]
            point = f"{phase} {current['rollout']}"
            out.write(f"{time.time():.6f} start {point}\n")
            arm(point)
            result = fn(run, *args)
            over(point, current["rollout"])
            out.write(f"{time.time():.6f} end {point}\n")
            return result

        return wrapper

    for phase, name in TRACED.items():
        setattr(train, name, traced(phase, getattr(train, name)))
    sys.argv = ["train.py", *argv]
    train.main()


def read_marks(path: Path) -> list[Mark]:
    """(time, start|end|kill, phase, rollout) per complete line."""
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")[:-1]  # a line cut by the kill has no newline
    return [(float(t), what, phase, int(r)) for t, what, phase, r in map(str.split, lines)]


def landed(marks: list[Mark]) -> str:
    """Where the kill hit: 'startup', 'rollout 3' (inside it) or 'after update 3'."""
    if not marks or marks[-1][2] == "startup":
        return "startup"
    _, what, phase, rollout = marks[-1]
    return f"after {phase} {rollout}" if what == "end" else f"{phase} {rollout}"


# ------------------------------------------------------------------------------- checks


def metrics_rollouts(out: Path) -> list[int]:
    """Rollout of each complete row of metrics.jsonl, in the order written (a row torn by
    the kill is left out: the resume drops it)."""
    return [row["rollout"] for row in read_rows(out / "metrics.jsonl")]


def check_rows(rollouts: list[int], upto: int | None = None) -> str | None:
    """Each rollout once and in order from 1 (and up to `upto` when given)."""
    want = list(range(1, (len(rollouts) if upto is None else upto) + 1))
    if rollouts != want:
        return f"metrics.jsonl rollouts {rollouts}, expected {want}"
    return None


def newest_complete(out: Path) -> Path | None:
    """The newest checkpoint that is complete by its contents, judged here independently
    of the trainer's own logic: marker, state of the same rollout, HF weights and
    DeepSpeed state present."""
    best = None
    root = out / "checkpoints"
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        match = CHECKPOINT.match(path.name)
        if not match or not (path / "COMPLETE").is_file():
            continue
        state = json.loads((path / "trainer_state.json").read_text())
        files = ("hf/config.json", "hf/model.safetensors", "ds/state")
        if state["rollout"] == int(match.group(1)) and all((path / f).exists() for f in files):
            best = path
    return best


def check_resume(log: str, marks: list[Mark], expected: Path | None) -> str | None:
    """A launch continued from `expected`, the newest complete checkpoint (None: it
    started afresh): it said so, and its first rollout is the one after. A launch killed
    before either is checked as far as it got."""
    found = RESUMED.findall(log)
    done = int(expected.name.split("_")[1]) if expected else 0
    if expected is None and found:
        return f"resumed from {found[0][0]} with no complete checkpoint there"
    if found and found != [(str(expected), str(done))]:
        return f"resumed from {found}, expected {expected}"
    first = next((r for _, _, phase, r in marks if phase == "rollout"), None)
    if first is not None and (first != done + 1 or (expected and not found)):
        return f"first rollout {first} (resume line {found or 'absent'}), expected {done + 1}"
    return None


def check_same_as(out: Path, reference: Path) -> str | None:
    """Every row equals the uninterrupted run's, volatile metrics aside."""
    rows, ref = read_rows(out / "metrics.jsonl"), read_rows(reference / "metrics.jsonl")
    for a, b in zip(rows, ref, strict=True):
        differ = [k for k in b if not k.startswith(VOLATILE) and a.get(k) != b[k]]
        if differ:
            return f"rollout {a['rollout']} differs from the uninterrupted run in {differ[:4]}"
    return None


# ------------------------------------------------------------------------------ launching


@dataclass
class Launch:
    proc: subprocess.Popen
    marks: Path
    log: Path
    started: float


@dataclass
class Attempt:
    """One launch of the soak and what became of it."""

    run: str  # output dir
    resumed: bool  # a launch after a kill in the same dir
    target: str  # phase (and rollout) the kill aimed at; 'end' for a run to the end
    landed: str = "end"  # where the kill hit, from the launch's marks
    at_end: bool = False  # the phase ended before the delay: killed as it ended
    delay_s: float = 0.0  # into the target phase
    lived_s: float = 0.0  # launch to kill (or exit)
    first_rollout_s: float | None = None  # launch to its first rollout (None: not reached)
    left_incomplete: list[str] = field(default_factory=list)  # checkpoints without marker


@dataclass
class Report:
    attempts: list[Attempt] = field(default_factory=list)
    runs: int = 0  # output dirs trained to the end and equal to the reference
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0


class Soak:
    def __init__(self, out: Path, rollouts: int, seed: int, step_timeout: float,
                 extra: list[str]) -> None:
        self.out, self.rollouts, self.step_timeout = out, rollouts, step_timeout
        self.rng = random.Random(seed)
        self.extra = extra
        self.launches = 0
        self.phases: list[str] = []
        self.shortest: dict[tuple[str, int], float] = {}
        self.report = Report()

    def next_phase(self) -> str:
        """Every phase once per len(PHASES) kills, in random order."""
        if not self.phases:
            self.phases = self.rng.sample(PHASES, len(PHASES))
        return self.phases.pop()

    def launch(self, run_dir: Path, target: str, delay: float) -> Launch:
        self.launches += 1
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        marks, log = logs / f"marks_{self.launches:03d}", logs / f"launch_{self.launches:03d}.log"
        # every launch the same threads: float sums depend on them (utils/threads.py), and
        # a resumed run must equal the reference row for row
        sets = [f"output_dir={run_dir}", f"num_rollout={self.rollouts}", "save_interval=1",
                "save_total_limit=2", "resume=auto", "loss.entropy_coef=0.01",
                f"cpu_threads={len(os.sched_getaffinity(0))}", *self.extra]
        cmd = [sys.executable, "-m", "scripts.soak_resume", "--child", str(marks), target,
               str(delay), "--", "--config", "tiny_rkv", *[arg for key in sets for arg in ("--set", key)]]
        with open(log, "w") as handle:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)
        return Launch(proc, marks, log, time.time())

    def finish(self, launch: Launch) -> int:
        """Wait for the launch to end (killed or done); its return code. A step (start-up,
        or one phase to the next) that takes over step_timeout is a hang: fail."""
        seen, last = 0, time.monotonic()
        while launch.proc.poll() is None:
            marks = len(read_marks(launch.marks))
            if marks > seen:
                seen, last = marks, time.monotonic()
            if time.monotonic() - last > self.step_timeout:
                launch.proc.kill()
                raise SoakFailure(f"no progress for {self.step_timeout:.0f} s after "
                                  f"{landed(read_marks(launch.marks))}; see {launch.log}")
            time.sleep(0.05)
        if launch.proc.returncode not in (0, -signal.SIGKILL):
            raise SoakFailure(f"run failed ({launch.proc.returncode}); see {launch.log}")
        return launch.proc.returncode

    def learn(self, marks: list[Mark]) -> None:
        """A kill's delay is drawn up to the shortest duration seen of its phase at its
        rollout (a rollout samples the same responses in every launch, so it takes about
        as long each time): most kills land before its end, wherever load on the machine
        makes it go."""
        for point, seconds in durations(marks).items():
            self.shortest[point] = min(seconds, self.shortest.get(point, math.inf))


def durations(marks: list[Mark]) -> dict[tuple[str, int], float]:
    """Seconds per (phase, rollout) that ended; ('startup', 0) ends as the first rollout
    starts."""
    spans: dict[tuple[str, int], float] = {}
    opened: dict[tuple[str, int], float] = {}
    for t, what, phase, rollout in marks:
        if phase == "rollout" and ("startup", 0) in opened and ("startup", 0) not in spans:
            spans["startup", 0] = t - opened["startup", 0]
        if what == "start":
            opened[phase, rollout] = t
        elif what == "end":
            spans[phase, rollout] = t - opened[phase, rollout]
    return spans


def soak(out: Path, kills: int, rollouts: int = 4, seed: int = 0, step_timeout: float = 120,
         extra: Sequence[str] = ()) -> Report:
    """Run the soak; failures are collected in the report (the first one ends it)."""
    start = time.monotonic()
    s = Soak(out, rollouts, seed, step_timeout, list(extra))
    try:
        reference = out / "reference"
        first = s.launch(reference, "end", 0.0)
        if s.finish(first) != 0:
            raise SoakFailure(f"the reference run was killed; see {first.log}")
        s.learn(read_marks(first.marks))
        _kill_and_resume(s, kills, reference)
    except SoakFailure as exc:
        s.report.failures.append(str(exc))
    s.report.wall_s = time.monotonic() - start
    return s.report


def _kill_and_resume(s: Soak, kills: int, reference: Path) -> None:
    run_dir = s.out / "run_1"
    for _ in range(kills):
        if _rollouts_done(run_dir) == s.rollouts:  # a kill after the final save
            _check_run(s, run_dir, reference)
            run_dir = s.out / f"run_{s.report.runs + 1}"
        done, phase = _rollouts_done(run_dir), s.next_phase()
        rollout = s.rng.randint(done + 1, min(done + 2, s.rollouts)) * (phase != "startup")
        target = phase if phase == "startup" else f"{phase} {rollout}"
        _attempt(s, run_dir, target, s.rng.uniform(0, s.shortest[phase, rollout]))
        problem = check_rows(metrics_rollouts(run_dir))
        if problem:
            raise SoakFailure(f"after kill {len(s.report.attempts)}: {problem}")
    if _rollouts_done(run_dir) < s.rollouts:
        _attempt(s, run_dir, "end", 0.0)
    _check_run(s, run_dir, reference)


def _attempt(s: Soak, run_dir: Path, target: str, delay: float) -> None:
    """One launch, killed at `target` + delay (or run to the end), and its checks."""
    attempt = Attempt(run_dir.name, target=target, delay_s=delay,
                      resumed=any(a.run == run_dir.name for a in s.report.attempts))
    expected = newest_complete(run_dir)
    launch = s.launch(run_dir, target, delay)
    code = s.finish(launch)
    marks = read_marks(launch.marks)
    s.learn(marks)
    attempt.landed = landed(marks) if code else "end"
    attempt.at_end = bool(code) and bool(marks) and marks[-1][1] == "kill"
    attempt.lived_s = time.time() - launch.started
    first = next((t for t, _, phase, _ in marks if phase == "rollout"), None)
    attempt.first_rollout_s = None if first is None else first - launch.started
    attempt.left_incomplete = _incomplete(run_dir)
    s.report.attempts.append(attempt)
    problem = check_resume(launch.log.read_text(), marks, expected)
    if problem:
        raise SoakFailure(f"launch {s.launches} ({launch.log}): {problem}")


def _rollouts_done(run_dir: Path) -> int:
    newest = newest_complete(run_dir)
    return json.loads((newest / "trainer_state.json").read_text())["rollout"] if newest else 0


def _incomplete(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir() if not (p / "COMPLETE").is_file()) \
        if root.is_dir() else []


def _check_run(s: Soak, run_dir: Path, reference: Path) -> None:
    problem = check_rows(metrics_rollouts(run_dir), s.rollouts) or check_same_as(run_dir,
                                                                                 reference)
    if problem:
        raise SoakFailure(f"{run_dir.name}: {problem}")
    s.report.runs += 1


# ------------------------------------------------------------------------------- output


def summary(report: Report) -> str:
    """The figures docs/training.md quotes."""
    lines = [f"{'run':<6} {'target':<10} {'landed':<16} {'delay_s':>7} {'lived_s':>7} "
             f"{'rollout_s':>9}  left incomplete"]
    for a in report.attempts:
        first = f"{a.first_rollout_s:.1f}" if a.first_rollout_s is not None else "-"
        where = f"{a.landed} (end)" if a.at_end else a.landed
        lines.append(f"{a.run:<6} {a.target:<10} {where:<16} {a.delay_s:7.3f} "
                     f"{a.lived_s:7.1f} {first:>9}  {' '.join(a.left_incomplete) or '-'}")
    kills = [a for a in report.attempts if a.target != "end"]
    where = [a.landed.split()[1 if a.landed.startswith("after") else 0] for a in kills]
    resumes = [a for a in report.attempts if a.resumed]
    continued = [a.first_rollout_s for a in resumes if a.first_rollout_s is not None]
    lines += [
        f"kills tried: {len(kills)} (in start-up {where.count('startup')}, rollout "
        f"{where.count('rollout')}, update {where.count('update')}, save {where.count('save')}"
        f"; {sum(a.at_end for a in kills)} of these at the phase's end)",
        f"resumes: {len(resumes)}, continued from the newest complete checkpoint: "
        f"{len(continued)}, killed in their own start-up first: "
        f"{len(resumes) - len(continued)}",
        f"runs finished, rows equal to the uninterrupted run's: {report.runs}",
    ]
    if continued:
        lines.append(f"resume, launch to first rollout: median {statistics.median(continued):.1f}"
                     f" s, max {max(continued):.1f} s; soak wall time {report.wall_s:.0f} s")
    lines += [f"FAILED: {f}" for f in report.failures] or ["all checks passed"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # MARKS TARGET DELAY [SIGNAL] -- train.py's arguments
        split = argv.index("--")
        signum = signal.Signals[argv[4]] if split == 5 else signal.SIGKILL
        child(argv[1], argv[2], float(argv[3]), argv[split + 1:], signum)
        return 0
    parser = argparse.ArgumentParser(description=__doc__, epilog=HOW,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs to try (default 20)")
    parser.add_argument("--rollouts", type=int, default=4, help="num_rollout of each run")
    parser.add_argument("--seed", type=int, default=0, help="picks phases, rollouts, delays")
    parser.add_argument("--step-timeout", type=float, default=120,
                        help="longest a step may take before the soak calls it a hang (s)")
    parser.add_argument("--out", type=Path, required=True, help="working dir (made fresh)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra train.py config override (repeatable)")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty")
    report = soak(args.out, args.kills, args.rollouts, args.seed, args.step_timeout, args.set)
    print(summary(report))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
