"""Random fault trials of an elastic Gluon job through bpslaunch (issue 15's kill loop).

Each trial runs ``bpslaunch -np 3 --min-np 2 --max-np 3 python tests/jobs/gluon_elastic_job.py``
(a Gluon MLP, DistributedTrainer in allreduce or gossip mode, elastic.run, GluonState), makes
one random rank fail at one random step (SIGKILL; or SIGSTOP / a stall with --fault), and checks
what a user is promised: bpslaunch exits 0, the workers that finish hold identical parameters
(allreduce), and every sample of every epoch is committed exactly once.

    python scripts/elastic_trials.py --trials 20 --mode allreduce --seed 1
    python scripts/elastic_trials.py --trials 10 --mode gossip --fault stop

Prints one line per trial (what was done, exit status, seconds, verdict) and a summary; exits 1
when any trial failed. tests/clusters/test_elastic_trials.py runs a few fixed trials the same way.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from bps_gossip.launch.sessions import kill_groups, start_in_session

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "jobs" / "gluon_elastic_job.py"
WORKERS, EPOCHS, SAMPLES, BATCH, COMMIT_EVERY = 3, 2, 96, 4, 3
STEPS = EPOCHS * -(-SAMPLES // (WORKERS * BATCH))  # with every worker alive the whole time
# Short failure detection, so that a trial takes seconds; a secret, as every job has.
TRIAL_ENV = {
    "BPS_GOSSIP_TIMEOUT": "10", "BPS_GOSSIP_HEARTBEAT_INTERVAL": "0.2", "BPS_GOSSIP_HEARTBEAT_TIMEOUT": "2",
    "BPS_GOSSIP_START_TIMEOUT": "60", "BPS_GOSSIP_ELASTIC_TIMEOUT": "30", "BYTEPS_LOG_LEVEL": "WARNING",
    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "STEP_SLEEP": "0.3",
    "EPOCHS": str(EPOCHS), "SAMPLES": str(SAMPLES), "BATCH": str(BATCH), "COMMIT_EVERY": str(COMMIT_EVERY),
}


@dataclasses.dataclass
class Trial:
    """One trial: the fault and the outcome."""

    mode: str
    fault: str  # KILL, STOP or STALL
    rank: int
    step: int
    code: int | None = None
    seconds: float = 0.0
    problems: list[str] = dataclasses.field(default_factory=list)
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.problems

    def describe(self) -> str:
        verdict = "ok" if self.ok else "FAILED: " + "; ".join(self.problems or [f"exit {self.code}"])
        return (f"{self.mode:<9} {self.fault.lower():<5} rank {self.rank} step {self.step:>2}: exit {self.code}, "
                f"{self.seconds:5.1f} s, {verdict}")


def results(output: str) -> dict[str, list]:
    """{bpslaunch's prefix of the process: [its RESULT values]}."""
    found: dict[str, list] = collections.defaultdict(list)
    for match in re.finditer(r"^\[(\w+)\] RESULT (.*)$", output, re.M):
        found[match[1]].append(json.loads(match[2]))
    return found


def check(trial: Trial) -> None:
    """What the trial must show; problems go into ``trial.problems``."""
    found = results(trial.output)
    finals = [r for values in found.values() for r in values if r[0] == "final"]
    if not finals:
        trial.problems.append("no worker finished")
    if trial.mode == "allreduce" and len({f[1] for f in finals}) > 1:
        trial.problems.append(f"finishing workers' parameters differ: {[f[1][:8] for f in finals]}")
    if len({f[6] for f in finals}) > 1:  # Adam's bias correction reads them
        trial.problems.append(f"finishing workers' optimizer update counts differ: {[f[6] for f in finals]}")
    if any(f[3] != EPOCHS for f in finals):
        trial.problems.append(f"a worker finished before epoch {EPOCHS}: {finals}")
    seen = collections.Counter((e, i) for values in found.values() for r in values if r[0] == "commit"
                               for e, i in r[1])
    wanted = collections.Counter((e, i) for e in range(EPOCHS) for i in range(SAMPLES))
    if seen != wanted:
        missing, repeated = wanted - seen, seen - wanted
        trial.problems.append(f"samples committed wrongly: {sum(missing.values())} missing, "
                              f"{sum(repeated.values())} repeated (e.g. {list(missing or repeated)[:4]})")
    for noise in ("resource_tracker", "Traceback"):
        if noise in trial.output:
            trial.problems.append(f"{noise!r} in the output")


def run_trial(trial: Trial, timeout: float = 240, env: Mapping[str, str] | None = None,
              python: str = sys.executable, extra_env: Mapping[str, str] | None = None) -> Trial:
    """Run ``trial`` through bpslaunch and check it (``extra_env`` over the trials' own settings)."""
    child_env = {k: v for k, v in (os.environ if env is None else env).items()
                 if not k.startswith(("DMLC_", "BYTEPS_LOCAL", "BPS_GOSSIP_"))}
    child_env.update(TRIAL_ENV)
    child_env.update(extra_env or {})
    child_env.update({"MODE": trial.mode, f"{trial.fault}_RANK": str(trial.rank), f"{trial.fault}_STEP": str(trial.step),
                      "STALL_SECONDS": "60"})
    argv = [python, "-m", "bps_gossip.launch", "-np", str(WORKERS), "--min-np", "2", "--max-np", str(WORKERS),
            python, str(JOB)]
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        proc = start_in_session(argv, child_env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            trial.code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            trial.problems.append(f"bpslaunch did not end within {timeout:g} s")
        finally:
            kill_groups([proc])  # and what a child left in bpslaunch's group (there should be nothing)
        out.seek(0)
        trial.output = out.read()
    trial.seconds = time.monotonic() - started
    check(trial)
    return trial


def random_trials(count: int, modes: Sequence[str], faults: Sequence[str], seed: int) -> list[Trial]:
    """``count`` trials with a random rank and step each, the last commits included."""
    rng = random.Random(seed)
    return [Trial(rng.choice(list(modes)), rng.choice(list(faults)), rng.randrange(WORKERS), rng.randrange(STEPS))
            for _ in range(count)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--mode", choices=["allreduce", "gossip", "both"], default="both")
    parser.add_argument("--fault", choices=["kill", "stop", "stall", "all"], default="kill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                        help="adam: its update counters must also agree on every finishing worker")
    parser.add_argument("--show-failures", action="store_true", help="print a failed trial's whole output")
    args = parser.parse_args(argv)
    modes = ["allreduce", "gossip"] if args.mode == "both" else [args.mode]
    faults = ["KILL", "STOP", "STALL"] if args.fault == "all" else [args.fault.upper()]
    trials = random_trials(args.trials, modes, faults, args.seed)
    for index, trial in enumerate(trials, 1):
        run_trial(trial, extra_env={"OPTIMIZER": args.optimizer})
        print(f"{index:>3}/{len(trials)} {trial.describe()}", flush=True)
        if not trial.ok and args.show_failures:
            print(trial.output, flush=True)
    failed = [t for t in trials if not t.ok]
    print(f"\n{len(trials) - len(failed)} of {len(trials)} trials ok (seed {args.seed}, {STEPS} steps per job); "
          f"mean {sum(t.seconds for t in trials) / max(1, len(trials)):.1f} s per trial")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
