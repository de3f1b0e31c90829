"""Image–caption data made by the tests: coloured shapes, webdataset shards, an HTTP server."""
import contextlib
import functools
import http.server
import io
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import webdataset as wds
from PIL import Image, ImageDraw

from diffzoo.data.synthetic import CorpusConfig, SceneObject, draw_object, make_scene

CORRUPT_JPEG = b'\xff\xd8\xff\xe0' + b'\x00not a jpeg at all' * 8


def picture(colour: str, shape: str, size=(96, 80), seed: int = 0) -> Image.Image:
    """A `colour` `shape` drawn as diffzoo.data.synthetic draws it, on a grey background at a random place."""
    rng = random.Random(seed)
    img = Image.new('RGB', size, (128, 128, 128))
    r = min(size) // 3
    centre = (rng.randint(r, size[0] - r), rng.randint(r, size[1] - r))
    draw_object(ImageDraw.Draw(img), SceneObject(shape, colour, 'large', centre, r))
    return img


def scenes(n: int = 2, size: int = 96):
    """The first `n` validation scenes of diffzoo.data.synthetic's corpus, `size` px."""
    return [make_scene(0, 'val', i, CorpusConfig(image_size=size))[0] for i in range(n)]


def jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, 'JPEG', quality=90)
    return buf.getvalue()


def sample(i: int, seed: int = 0):
    """Scene `i` of diffzoo.data.synthetic (96 px) and its caption."""
    image, description = make_scene(seed, 'tests', i, CorpusConfig(image_size=96))
    return image, description['caption']


def write_shards(directory, n_shards: int, per_shard: int, seed: int = 0, corrupt=(), no_caption=(),
                 empty=(), sizes: bool = True, members=None) -> dict:
    """Shards NNNNN.tar of jpg/txt/json samples; `corrupt`/`no_caption` are (shard, index) pairs,
    `empty` shard numbers written without members, `members` {(shard, index): {ext: bytes}} members
    written as given instead. Returns {shard name: samples with an image}."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    counts = {}
    for s in range(n_shards):
        name = f'{s:05d}.tar'
        with wds.TarWriter(str(directory / name)) as writer:
            n = 0 if s in empty else per_shard
            for i in range(n):
                img, text = sample(s * per_shard + i, seed)
                record = {'__key__': f'{s:05d}{i:04d}', 'jpg': CORRUPT_JPEG if (s, i) in corrupt else jpeg(img),
                          'json': json.dumps({'caption': text}).encode()}
                if (s, i) not in no_caption:
                    record['txt'] = text
                record.update((members or {}).get((s, i), {}))
                writer.write(record)
        counts[name] = 0 if s in empty else per_shard
    if sizes:
        (directory / 'sizes.json').write_text(json.dumps(counts))
    return counts


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def http_server(directory):
    """A real HTTP server for `directory` on 127.0.0.1; yields its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f'http://127.0.0.1:{server.server_address[1]}'
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def python_env(**extra) -> dict:
    """Environment for subprocesses running this interpreter's diffzoo, offline and quiet."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE='1', NO_ALBUMENTATIONS_UPDATE='1', PYTHONUNBUFFERED='1', OMP_NUM_THREADS='1')
    env['PATH'] = str(Path(sys.executable).parent) + os.pathsep + env.get('PATH', '')
    env.pop('WORLD_SIZE', None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, cwd, timeout=300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=python_env(**env), capture_output=True, text=True, timeout=timeout)


def call(main, argv, cwd) -> subprocess.CompletedProcess:
    """A command line's `main(argv)` run in this process from `cwd`, as `run` reports a process: its exit
    status (an argparse exit included), stdout and stderr. For commands whose own process adds nothing
    to what a test checks; each entry point keeps one test in a real process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(map(str, argv)))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 2
    return subprocess.CompletedProcess(argv, code or 0, out.getvalue(), err.getvalue())


def serve_dataset(directory, n_images: int, missing: int, corrupt: int = 1, seed: int = 0):
    """Pictures to serve as `directory/img_NNN.jpg` (+ `bad_N.jpg`, not JPEGs), and the URL paths of a
    dataset list in that order with `missing` paths that do not exist. Returns [(caption, path)]."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n_images):
        img, text = sample(i, seed)
        (directory / f'img_{i:03d}.jpg').write_bytes(jpeg(img))
        rows.append((text, f'/img_{i:03d}.jpg'))
    for j in range(corrupt):
        (directory / f'bad_{j}.jpg').write_bytes(CORRUPT_JPEG)
        rows.insert((j + 1) * len(rows) // (corrupt + 1), ('a green square', f'/bad_{j}.jpg'))
    for j in range(missing):
        rows.insert((j + 1) * len(rows) // (missing + 1), ('a blue circle', f'/gone_{j}.jpg'))
    return rows


def descendants(pid: int) -> list:
    children = {}
    for stat in Path('/proc').glob('[0-9]*/stat'):
        try:
            ppid = int(stat.read_text().rsplit(')', 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant, as a node that loses power would. torchrun starts
    its workers in sessions of their own, so a process-group kill would leave them running."""
    stopped = set()
    for _ in range(3):  # freeze first, so nothing forks between the scan and the kill
        for p in set(descendants(pid)) - stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
            stopped.add(p)
    for p in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def hub_cache(cache, repo, files):
    """An offline Hugging Face cache holding `repo` at one commit: every file of `files` (a folder or a file)."""
    commit = '0123456789abcdef0123456789abcdef01234567'
    repo_dir = cache / f'models--{repo.replace("/", "--")}'
    (repo_dir / 'refs').mkdir(parents=True)
    (repo_dir / 'refs' / 'main').write_text(commit)
    snapshot = repo_dir / 'snapshots' / commit
    snapshot.mkdir(parents=True)
    for f in (sorted(files.iterdir()) if files.is_dir() else [files]):
        (snapshot / f.name).symlink_to(f)
    return cache


def wilson(hits, n, z=1.959963984540054):
    """The 95 % Wilson score interval of hits/n, in percent, from its formula (the demos' reports are held to it)."""
    p = hits / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return 100 * (centre - half) / (1 + z * z / n), 100 * (centre + half) / (1 + z * z / n)


def as_in_a_terminal():
    """Popen's preexec_fn for a process a test sends Ctrl-C: SIGINT's default action, as a terminal's foreground job
    has it (a suite started in the background of a non-interactive shell passes SIGINT on ignored, and then neither
    Python nor bash ever sees it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
