"""A rank lost mid-run, on purpose: two torchruns as two nodes on this machine, one process
each (under minisparse.launch). Node 1's worker freezes (SIGSTOP: a hung machine, its
sockets open) or dies (SIGKILL) as a phase of rollout 2 starts; node 0 must stop within
dist.peer_timeout_s plus seconds, non-zero, with one line naming rank 1, and the same two
commands then resume with every rollout once in metrics.jsonl. `SIGTERM logprobs`: node
1's worker alone gets SIGTERM; both must stop in rollout 2 with rollout 1 saved (exit 0).
`sigterm`: node 1 dies, then node 0 gets SIGTERM (what torchrun sends the others): it must
stop within the stop's limit (15 s), saying that it could not save.

    python -m scripts.peer_loss --out /tmp/peer_loss                    # CPU: gloo, tiny
    bash scripts/gpu_peer_loss.sh                                       # 2 GPUs: NCCL

The signal comes from inside the worker (soak_resume.py's traced child: a timer armed as
the phase starts), so it lands in the phase on a busy machine too. Prints one line per
case: node 0's exit code, seconds from the signal to its exit, its last line.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
CASES = ("SIGSTOP rollout", "SIGKILL update", "SIGSTOP update", "SIGKILL rollout",
         "SIGTERM logprobs", "sigterm")
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Outcome:
    case: str
    code: int  # node 0's exit status
    seconds: float  # from the signal to node 0's exit
    last: str  # node 0's last line (stdout or stderr, whichever came last in the file)
    traceback: bool  # whether node 0 printed one
    rollouts: list[int] | None = None  # metrics.jsonl after the resume (None: not resumed)


@dataclass
class Setup:
    config: str
    sets: list[str]
    gpus: bool  # one GPU per node: node r takes the r-th visible one
    cache: Path | None = None  # MINISPARSE_CACHE for the workers


def marks_of(out: Path, rank: int) -> Path:
    return out.parent / f"marks_{out.name}_{rank}"


def node(rank: int, port: str, out: Path, setup: Setup, target: str = "end",
         signal_name: str = "SIGKILL", sets: list[str] | None = None) -> subprocess.Popen:
    """Node `rank` of two; its worker is soak_resume.py's traced train.py, which sends
    itself `signal_name` as `target` starts ('rollout 2'; 'end': never). Output in
    OUT.parent/node{rank}.log."""
    cmd = [sys.executable, "-m", "minisparse.launch", "--nnodes", "2", "--node_rank", str(rank),
           "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port,
           "-m", "scripts.soak_resume", "--child", str(marks_of(out, rank)), target, "0",
           signal_name, "--", "--config", setup.config, "--set", f"output_dir={out}",
           *[arg for key in (setup.sets if sets is None else sets) for arg in ("--set", key)]]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    if setup.gpus:  # the rank-th of the GPUs this script may use
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")
        env["CUDA_VISIBLE_DEVICES"] = visible[rank]
    if setup.cache is not None:
        env["MINISPARSE_CACHE"] = str(setup.cache)
    log = open(out.parent / f"{out.name}_node{rank}.log", "a")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def log_of(out: Path, rank: int) -> str:
    return (out.parent / f"{out.name}_node{rank}.log").read_text(errors="replace")


def worker(proc: subprocess.Popen) -> int:
    """The pid of a node's worker (torchrun starts each in a session of its own)."""
    return int(subprocess.check_output(["pgrep", "-P", str(proc.pid)]).split()[0])


