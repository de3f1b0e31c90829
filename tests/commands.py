"""`python -m MODULE ARGS` as a fresh process forked from one that has imported diffzoo, for the suite's many short
commands (--help, usage errors, listings): each answers in a fraction of a second where a new interpreter spends
about 7 s of a core importing torch, timm, open_clip and transformers before its parser runs.

Every `python -m diffzoo.X` imports the package `diffzoo` first, and with it those libraries (`import diffzoo`
registers its models with them); the server (`SERVER`) does only that, with HF_HUB_OFFLINE=1 set before, as the
suite sets it for every process. Each command then runs in its own child of the server, forked before any thread
was started: the module run as `python -m` runs it (`runpy.run_module(…, run_name='__main__', alter_sys=True)`:
sys.argv[0] its file), in `cwd`, its file descriptors 1 and 2 written to files (what C code prints included), its
exit status as the interpreter would give it (SystemExit's code, 1 and the traceback for an exception). The child
also reports which of the modules it is asked about are imported when it ends (what `--help` must not import).
Commands that start processes, train or download still run as processes of their own, elsewhere in the suite."""
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable, List, Optional

ROOT = Path(__file__).resolve().parents[1]

SERVER = r'''
import atexit, json, os, runpy, sys, traceback
import diffzoo  # noqa: F401  what every `python -m diffzoo.X` imports first


def child(request):
    out, err = (os.open(request[k], os.O_WRONLY | os.O_CREAT | os.O_TRUNC) for k in ('stdout', 'stderr'))
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # not the server's requests
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.chdir(request['cwd'])
    sys.argv = [request['module'], *request['args']]
    code = 0
    try:
        runpy.run_module(request['module'], run_name='__main__', alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    with open(request['imported'], 'w') as f:
        json.dump(sorted(m for m in request['watch'] if m in sys.modules), f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
'''


class Done(subprocess.CompletedProcess):
    """A command's exit status and output, as subprocess.run gives them, and `imported`: which of the modules it
    was asked about it imported."""
    imported: List[str]


class Commands:
    """The server process (module docstring), started once; `run` asks it for one command at a time."""

    def __init__(self):
        env = dict(os.environ, HF_HUB_OFFLINE='1')
        self.server = subprocess.Popen([sys.executable, '-c', SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, cwd=ROOT, env=env, start_new_session=True)
        self.files = tempfile.TemporaryDirectory(prefix='diffzoo-commands-')

    def run(self, module: str, args: Iterable[str] = (), cwd: Optional[Path] = None, watch: Iterable[str] = (),
            timeout: float = 300) -> Done:
        """`python -m module *args` in `cwd` (the repository's root by default)."""
        files = {k: os.path.join(self.files.name, k) for k in ('stdout', 'stderr', 'imported')}
        for path in files.values():
            if os.path.exists(path):
                os.remove(path)
        args = [str(a) for a in args]
        request = dict(files, module=module, args=args, cwd=str(cwd or ROOT), watch=list(watch))
        self.server.stdin.write(json.dumps(request) + '\n')
        self.server.stdin.flush()
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        line = self.server.stdout.readline() if ready else ''
        if not line:
            self.close()
            raise RuntimeError(f'python -m {module} {" ".join(args)}: no answer from the command server within '
                               f'{timeout} s (exit status {self.server.poll()})')
        done = Done(['python', '-m', module, *args], json.loads(line), *(Path(files[k]).read_text(errors='replace')
                                                                           for k in ('stdout', 'stderr')))
        imported = Path(files['imported'])
        done.imported = json.loads(imported.read_text()) if imported.is_file() else []
        return done

    def close(self) -> None:
        """The server ended, with a command still running (its process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.server.pid, signal.SIGKILL)
        self.server.wait()
        self.files.cleanup()
