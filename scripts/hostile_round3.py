"""The third careless-user pass (issue 71), for scripts/hostile_inputs.py: output paths that
are not fresh regular files, a run's own files as outputs, duplicated checkpoints, NaN
settings, settings lost on resume, Ctrl-C and SIGTERM anywhere, a server fed hostile JSON,
missing optional extras, corrupt compressed members, and workers that outlive their parent.

Each `Case` here may carry `setup` (run first), `run` (instead of plain `aiayn ARGV`) and
`check` (after; returns a verdict such as "data lost: ..." or None when all is well).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

Result = tuple[int | None, str, str, float]  # exit code (None: hung), stdout, stderr, seconds


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {
        **os.environ,
        "AIAYN_NO_MALLOC_TUNING": "1",
        "OMP_NUM_THREADS": "1",
        **(extra or {}),
    }


def popen(argv: list[str], cwd: Path, *, block: tuple[str, ...] = (), env: Any = None) -> Any:
    """`aiayn ARGV` started in its own process group; `block` names modules to hide (an
    optional extra that is not installed)."""
    if block:
        code = (
            "import sys\n"
            + "".join(f"sys.modules[{m!r}] = None\n" for m in block)
            + "from aiayn.cli import main\nsys.exit(main())"
        )
        cmd = [sys.executable, "-c", code, *argv]
    else:
        cmd = [sys.executable, "-m", "aiayn", *argv]
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env or _env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # a background shell starts us with SIGINT ignored, and children inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def finish(proc: Any, timeout: float, t0: float) -> Result:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err + "\ntimed out", time.perf_counter() - t0
    return proc.returncode, out, err, time.perf_counter() - t0


def descendants(pid: int) -> list[int]:
    """Every live process whose parent chain reaches `pid`, or whose session is `pid`'s
    (workers left behind by a killed parent are re-parented, but keep the session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, ppid, sid = fields[0], int(fields[1]), int(fields[3])
        if state != "Z" and (ppid == pid or sid == pid) and int(entry.name) != pid:
            found.append(int(entry.name))
    return found


def signalled(
    argv: list[str],
    cwd: Path,
    *,
    signals: tuple[int, ...] = (signal.SIGINT,),
    after: float = 3.0,
    gap: float = 0.3,
    wait_for: Callable[[], bool] | None = None,
    to_group: bool = True,
) -> Callable[[], Result]:
    """Start `aiayn ARGV`, send `signals` once it has worked `after` seconds (or once
    `wait_for()` holds), then wait; afterwards stderr gets a line `leftover processes: N`
    for processes of its session still alive 5 s after it ended."""

    def run() -> Result:
        t0 = time.perf_counter()
        proc = popen(argv, cwd)
        deadline = time.perf_counter() + 120
        while time.perf_counter() < deadline and proc.poll() is None:
            if wait_for is not None and wait_for():
                break
            if wait_for is None and time.perf_counter() - t0 > after:
                break
            time.sleep(0.1)
        for i, sig in enumerate(signals):
            if proc.poll() is not None:
                break
            if i:
                time.sleep(gap)
            if to_group and sig == signal.SIGINT:
                os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole group
            else:
                os.kill(proc.pid, sig)
        code, out, err, seconds = finish(proc, 120, t0)
        for _ in range(50):
            left = descendants(proc.pid)
            if not left:
                break
            time.sleep(0.1)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        return code, out, err + f"\nleftover processes: {len(left)}", seconds

    return run


def no_leftovers(what: str = "hang") -> Callable[[Result], str | None]:
    def check(r: Result) -> str | None:
        if "no workers were seen" in r[2]:
            return "other: no worker processes were seen to check"
        if "leftover processes: 0" not in r[2]:
            line = [x for x in r[2].splitlines() if x.startswith("leftover")][-1]
            return f"{what}: workers outlived their parent ({line})"
        return None

    return check


def tmp_left(directory: Path) -> list[str]:
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def unchanged(path: Path) -> Callable[[], Callable[[Result], str | None]]:
    """A check factory: called just before the run, it snapshots `path`; its check says
    "data lost" when the file changed kind or content."""

    def factory() -> Callable[[Result], str | None]:
        before = path.read_bytes() if path.is_file() else None
        kind = path.lstat().st_mode if path.exists() or path.is_symlink() else None

        def check(r: Result) -> str | None:
            now = path.lstat().st_mode if path.exists() or path.is_symlink() else None
            if stat.S_IFMT(now or 0) != stat.S_IFMT(kind or 0):
                return f"data lost: {path} changed kind"
            if before is not None and path.read_bytes() != before:
                return f"data lost: {path} was overwritten"
            return None

        return check

    return factory


def serve_requests(p: dict[str, Path], workers: int = 1) -> Callable[[], Result]:
    """Start `aiayn serve`, POST a lone surrogate and a body nested 100,000 deep, read
    /metrics, then SIGTERM it. stdout gets one JSON line per request: (status, body)."""

    def run() -> Result:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t0 = time.perf_counter()
        argv = ["serve", "--checkpoint", str(p["ckpt"]), "--port", str(port)]
        proc = popen([*argv, "--workers", str(workers)], p["tmp"])
        url = f"http://127.0.0.1:{port}"
        lines = []
        try:
            for _ in range(600):
                try:
                    urllib.request.urlopen(url + "/health", timeout=1).read()
                    break
                except OSError:
                    if proc.poll() is not None:
                        break
                    time.sleep(0.1)
            for body in (
                b'{"text": "\\ud800 abc"}',
                b"[" * 100_000 + b"]" * 100_000,
                b'{"text": "a dog ."}',
            ):
                req = urllib.request.Request(url + "/translate", data=body, method="POST")
                req.add_header("Content-Type", "application/json")
                try:
                    with urllib.request.urlopen(req, timeout=30) as resp:
                        status, text = resp.status, resp.read().decode()
                except urllib.error.HTTPError as e:
                    status, text = e.code, e.read().decode(errors="replace")
                except OSError as e:
                    status, text = 0, str(e)
                lines.append(json.dumps([status, text[:300]]))
            try:
                metrics = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
            except OSError as e:
                metrics = str(e)
            counted = [x for x in metrics.splitlines() if x.startswith("aiayn_requests_total")]
            lines.append(json.dumps(["metrics", counted]))
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        code, out, err, seconds = finish(proc, 60, t0)
        return code, "\n".join(lines) + "\n" + out, err, seconds

    return run


def check_server(r: Result) -> str | None:
    replies = [json.loads(x) for x in r[1].splitlines() if x.startswith("[")]
    if len(replies) < 4:
        return f"traceback: the server did not answer ({r[2].strip().splitlines()[-1:]})"
    for (status, text), what in zip(replies[:2], ("lone surrogate", "nested body"), strict=True):
        if not 400 <= status < 500:
            return f"traceback: {what} answered {status}"
        try:
            json.loads(text)
        except ValueError:
            return f"traceback: {what} answered with no JSON: {text[:80]!r}"
    if replies[2][0] != 200:
        return f"other: a good request answered {replies[2][0]} after the hostile ones"
    counted = " ".join(replies[3][1])
    if 'code="422"' not in counted or 'code="400"' not in counted:
        return f"silent: the refusals are not counted in /metrics ({counted[:120]})"
    return None


def kill9_serve_workers(p: dict[str, Path]) -> Callable[[], Result]:
    """`serve --workers 2`, kill -9 of the server once it answers: its decoding processes
    must go with it."""

    def run() -> Result:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t0 = time.perf_counter()
        argv = ["serve", "--checkpoint", str(p["ckpt"]), "--port", str(port), "--workers", "2"]
        proc = popen(argv, p["tmp"])
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None:
                    break
                time.sleep(0.1)
        workers = descendants(proc.pid)
        proc.kill()
        proc.wait()  # not communicate(): orphaned workers would hold its pipes open
        seconds = time.perf_counter() - t0
        for _ in range(50):
            left = [pid for pid in workers if _state(pid) != "Z"]
            if not left:
                break
            time.sleep(0.1)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        if not workers:
            err += "\nno workers were seen"
        return 0, out, err + f"\nleftover processes: {len(left)}", seconds

    return run


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def restore(p: dict[str, Path]) -> None:
    """Before each try: the special files as built, and the run as trained, so that one
    try's damage (on a tree that loses data) does not count again in the next."""
    tmp = p["tmp"]
    p["devnull"] = tmp / "null"
    if p["devnull"].exists() or p["devnull"].is_symlink():
        mode = p["devnull"].lstat().st_mode
        if not (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
            p["devnull"].unlink()
    if not p["devnull"].exists():
        try:
            os.mknod(p["devnull"], stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a private /dev/null
        except OSError:
            os.mkfifo(p["devnull"])  # not root: a FIFO stands in (also written in place)
    p["fifo"] = tmp / "fifo"
    if p["fifo"].exists() and not stat.S_ISFIFO(p["fifo"].lstat().st_mode):
        p["fifo"].unlink()
    if not p["fifo"].exists():
        os.mkfifo(p["fifo"])
    for name, key, target in (
        ("stdout", "stdout_link", "/proc/self/fd/1"),  # what /dev/stdout is, but ours
        ("link.txt", "link", "target.txt"),
        ("curves_link.png", "png_link", "curves_target.png"),
    ):
        p[key] = tmp / name
        if p[key].exists() or p[key].is_symlink():
            if p[key].is_symlink():
                continue
            p[key].unlink()
        p[key].symlink_to(target)
    p["target"] = tmp / "target.txt"
    p["png_target"] = tmp / "curves_target.png"
    if "run_pristine" in p:
        for f in p["run_pristine"].iterdir():
            mine = p["run"] / f.name
            if f.is_file() and (not mine.is_file() or mine.read_bytes() != f.read_bytes()):
                mine.unlink(missing_ok=True)
                shutil.copy2(f, mine)
        for f in p["run"].iterdir():
            if f.is_file() and not (p["run_pristine"] / f.name).exists():
                f.unlink()


def build(p: dict[str, Path]) -> None:
    """The extra material of this pass, beside what hostile_inputs.build made."""
    tmp = p["tmp"]
    restore(p)
    p["target"].write_text("old\n", encoding="utf-8")
    p["long"] = tmp / "long.en"
    p["long"].write_text(
        "".join(
            f"a man number {i} rides a bike down the long street with two dogs .\n"
            for i in range(6000)
        ),
        encoding="utf-8",
    )
    # a run copy whose newest manifest something else overwrote
    p["run_dm"] = tmp / "run_dm"
    shutil.copytree(p["run"], p["run_dm"])
    (p["run_dm"] / "checkpoint_4.pt.sha256").write_text("a man rides a bike .\n", "utf-8")
    p["run_pristine"] = tmp / "run_pristine"
    shutil.copytree(p["run"], p["run_pristine"])
    # checkpoint_last.pt is a hard link of the newest in the run: so in the pristine copy
    (p["run_pristine"] / "checkpoint_last.pt").unlink()
    os.link(p["run_pristine"] / "checkpoint_4.pt", p["run_pristine"] / "checkpoint_last.pt")
    p["ckpt_copy"] = tmp / "copy_of_checkpoint_4.pt"
    shutil.copyfile(p["run"] / "checkpoint_4.pt", p["ckpt_copy"])
    # a treebank zip with one member's deflate data corrupted
    sample = p["ptb_zip"] = tmp / "treebank.zip"
    src = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "ptb-sample"
    with zipfile.ZipFile(src / "treebank.zip") as z:
        names = [n for n in z.namelist() if n.endswith(".mrg")]
        with zipfile.ZipFile(sample, "w", zipfile.ZIP_DEFLATED) as out:
            for n in names[:3]:
                out.writestr(n, z.read(n))
    data = bytearray(sample.read_bytes())
    with zipfile.ZipFile(sample) as z:
        info = z.getinfo(names[1])
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    for i in range(start + 10, start + min(info.compress_size, 60)):
        data[i] ^= 0x5A
    sample.write_bytes(bytes(data))
    p["ptb_member"] = Path(names[1])
    # a gzip corpus whose deflate data is corrupt (not truncated: flipped in the middle)
    import gzip

    whole = bytearray(gzip.compress(b"a man rides a bike .\n" * 3000))
    for i in range(len(whole) // 2, len(whole) // 2 + 16):
        whole[i] ^= 0xFF
    p["corrupt_gz_pref"] = tmp / "corrupt"
    for lang in ("en", "de"):
        (tmp / f"corrupt.{lang}.gz").write_bytes(bytes(whole))
    p["readonly"] = Path("/proc/aiayn-export")  # nobody may create files there, root neither


def cases(p: dict[str, Path], case: Any, tiny: list[str], multi30k: Path) -> list[Any]:
    """The tries of this pass; `case` is hostile_inputs.Case."""
    s = {k: str(v) for k, v in p.items()}
    tr = ["translate", "--checkpoint", s["ckpt"], "--input", s["src"], "--no-progress"]
    # the tries' model is a translation model: parse decodes freely (the tree constraint,
    # the default, refuses a vocabulary without bracket pieces before any work)
    parse = ["parse", "--checkpoint", s["ckpt"], "--input", s["src"], "--no-progress"]
    parse.append("--no-constrained")
    run = p["run"]
    avg_in = [s["run"] + "/checkpoint_2.pt", s["run"] + "/checkpoint_4.pt"]

    def still(kind: str, path: Path, lines: int | None = None) -> Callable[[Result], str | None]:
        def check(r: Result) -> str | None:
            mode = path.lstat().st_mode
            ok = {"chr": stat.S_ISCHR, "fifo": stat.S_ISFIFO, "link": stat.S_ISLNK}[kind]
            if not ok(mode) and not (kind == "chr" and stat.S_ISFIFO(mode)):
                return f"data lost: {path} is no longer a {kind}"
            return None

        return check

    def stdout_lines(n: int) -> Callable[[Result], str | None]:
        def check(r: Result) -> str | None:
            if len(r[1].splitlines()) != n:
                return f"data lost: {len(r[1].splitlines())} lines on stdout, not {n}"
            if (p["tmp"] / "-").exists():
                return "data lost: wrote a file named '-'"
            if p["stdout_link"].is_symlink() is False:
                return "data lost: the stdout symlink was replaced by a file"
            return None

        return check

    def fifo_read() -> Callable[[Result], str | None]:
        got: list[bytes] = []

        def reader() -> None:
            with open(p["fifo"], "rb") as f:
                got.append(f.read())

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()

        def check(r: Result) -> str | None:
            thread.join(5)
            if not stat.S_ISFIFO(p["fifo"].lstat().st_mode):
                return "data lost: the FIFO was replaced by a file"
            if not got or len(got[0].splitlines()) != 2:
                return f"data lost: the FIFO's reader got {got!r:.80}"
            return None

        return check

    def both(*checks: Callable[[Result], str | None]) -> Callable[[Result], str | None]:
        def check(r: Result) -> str | None:
            for c in checks:
                v = c(r)
                if v:
                    return v
            return None

        return check

    def says(*fragments: str, where: str = "err", cls: str = "silent") -> Any:
        def check(r: Result) -> str | None:
            text = r[2] if where == "err" else r[1]
            missing = [f for f in fragments if f not in text]
            return f"{cls}: does not say {missing}" if missing else None

        return check

    def target_written(r: Result) -> str | None:
        if not p["link"].is_symlink():
            return "data lost: the symlink was replaced by a file"
        if len(p["target"].read_text().splitlines()) != 2:
            return "data lost: the symlink's target was not written"
        return None

    def png_through_link(r: Result) -> str | None:
        if not p["png_link"].is_symlink():
            return "data lost: the symlink was replaced by a file"
        if not p["png_target"].is_file() or p["png_target"].read_bytes()[:4] != b"\x89PNG":
            return "data lost: the symlink's target holds no PNG"
        return None

    def no_partial(directory: Path, out: str) -> Callable[[Result], str | None]:
        def check(r: Result) -> str | None:
            left = tmp_left(directory)
            if left:
                return f"data lost: temporary files left: {left}"
            if Path(out).exists() and r[0] != 0:
                return f"data lost: a partial {out} was left"
            return None

        return check

    def tmp_gone_at_next_write(argv: list[str]) -> Callable[[Result], str | None]:
        """After a kill -9 (no handler runs), the next write of the same output removes
        the temporary file the killed writer left."""

        def check(r: Result) -> str | None:
            subprocess.run(
                [sys.executable, "-m", "aiayn", *argv], env=_env(), capture_output=True,
                timeout=120, cwd=p["tmp"],
            )  # fmt: skip
            left = tmp_left(p["tmp"])
            return f"hang: the killed writer's temporary file outlived it: {left}" if left else None

        return check

    def resumed_with_settings(r: Result) -> str | None:
        cfg = json.loads((p["tmp"] / "r3run" / "config.json").read_text())
        if cfg["train"]["valid_bleu_interval_steps"] != 2:
            return "silent: the first start's --set was lost on resume"
        if "train.max_steps changed" not in r[2]:
            return "silent: the changed max_steps was not said"
        return None

    interrupt = dict(signals=(signal.SIGINT,))
    long_tr = ["translate", "--checkpoint", s["ckpt"], "--input", s["long"], "--no-progress"]
    out_long = s["tmp"] + "/long.de"
    bigpref = p["tmp"] / "big"
    if not (p["tmp"] / "big.en").exists():
        import gzip

        for lang in ("en", "de"):
            with gzip.open(multi30k / f"train.{lang}.gz", "rb") as f:
                (p["tmp"] / f"big.{lang}").write_bytes(f.read() * 3)  # long enough to stop
    prep_big = ["prepare", "-s", "en", "-t", "de", "--trainpref", str(bigpref)]
    r3 = ["train", s["prep"], "--out", s["tmp"] + "/r3run"]
    return [
        # ---------------------------------------------------------------- data lost
        case(
            "translate",
            "--output a device node (/dev/null's kind)",
            [*tr, "--output", s["devnull"]],
            (0,),
            check=still("chr", p["devnull"]),
        ),
        case(
            "translate",
            "--output a FIFO",
            [*tr, "--output", s["fifo"]],
            (0,),
            check_factory=fifo_read,
        ),
        case(
            "translate",
            "--output a symlink to /proc/self/fd/1 (/dev/stdout)",
            [*tr, "--output", s["stdout_link"]],
            (0,),
            check=stdout_lines(2),
        ),
        case("translate", "--output -", [*tr, "--output", "-"], (0,), check=stdout_lines(2)),
        case(
            "translate",
            "--output a symlink to a file",
            [*tr, "--output", s["link"]],
            (0,),
            check=target_written,
        ),
        case(
            "translate",
            "--output on another filesystem (/dev/shm)",
            [*tr, "--output", f"/dev/shm/aiayn-hostile-{os.getpid()}.txt"],
            (0,),
        ),
        case(
            "parse",
            "--output a device node",
            [*parse, "--output", s["devnull"]],
            (0,),
            check=still("chr", p["devnull"]),
        ),
        case("parse", "--output -", [*parse, "--output", "-"], (0,), check=stdout_lines(2)),
        case(
            "average",
            "--out a device node (no --force)",
            ["average", *avg_in, "--out", s["devnull"]],
            (0,),
            check=still("chr", p["devnull"]),
        ),
        case(
            "average",
            "--out -",
            ["average", *avg_in, "--out", "-"],
            check=lambda r: "data lost: wrote '-'" if (p["tmp"] / "-").exists() else None,
        ),
        *[
            case(
                "translate",
                f"--output the run's {name}{' --force' * force}",
                [*tr, "--output", str(run / name), *(["--force"] * force)],
                check_factory=unchanged(run / name),
            )
            for name, force in (
                ("checkpoint_4.pt.sha256", False),
                ("checkpoint_4.pt.sha256", True),
                ("config.json", True),
                ("train_log.jsonl", False),
                ("trainer.lock", False),
            )
        ],
        case(
            "parse",
            "--output the run's checkpoint_2.pt.sha256",
            [*parse, "--output", str(run / "checkpoint_2.pt.sha256")],
            check_factory=unchanged(run / "checkpoint_2.pt.sha256"),
        ),
        case(
            "average",
            "--out the run's checkpoint_2.pt --force",
            [
                "average",
                str(run / "checkpoint_4.pt"),
                "--out",
                str(run / "checkpoint_2.pt"),
                "--force",
            ],
            check_factory=unchanged(run / "checkpoint_2.pt"),
        ),
        case(
            "translate",
            "a checkpoint whose manifest was overwritten",
            ["translate", "--checkpoint", s["run_dm"] + "/checkpoint_4.pt", "--input", s["src"]],
            check=says("manifest", "damaged", "remove"),
        ),
        case(
            "export",
            "--out RUN_DIR --force",
            [
                "export",
                "--checkpoint",
                s["ckpt"],
                "--to",
                "ctranslate2",
                "--out",
                s["run"],
                "--force",
            ],
            check_factory=unchanged(run / "config.json"),
        ),
        case(
            "export",
            "--out a device node",
            ["export", "--checkpoint", s["ckpt"], "--to", "ctranslate2", "--out", s["devnull"]],
            check=still("chr", p["devnull"]),
        ),
        case(
            "prepare",
            "--out a device node",
            [
                "prepare",
                "-s",
                "en",
                "-t",
                "de",
                "--trainpref",
                s["tmp"] + "/train",
                "--out",
                s["devnull"],
            ],
            check=still("chr", p["devnull"]),
        ),
        case(
            "prepare",
            "--out a training run's directory",
            [
                "prepare",
                "-s",
                "en",
                "-t",
                "de",
                "--trainpref",
                s["tmp"] + "/train",
                "--out",
                s["run"],
                "--force",
            ],
            check_factory=unchanged(run / "config.json"),
        ),
        case(
            "data",
            "--out a device node",
            [
                "data",
                "multi30k",
                "--from",
                str(multi30k),
                "--out",
                s["devnull"],
                "--splits",
                "val",
                "--langs",
                "en",
            ],
            check=still("chr", p["devnull"]),
        ),
        case(
            "plot",
            "--out a symlink to a .png",
            ["plot", s["run"], "--out", s["png_link"]],
            (0,),
            check=png_through_link,
        ),
        case(
            "plot",
            "--out a device node",
            ["plot", s["run"], "--out", s["devnull"]],
            check=still("chr", p["devnull"]),
        ),
        case(
            "table1",
            "--out a device node",
            ["table1", "--n-max", "32", "--out", s["devnull"]],
            check=still("chr", p["devnull"]),
        ),
        case(
            "attention",
            "--out a device node",
            ["attention", "--checkpoint", s["ckpt"], "--text", "A dog.", "--out", s["devnull"]],
            check=still("chr", p["devnull"]),
        ),
        # ---------------------------------------------------------------- silent
        case(
            "average",
            "checkpoint_last.pt with the checkpoint it links",
            [
                "average",
                str(run / "checkpoint_4.pt"),
                str(run / "checkpoint_last.pt"),
                "--out",
                s["tmp"] + "/avg_dup1.pt",
            ],
            (0,),
            check=both(says("averaged 1 checkpoints", where="out"), says("same file")),
        ),
        case(
            "average",
            "one checkpoint listed twice",
            [
                "average",
                str(run / "checkpoint_2.pt"),
                str(run / "checkpoint_2.pt"),
                "--out",
                s["tmp"] + "/avg_dup2.pt",
            ],
            (0,),
            check=both(says("averaged 1 checkpoints", where="out"), says("same file")),
        ),
        case(
            "average",
            "a checkpoint and a copy of it",
            [
                "average",
                str(run / "checkpoint_4.pt"),
                s["ckpt_copy"],
                "--out",
                s["tmp"] + "/avg_dup3.pt",
            ],
            (0,),
            check=both(says("averaged 1 checkpoints", where="out"), says("a copy")),
        ),
        *[
            case(
                "train",
                f"--set {kv}",
                [
                    "train",
                    s["prep"],
                    "--out",
                    s["tmp"] + "/tnan",
                    *tiny,
                    "--set",
                    kv,
                    "--max-steps",
                    "3",
                ],
                (2,),  # refused before any work: exit 1 after training on NaN is too late
            )
            for kv in (
                "train.lr_scale=nan",
                "train.lr_scale=inf",
                "decode.alpha=nan",
                "train.max_minutes=nan",
                "P_drop=nan",
                "train.max_steps=inf",
            )
        ],
        case(
            "train",
            "--max-minutes nan",
            ["train", s["prep"], "--out", s["tmp"] + "/tnan2", *tiny, "--max-minutes", "nan"],
        ),
        case("translate", "--alpha inf", [*tr, "--alpha", "inf"]),
        case("translate", "--max-len-a nan", [*tr, "--max-len-a", "nan"]),
        case("serve", "--alpha nan", ["serve", "--checkpoint", s["ckpt"], "--alpha", "nan"]),
        case(
            "bench", "decode --alpha nan", ["bench", "decode", "--preset", "tiny", "--alpha", "nan"]
        ),
        case(
            "train",
            "resume without the first start's --set (BLEU interval)",
            [*r3, "--max-steps", "4"],
            (0,),
            setup=[
                *r3,
                *tiny,
                "--max-steps",
                "2",
                "--save-interval-steps",
                "2",
                "--set",
                "train.valid_interval_steps=2",
                "--set",
                "train.valid_bleu_interval_steps=2",
            ],
            check=resumed_with_settings,
        ),
        case(
            "train",
            "resume with another model (--set d_model=64)",
            [*r3, *tiny, "--set", "d_model=64", "--set", "d_k=32", "--set", "d_v=32"],
            check=says("model.d_model", cls="silent"),
        ),
        # ---------------------------------------------------------------- tracebacks
        case(
            "translate",
            "Ctrl-C while decoding",
            [*long_tr, "--output", out_long, "--beam", "4"],
            (130,),
            run_factory=lambda a: signalled(a, p["tmp"], after=4, **interrupt),
            check=no_partial(p["tmp"], out_long),
        ),
        case(
            "translate",
            "Ctrl-C while decoding, --workers 2",
            [*long_tr, "--output", out_long, "--beam", "4", "--workers", "2"],
            (130,),
            run_factory=lambda a: signalled(a, p["tmp"], after=5, **interrupt),
            check=both(no_partial(p["tmp"], out_long), no_leftovers()),
        ),
        case(
            "parse",
            "Ctrl-C while decoding",
            [
                "parse",
                "--checkpoint",
                s["ckpt"],
                "--input",
                s["long"],
                "--no-progress",
                "--no-constrained",
                "--output",
                s["tmp"] + "/long.trees",
            ],
            (130,),
            run_factory=lambda a: signalled(a, p["tmp"], after=4, **interrupt),
            check=no_partial(p["tmp"], s["tmp"] + "/long.trees"),
        ),
        case(
            "prepare",
            "Ctrl-C (in memory)",
            [*prep_big, "--out", s["tmp"] + "/pint", "--vocab-size", "8000"],
            (130,),
            run_factory=lambda a: signalled(a, p["tmp"], after=3, **interrupt),
            check=no_partial(p["tmp"] / "pint", s["tmp"] + "/pint/manifest.json"),
        ),
        case(
            "prepare",
            "Ctrl-C (--streaming --workers 2)",
            [
                *prep_big,
                "--out",
                s["tmp"] + "/pstr",
                "--vocab-size",
                "8000",
                "--streaming",
                "--workers",
                "2",
            ],
            (130,),
            # once it encodes (its temporary arrays appear): the workers have started
            run_factory=lambda a: signalled(
                a,
                p["tmp"],
                wait_for=lambda: (
                    (p["tmp"] / "pstr").is_dir() and bool(os.listdir(p["tmp"] / "pstr"))
                ),
                **interrupt,
            ),
            check=no_leftovers("traceback"),
        ),
        case(
            "export",
            "Ctrl-C",
            [
                "export",
                "--checkpoint",
                s["ckpt"],
                "--to",
                "ctranslate2",
                "--out",
                s["tmp"] + "/xint",
            ],
            (130, 0),
            run_factory=lambda a: signalled(a, p["tmp"], after=0.8, **interrupt),
            check=lambda r: (
                "data lost: temporary export left"
                if any(x.startswith(".xint") for x in os.listdir(p["tmp"]))
                else None
            ),
        ),
        case(
            "train",
            "Ctrl-C twice",
            [
                "train",
                s["prep"],
                "--out",
                s["tmp"] + "/tint",
                *tiny,
                "--max-steps",
                "100000",
                "--save-interval-steps",
                "1",
            ],
            (130,),
            run_factory=lambda a: signalled(
                a, p["tmp"], after=12, signals=(signal.SIGINT, signal.SIGINT), gap=0.05
            ),
        ),
        case(
            "serve",
            "a lone surrogate; a body nested 100,000 deep",
            ["serve"],
            (0,),
            run_factory=lambda a: serve_requests(p),
            check=check_server,
        ),
        *[
            case(
                cmd,
                f"without {', '.join(block)}",
                argv,
                block=block,
                check=says(f"pip install 'aiayn[{extra}]'", cls="traceback"),
            )
            for cmd, argv, block, extra in (
                (
                    "attention",
                    [
                        "attention",
                        "--checkpoint",
                        s["ckpt"],
                        "--text",
                        "A dog.",
                        "--out",
                        s["tmp"] + "/att",
                    ],
                    ("matplotlib",),
                    "plot",
                ),
                (
                    "table1",
                    ["table1", "--n-max", "32", "--out", s["tmp"] + "/t1b"],
                    ("matplotlib",),
                    "plot",
                ),
                ("plot", ["plot", s["run"], "--out", s["tmp"] + "/c.png"], ("matplotlib",), "plot"),
                ("serve", ["serve", "--checkpoint", s["ckpt"]], ("fastapi",), "serve"),
                ("serve", ["serve", "--checkpoint", s["ckpt"]], ("uvicorn",), "serve"),
                (
                    "export",
                    [
                        "export",
                        "--checkpoint",
                        s["ckpt"],
                        "--to",
                        "ctranslate2",
                        "--out",
                        s["tmp"] + "/x1",
                    ],
                    ("ctranslate2",),
                    "export",
                ),
                (
                    "export",
                    [
                        "export",
                        "--checkpoint",
                        s["ckpt"],
                        "--to",
                        "marian",
                        "--out",
                        s["tmp"] + "/x2",
                    ],
                    ("transformers",),
                    "export",
                ),
            )
        ],
        case(
            "train",
            "without tensorboard",
            ["train", s["prep"], "--out", s["tmp"] + "/ttb", *tiny, "--max-steps", "1"],
            (0,),
            block=("tensorboard", "torch.utils.tensorboard"),
            check=says("pip install 'aiayn[watch]'"),
        ),
        case(
            "data",
            "ptb --from a zip with a corrupt member",
            ["data", "ptb", "--from", s["ptb_zip"], "--out", s["tmp"] + "/ptbc"],
            check=says(str(p["ptb_member"]), cls="traceback"),
        ),
        case(
            "prepare",
            "--trainpref a corrupt (not truncated) .gz",
            [
                "prepare",
                "-s",
                "en",
                "-t",
                "de",
                "--trainpref",
                s["corrupt_gz_pref"],
                "--out",
                s["tmp"] + "/pgz",
            ],
            check=says("corrupt.en.gz", cls="traceback"),
        ),
        case(
            "prepare",
            "--streaming --trainpref a corrupt .gz",
            [
                "prepare",
                "-s",
                "en",
                "-t",
                "de",
                "--trainpref",
                s["corrupt_gz_pref"],
                "--out",
                s["tmp"] + "/pgz2",
                "--streaming",
            ],
            check=says("corrupt.en.gz", cls="traceback"),
        ),
        case(
            "evaluate",
            "--hyp a corrupt .gz",
            ["evaluate", "--hyp", s["tmp"] + "/corrupt.en.gz", "--ref", s["src"]],
            check=says("corrupt.en.gz", cls="traceback"),
        ),
        # ---------------------------------------------------------------- hangs
        case(
            "translate",
            "SIGTERM, --workers 2",
            [*long_tr, "--output", out_long, "--beam", "4", "--workers", "2"],
            (143,),
            run_factory=lambda a: signalled(a, p["tmp"], after=5, signals=(signal.SIGTERM,)),
            check=both(no_leftovers(), no_partial(p["tmp"], out_long)),
        ),
        case(
            "translate",
            "kill -9, --workers 2",
            [*long_tr, "--output", out_long, "--beam", "4", "--workers", "2"],
            (-9,),
            run_factory=lambda a: signalled(a, p["tmp"], after=5, signals=(signal.SIGKILL,)),
            check=both(no_leftovers(), tmp_gone_at_next_write([*tr, "--output", out_long])),
        ),
        case(
            "serve",
            "kill -9, --workers 2",
            ["serve"],
            (0,),
            run_factory=lambda a: kill9_serve_workers(p),
            check=no_leftovers(),
        ),
        # ---------------------------------------------------------------- also
        case(
            "data",
            "multi30k offline",
            ["data", "multi30k", "--out", s["tmp"] + "/off1", "--splits", "val"],
            env={"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"},
            check=says("--from", cls="other"),
        ),
        case(
            "data",
            "ptb offline",
            ["data", "ptb", "--out", s["tmp"] + "/off2"],
            env={"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"},
            check=says("--from", cls="other"),
        ),
        case(
            "export",
            "--out on a read-only filesystem",
            [
                "export",
                "--checkpoint",
                s["ckpt"],
                "--to",
                "ctranslate2",
                "--out",
                s["readonly"] + "/x",
            ],
            check=says(s["readonly"], cls="other"),
        ),
        case(
            "export",
            "a full disk (file size limit)",
            [
                "export",
                "--checkpoint",
                s["ckpt"],
                "--to",
                "ctranslate2",
                "--out",
                s["tmp"] + "/xfull",
            ],
            fsize=4096,
            check=says(s["tmp"] + "/xfull", cls="other"),
        ),
    ]
