"""Time-boxed commands under one deadline, each recorded and logged as it ends.

A command runs in its own process group (`start_new_session`), so that the data-loader workers,
torchrun's children and compile workers it starts end with it: past its time box the group gets
SIGTERM, then SIGKILL `grace` seconds later, and the command is recorded as timed out. A command that
fails or times out is recorded and the next one runs. Every record rewrites the results JSON at once,
so a run stopped from outside still leaves what it did.

Time: the whole run has one deadline (`budget` seconds from the start); a step's commands share the
step's deadline (its time box, cut to the run's); a command's time box is cut so that `reserve`
seconds of its step stay for the commands after it. A command left with under `MIN_LIMIT` seconds is
skipped and recorded as such.
"""
import datetime
import math
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from diffzoo.files import atomic_write_json

MIN_LIMIT = 5  # seconds: a command given less is skipped
STATUSES = ('ok', 'failed', 'timed out', 'skipped', 'interrupted')


@dataclass
class Record:
    """One command of one step: `status` is one of STATUSES; `rc` and `seconds` are None when it never ran."""
    step: str
    name: str
    command: str
    status: str
    rc: Optional[int] = None
    seconds: Optional[float] = None
    timeout_s: Optional[float] = None
    reason: str = ''
    background: bool = False
    last_line: str = ''  # of its output


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group has already ended


class Job:
    """A started command: its output goes to `log`; a thread waits for it and, past `limit` seconds, ends its
    process group."""

    def __init__(self, step: str, name: str, argv: Sequence[str], limit: float, grace: float, log: Path,
                 env: Dict[str, str], cwd: Path, background: bool):
        self.step, self.name, self.argv, self.limit, self.grace = step, name, list(argv), limit, grace
        self.log, self.background, self.timed_out = log, background, False
        self.start = time.monotonic()
        self.seconds = 0.0
        with open(log, 'wb') as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=cwd, start_new_session=True)
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        try:
            self.proc.wait(self.limit)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.end(signal.SIGTERM)
        self.seconds = time.monotonic() - self.start
        if self.timed_out:  # the group's stragglers (workers that outlive their parent) go too
            _signal_group(self.proc, signal.SIGKILL)

    def end(self, first: int) -> None:
        """`first` to the process group, SIGKILL to what is left of it `grace` seconds later."""
        _signal_group(self.proc, first)
        try:
            self.proc.wait(self.grace)
        except subprocess.TimeoutExpired:
            _signal_group(self.proc, signal.SIGKILL)
            self.proc.wait()

    def wait(self) -> Record:
        self.watcher.join()
        rc = self.proc.returncode
        status = 'timed out' if self.timed_out else 'ok' if rc == 0 else 'failed'
        return Record(self.step, self.name, shlex.join(self.argv), status, rc, round(self.seconds, 1),
                      round(self.limit), background=self.background)


class Runner:
    """Runs steps' commands under the run's deadline; `out`/`name`.json holds the records, `out`/`name`.log
    every command's output in order; each command's own log is kept under `work`/logs."""

    def __init__(self, out: Path, work: Path, budget: float, env: Dict[str, str], cwd: Path, header: Dict,
                 name: str = 'gpu_check'):
        self.out, self.work, self.env, self.cwd = out, work, env, cwd
        self.json_path, self.log_path = out / f'{name}.json', out / f'{name}.log'
        (work / 'logs').mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget
        self.step_deadline = self.deadline
        self.step = ''
        self.records: List[Record] = []
        self.results: Dict = {}
        self.jobs: List[Job] = []
        self.report = dict(header, budget_s=budget, status='running', elapsed_s=0.0)
        self.log_path.write_text(''.join(f'{k}: {v}\n' for k, v in header.items()) + f'budget: {budget:.0f} s\n\n')
        self.save()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def begin(self, step: str, box: float) -> None:
        """The step's commands share `box` seconds, cut to what is left of the run's budget."""
        self.step = step
        self.step_deadline = min(self.deadline, time.monotonic() + box)
        self.write_log(f'##### {step} (time box {box:.0f} s, {self.left():.0f} s of the budget left)\n')
        print(f'[{step}] time box {min(box, self.left()):.0f} s', flush=True)

    def skip(self, name: str, argv: Sequence[str], reason: str) -> Record:
        return self.add(Record(self.step, name, shlex.join(argv), 'skipped', reason=reason))

    def start(self, name: str, argv: Sequence[str], limit: float = math.inf, reserve: float = 0, grace: float = 15,
              background: bool = False) -> Optional[Job]:
        """Start `argv` under `limit` seconds (default: what is left of the step), cut to the step's deadline less
        `reserve`; None when skipped."""
        left = self.step_deadline - time.monotonic() - reserve
        limit = min(limit, left)
        if round(limit) < MIN_LIMIT:
            self.skip(name, argv, f'{max(0.0, self.step_deadline - time.monotonic()):.0f} s of the step left')
            return None
        job = Job(self.step, name, argv, limit, grace, self.work / 'logs' / f'{self.step}-{name}.log',
                  self.env, self.cwd, background)
        self.jobs.append(job)
        if not background:
            print(f'  {name}: {shlex.join(argv)[:150]} (timeout {limit:.0f} s)', flush=True)
        return job

    def run(self, name: str, argv: Sequence[str], limit: float = math.inf, reserve: float = 0,
            grace: float = 15) -> Record:
        job = self.start(name, argv, limit, reserve, grace)
        return self.records[-1] if job is None else self.wait(job)

    def wait(self, job: Optional[Job]) -> Optional[Record]:
        """Wait for `job` (None: it was skipped) and record it, its output appended to the log."""
        if job is None:
            return None
        record = job.wait()
        self.jobs.remove(job)
        what = ' (background)' if job.background else ''
        text = job.log.read_text(errors='replace')
        record.last_line = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), '')[:200]
        self.write_log(f'=== {record.step}/{record.name}{what} (timeout {record.timeout_s} s): {record.command}\n'
                       f'{text}=== {record.name}: {record.status}, exit {record.rc}, {record.seconds} s\n\n')
        return self.add(record, text)

    def add(self, record: Record, text: str = '') -> Record:
        self.records.append(record)
        self.save()
        extra = {'skipped': f'  ({record.reason})', 'timed out': f'  after {record.timeout_s} s'}.get(record.status, '')
        seconds = '' if record.seconds is None else f'{record.seconds:7.1f} s'
        print(f'  {record.name:<34} {record.status:<10}{seconds}{extra}', flush=True)
        if record.status in ('failed', 'timed out'):
            for line in text.splitlines()[-6:]:
                print(f'    | {line[:300]}')
        return record

    def write_log(self, text: str) -> None:
        with open(self.log_path, 'a') as log:
            log.write(text)

    def save(self, status: Optional[str] = None) -> None:
        if status:
            self.report['status'] = status
        self.report.update(elapsed_s=round(time.monotonic() - self.t0, 1), steps=[asdict(r) for r in self.records],
                           results=self.results)
        atomic_write_json(self.json_path, self.report, default=str)

    def close(self, status: str) -> None:
        """End every command still running (an interrupted run) and write the final record."""
        for job in list(self.jobs):
            running = job.proc.poll() is None
            job.end(signal.SIGTERM)
            record = job.wait()
            if running:
                record.status = 'interrupted'
            self.jobs.remove(job)
            self.records.append(record)
        self.report['finished'] = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M:%S UTC')
        self.save(status)