def reached(marks: Path, point: str, proc: subprocess.Popen, limit: float = 900) -> float:
    """Wait until a worker's traced phases reach `point` ('start update 2'); its time."""
    deadline = time.monotonic() + limit
    while not (marks.is_file() and point in marks.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{point} never came ({marks})")
        time.sleep(0.05)
    line = next(line for line in marks.read_text().splitlines() if point in line)
    return float(line.split()[0])


def ended(proc: subprocess.Popen, limit: float) -> float:
    """Wait for proc (a node) to end; time.time() then. A node still there after `limit`
    seconds is killed, with its worker: a hang."""
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        for pid in (worker(proc), proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"node still running after {limit:.0f} s") from None
    return time.time()


def outcome(case: str, out: Path, code: int, seconds: float) -> Outcome:
    text = log_of(out, 0)
    lines = [line for line in text.splitlines() if line.strip()]
    return Outcome(case, code, seconds, lines[-1] if lines else "", "Traceback" in text)


def lose_a_peer(out: Path, setup: Setup, signal_name: str, phase: str,
                limit: float) -> Outcome:
    """Node 1's worker sends itself `signal_name` as `phase` of rollout 2 starts; node 0's
    exit, within `limit` seconds of it."""
    port = str(free_ports())
    first = node(0, port, out, setup)
    second = node(1, port, out, setup, f"{phase} 2", signal_name)
    sent = reached(marks_of(out, 1), f"start {phase} 2", second)
    frozen = worker(second) if signal_name == "SIGSTOP" else None
    try:
        end = ended(first, limit)
    finally:
        if frozen:  # the frozen worker goes now, and its node with it
            os.kill(frozen, signal.SIGKILL)
        second.wait(timeout=120)
    return outcome(f"{signal_name} {phase}", out, first.returncode, end - sent)


def stop_with_a_dead_peer(out: Path, setup: Setup, limit: float) -> Outcome:
    """Node 1's worker dies as rollout 2 starts; once node 1 is gone, node 0 (torchrun,
    which passes it on) gets SIGTERM."""
    port = str(free_ports())
    first = node(0, port, out, setup)
    second = node(1, port, out, setup, "rollout 2", "SIGKILL")
    second.wait(timeout=900)
    sent = time.time()
    first.send_signal(signal.SIGTERM)
    end = ended(first, limit)
    return outcome("sigterm", out, first.returncode, end - sent)


def resume(out: Path, setup: Setup, limit: float) -> list[int]:
    """The same two commands again (resume=auto); metrics.jsonl's rollouts after."""
    port = str(free_ports())
    nodes = [node(r, port, out, setup) for r in (0, 1)]
    for proc in nodes:
        ended(proc, limit)
    if any(proc.returncode for proc in nodes):
        raise RuntimeError(f"resume failed: {log_of(out, 0)[-2000:]}")
    rows = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(row)["rollout"] for row in rows]


def run_case(case: str, root: Path, setup: Setup, peer_timeout: float,
             with_resume: bool = True) -> Outcome:
    out = root / case.replace(" ", "_")
    if case == "sigterm":
        # the stop's limit comes first; no checkpoint after rollout 1 to fall back on
        slow = Setup(setup.config, [*setup.sets, "save_interval=3",
                                    f"dist.peer_timeout_s={max(60.0, 3 * peer_timeout)}"],
                     setup.gpus, setup.cache)
        return stop_with_a_dead_peer(out, slow, 20 + 30)
    signal_name, phase = case.split()
    result = lose_a_peer(out, setup, signal_name, phase, peer_timeout + 30)
    if with_resume:
        result.rollouts = resume(out, setup, 900)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="working dir (made fresh)")
    parser.add_argument("--config", default="tiny_rkv", help="train.py's --config (tiny_rkv)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="train.py config override (repeatable)")
    parser.add_argument("--peer-timeout", type=float, default=10.0,
                        help="dist.peer_timeout_s (default 10)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--gpus", action="store_true", help="one GPU per node (NCCL)")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty")
    args.out.mkdir(parents=True, exist_ok=True)
    sets = ["num_rollout=3", "save_interval=1", f"dist.peer_timeout_s={args.peer_timeout}",
            *args.set]
    setup = Setup(args.config, sets, args.gpus)
    failed = 0
    for case in args.cases.split(","):
        try:
            r = run_case(case.strip(), args.out, setup, args.peer_timeout)
        except RuntimeError as exc:
            print(f"{case}: FAILED: {exc}", flush=True)
            failed += 1
            continue
        resumed = "" if r.rollouts is None else f", resumed: rollouts {r.rollouts}"
        print(f"{r.case}: node 0 exit {r.code} {r.seconds:.1f} s after the signal"
              f"{', TRACEBACK' if r.traceback else ''}{resumed}\n    {r.last}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
