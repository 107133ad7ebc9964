"""A careless user's third pass (issue 71): output paths that are not fresh regular files, a
run's own files as outputs, one model averaged twice, NaN settings, settings lost on resume,
Ctrl-C and SIGTERM anywhere, missing optional extras, corrupt compressed input, and workers
that outlive their parent. Each test names its row of docs/reliability.md; negative
controls show that the same commands, given right, still work. The server's rows (G7) are in
tests/deploy/test_server.py."""

from __future__ import annotations

import errno
import gzip
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from aiayn.checkpoints import load_checkpoint, save_checkpoint_file
from aiayn.files import atomic_write, check_output_file, output_kind, sha256_file
from aiayn.training.trainer import train
from helpers import MULTI30K, ROOT, SMALL_TRAINING, assert_one_line_error, cli, tiny_config

SMALL = {**SMALL_TRAINING, "max_steps": 10, "save_interval_steps": 5}
ENV = {**os.environ, "AIAYN_NO_MALLOC_TUNING": "1", "OMP_NUM_THREADS": "1"}
#: The tiny model as --set flags (steps and save intervals left to each command line)
TINY_FLAGS = [
    a
    for k, v in SMALL_TRAINING.items()
    if k not in ("max_steps", "save_interval_steps")
    for a in ("--set", f"{k}={v}")
]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _no_reexec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIAYN_NO_MALLOC_TUNING", "1")


@pytest.fixture(scope="module")
def run_dir(small_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 10-step run with checkpoints at steps 5 and 10."""
    run = tmp_path_factory.mktemp("round3") / "run"
    train(tiny_config(SMALL), small_data, run)
    return run


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "source.en"
    path.write_text("A man rides a bike .\nTwo dogs play .\n", encoding="utf-8")
    return path


def translate(*argv: str | Path, checkpoint: Path) -> tuple[int, str, str]:
    return cli("translate", "--checkpoint", checkpoint, "--no-progress", "--beam", "1", *argv)


def device_node(path: Path) -> Path:
    """A private character device like /dev/null (root only), else skip."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except OSError:
        pytest.skip("mknod is not allowed here")
    return path


def aiayn(*argv: str | Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "aiayn", *map(str, argv)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # a background shell starts pytest with SIGINT ignored, and children inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def session_processes(sid: int) -> list[int]:
    """Live processes of the session `sid` (workers keep it when re-parented)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[3]) == sid:
                found.append(int(entry.name))
    return found


def gone_within(sid: int, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = session_processes(sid)
        if not left:
            return []
        time.sleep(0.1)
    left = session_processes(sid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


# ------------------------------------------------------------------ F18: kinds of output path
@pytest.mark.rows("F18")
def test_translate_writes_a_device_a_fifo_and_a_symlink_in_place(
    run_dir: Path, source: Path, tmp_path: Path
) -> None:
    ckpt = run_dir / "checkpoint_last.pt"
    null = device_node(tmp_path / "null")
    code, _, err = translate("--input", source, "--output", null, checkpoint=ckpt)
    assert code == 0, err
    assert stat.S_ISCHR(null.lstat().st_mode)  # before: renamed over, a regular file
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    code, _, err = translate("--input", source, "--output", fifo, checkpoint=ckpt)
    reader.join(10)
    assert code == 0, err
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and len(got[0].splitlines()) == 2
    target, link = tmp_path / "hyp.de", tmp_path / "link.de"
    target.write_text("old\n", encoding="utf-8")
    link.symlink_to(target.name)
    code, _, err = translate("--input", source, "--output", link, checkpoint=ckpt)
    assert code == 0, err
    assert link.is_symlink() and len(target.read_text(encoding="utf-8").splitlines()) == 2


@pytest.mark.rows("F18")
def test_dash_and_dev_stdout_are_standard_output(
    run_dir: Path, source: Path, tmp_path: Path
) -> None:
    """`-` as Unix tools read it; a symlink to /proc/self/fd/1 (what /dev/stdout is, made
    here so that the test never touches the machine's /dev/stdout) is written through."""
    link = tmp_path / "stdout"
    link.symlink_to("/proc/self/fd/1")
    for out in ("-", link):
        proc = aiayn(
            "translate", "--checkpoint", run_dir / "checkpoint_last.pt", "--input", source,
            "--output", out, "--beam", "1", "--no-progress",
        )  # fmt: skip
        stdout, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert len(stdout.splitlines()) == 2
    assert link.is_symlink() and not (Path.cwd() / "-").exists()


@pytest.mark.rows("F18")
def test_average_and_parse_write_a_device_in_place(run_dir: Path, tmp_path: Path) -> None:
    null = device_node(tmp_path / "null")
    code, out, err = cli("average", run_dir / "checkpoint_5.pt", "--out", null)  # no --force
    assert code == 0, err
    assert stat.S_ISCHR(null.lstat().st_mode) and not (tmp_path / "null.sha256").exists()
    code, _, err = cli("average", run_dir / "checkpoint_5.pt", "--out", "-")
    assert code == 2
    assert_one_line_error(err, "standard output")
    src = tmp_path / "s.en"
    src.write_text("A dog .\n", encoding="utf-8")
    code, _, err = cli(
        "parse", "--checkpoint", run_dir / "checkpoint_last.pt", "--input", src, "--output",
        null, "--no-progress", "--beam", "1", "--no-constrained",  # a translation model
    )  # fmt: skip
    assert code == 0, err
    assert stat.S_ISCHR(null.lstat().st_mode)


@pytest.mark.rows("F18")
def test_directory_outputs_refuse_a_device_and_stdout(
    run_dir: Path, small_data: Path, tmp_path: Path
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for argv in (
        ["prepare", "-s", "en", "-t", "de", "--trainpref", tmp_path / "x", "--out", fifo],
        ["export", "--checkpoint", run_dir / "checkpoint_5.pt", "--to", "marian", "--out", "-"],
        ["table1", "--out", fifo],
    ):
        code, _, err = cli(*argv)
        assert code == 2, err
        assert_one_line_error(err, "give a directory" if argv[-1] != "-" else "standard output")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


@pytest.mark.rows("F18")
def test_a_rename_refused_by_a_mount_point_rewrites_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bind-mounted file (docker -v file:file) cannot be renamed over (EBUSY), nor across
    filesystems (EXDEV): its content is rewritten in place, from the finished temp file."""
    path = tmp_path / "mounted.txt"
    path.write_text("old content, longer than the new\n", encoding="utf-8")
    real = os.replace

    def busy(a: str | Path, b: str | Path) -> None:
        if Path(b) == path:
            raise OSError(errno.EBUSY, "Device or resource busy")
        real(a, b)

    monkeypatch.setattr(os, "replace", busy)
    with atomic_write(path, "w") as f:
        f.write("new\n")
    assert path.read_text(encoding="utf-8") == "new\n"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_output_kinds(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    (tmp_path / "l").symlink_to("f")
    (tmp_path / "dangling").symlink_to("nowhere")
    os.mkfifo(tmp_path / "p")
    assert output_kind("-") == output_kind("/dev/stdout") == output_kind("/dev/fd/1") == "stdout"
    assert output_kind("/dev/stderr") == output_kind(f"/proc/{os.getpid()}/fd/2") == "stream"
    assert output_kind(tmp_path / "f") == "file"
    assert output_kind(tmp_path / "l") == output_kind(tmp_path / "dangling") == "symlink"
    assert output_kind(tmp_path / "p") == output_kind("/dev/null") == "stream"
    assert output_kind(tmp_path) == "directory" and output_kind(tmp_path / "new") == "new"
    assert check_output_file(tmp_path / "l") == tmp_path / "f"  # said, and followed


# ------------------------------------------------------------------ B9: a run's own files
@pytest.mark.rows("B9")
@pytest.mark.parametrize(
    "name", ["checkpoint_5.pt.sha256", "config.json", "train_log.jsonl", "trainer.lock"]
)
def test_a_run_file_is_never_an_output(run_dir: Path, source: Path, name: str) -> None:
    target = run_dir / name
    before = target.read_bytes()
    for force in ((), ("--force",)):
        code, _, err = translate(
            "--input", source, "--output", target, *force, checkpoint=run_dir / "checkpoint_5.pt"
        )
        assert code == 2
        assert_one_line_error(err, str(target), "never the output")
        assert target.read_bytes() == before


@pytest.mark.rows("B9")
def test_average_and_export_never_replace_a_run(run_dir: Path, tmp_path: Path) -> None:
    ckpt = run_dir / "checkpoint_5.pt"
    digest = sha256_file(ckpt)
    code, _, err = cli("average", run_dir / "checkpoint_10.pt", "--out", ckpt, "--force")
    assert code == 2
    assert_one_line_error(err, str(ckpt), "never the output")
    assert sha256_file(ckpt) == digest
    config = (run_dir / "config.json").read_bytes()
    code, _, err = cli(
        "export", "--checkpoint", ckpt, "--to", "marian", "--out", run_dir, "--force"
    )
    assert code == 2
    assert_one_line_error(err, "training run's directory")
    assert (run_dir / "config.json").read_bytes() == config
    # negative control: an average beside the run, and replacing an earlier average
    for _ in range(2):
        code, _, err = cli("average", run_dir, "--last", "2", "--out", tmp_path / "avg.pt")
        assert code == 0, err


@pytest.mark.rows("B9")
def test_a_damaged_manifest_is_named_with_the_way_out(
    run_dir: Path, source: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "model.pt"
    shutil.copyfile(run_dir / "checkpoint_5.pt", ckpt)
    manifest = tmp_path / "model.pt.sha256"
    manifest.write_text("Ein Mann fährt Rad .\n", encoding="utf-8")
    code, _, err = translate("--input", source, checkpoint=ckpt)
    assert code == 1
    assert_one_line_error(err, str(manifest), "damaged", f"remove {manifest.name}")
    assert "list index" not in err
    manifest.unlink()  # the way out it names: the digest inside still vouches for the file
    assert load_checkpoint(ckpt)["step"] == 5


@pytest.mark.rows("A12")
def test_resume_skips_an_average_written_over_a_checkpoint_by_hand(
    run_dir: Path, small_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`aiayn average` no longer writes over a run's checkpoint (B9); something else may:
    the trainer still skips a file without optimizer state and resumes from the next."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "checkpoint_last.pt").unlink()
    os.link(run / "checkpoint_10.pt", run / "checkpoint_last.pt")
    avg = load_checkpoint(run / "checkpoint_5.pt")
    avg = {k: avg[k] for k in ("format", "config", "vocab_sha256", "model", "step", "tokenizer")}
    # written as any tool would: a plain file over checkpoint_10.pt, not through the hard link
    (run / "checkpoint_10.pt").unlink()
    save_checkpoint_file(run / "checkpoint_10.pt", {**avg, "averaged_from": ["checkpoint_5.pt"]})
    with caplog.at_level("WARNING"):
        result = train(tiny_config(SMALL, max_steps=12), small_data, run)
    assert "not a training checkpoint" in caplog.text and "checkpoint_10.pt" in caplog.text
    assert result.state.step == 12


# ------------------------------------------------------------------ I8: one model, once
@pytest.mark.rows("I8")
def test_average_counts_one_model_once(
    run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    copy = tmp_path / "copy.pt"
    shutil.copyfile(run_dir / "checkpoint_10.pt", copy)
    single = load_checkpoint(run_dir / "checkpoint_10.pt")["model"]
    for inputs, said in (
        ([run_dir / "checkpoint_10.pt", run_dir / "checkpoint_last.pt"], "same file"),
        ([run_dir / "checkpoint_10.pt", run_dir / "checkpoint_10.pt"], "same file"),
        ([run_dir / "checkpoint_10.pt", copy], "a copy"),
    ):
        out = tmp_path / "avg.pt"
        caplog.clear()
        with caplog.at_level("WARNING"):
            code, stdout, err = cli("average", *inputs, "--out", out, "--force")
        assert code == 0, err
        assert said in caplog.text and "averaged once" in caplog.text
        assert "averaged 1 checkpoints" in stdout, stdout
        avg = load_checkpoint(out)
        assert avg["averaged_from"] == [inputs[0].name]
        assert all(torch.equal(avg["model"][k], single[k]) for k in single)
    # negative control: two steps are two models
    code, stdout, err = cli(
        "average", run_dir / "checkpoint_5.pt", run_dir / "checkpoint_10.pt", "--out",
        tmp_path / "two.pt",
    )  # fmt: skip
    assert code == 0 and "averaged 2 checkpoints" in stdout, err


@pytest.mark.rows("I8")
def test_average_logs_the_duplicate(
    run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"):
        cli(
            "average", run_dir / "checkpoint_10.pt", run_dir / "checkpoint_last.pt", "--out",
            tmp_path / "b.pt",
        )  # fmt: skip
    assert "checkpoint_last.pt is the same file as" in caplog.text


# ------------------------------------------------------------------ J9: NaN and infinity
@pytest.mark.rows("J9")
@pytest.mark.parametrize(
    "setting",
    [
        "train.lr_scale=nan",
        "train.lr_scale=inf",
        "decode.alpha=nan",
        "train.max_minutes=nan",
        "P_drop=nan",
        "eps_ls=-inf",
        "train.max_steps=inf",
    ],
)
def test_non_finite_settings_are_refused(small_data: Path, tmp_path: Path, setting: str) -> None:
    code, _, err = cli(
        "train", small_data, "--out", tmp_path / "run", "--preset", "tiny", "--set", setting
    )
    assert code == 2
    assert_one_line_error(err, setting.split("=")[0].split(".")[-1])
    assert not (tmp_path / "run").exists()


@pytest.mark.rows("J9")
def test_non_finite_float_flags_are_refused(run_dir: Path, source: Path, tmp_path: Path) -> None:
    for argv in (
        ["translate", "--checkpoint", run_dir / "checkpoint_5.pt", "--alpha", "inf"],
        ["translate", "--checkpoint", run_dir / "checkpoint_5.pt", "--max-len-a", "nan"],
        ["train", run_dir, "--out", tmp_path / "r", "--max-minutes", "nan"],
        ["bench", "decode", "--alpha", "nan"],
    ):
        with pytest.raises(SystemExit) as e:
            cli(*argv)
        assert e.value.code == 2
    toml = tmp_path / "x.toml"
    toml.write_text('preset = "tiny"\n[train]\nlr_scale = nan\n', encoding="utf-8")
    code, _, err = cli("train", run_dir, "--out", tmp_path / "r", "--config", toml)
    assert code == 2
    assert_one_line_error(err, "train.lr_scale", "finite")


@pytest.mark.rows("J9")
def test_a_crash_file_that_could_not_be_written_is_not_named_as_written(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights were not finite, so crash-N.pt was refused (C3): the message must not
    say the model is in it (before: "The model of step N is in crash-N.pt")."""
    from aiayn.checkpoints import CheckpointError
    from aiayn.training import guards
    from aiayn.training.trainer import TrainingError

    def refuse(path: Path, ckpt: dict) -> None:
        if "crash" in ckpt:
            raise CheckpointError(f"refusing to save {path}: non-finite values")
        save_checkpoint_file(path, ckpt)

    monkeypatch.setattr(guards.ckpt_lib, "save_checkpoint_file", refuse)
    monkeypatch.setenv("AIAYN_FAULTS", "nan_at_step=3,nan_times=5")
    run = tmp_path / "run"
    with pytest.raises(TrainingError) as e:
        train(tiny_config(SMALL), small_data, run)
    assert "could not be saved (crash-3.pt was not written" in str(e.value), str(e.value)
    assert " is in " not in str(e.value) and not list(run.glob("crash-*.pt"))


# ---------------------------------------------------- A16: resume with the run's settings
@pytest.mark.rows("A16")
def test_resume_keeps_the_first_starts_settings(
    small_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    first = ["train", small_data, "--out", run, "--preset", "tiny", "--no-progress", *TINY_FLAGS]
    bleu = ["--set", "valid_interval_steps=2", "--set", "valid_bleu_interval_steps=2"]
    code, _, err = cli(*first, "--max-steps", "2", "--save-interval-steps", "2", *bleu)
    assert code == 0, err
    with caplog.at_level("INFO"):
        code, _, err = cli("train", small_data, "--out", run, "--no-progress", "--max-steps", "4")
    assert code == 0, err
    cfg = json.loads((run / "config.json").read_text(encoding="utf-8"))
    assert cfg["train"]["valid_bleu_interval_steps"] == 2 and cfg["model"]["d_model"] == 32
    assert "train.max_steps changed: 2 -> 4" in caplog.text
    records = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    assert any(r.get("step") == 4 and "valid_bleu" in r for r in records)
    # another model is another run: refused, the run untouched
    log = (run / "train_log.jsonl").read_bytes()
    code, _, err = cli("train", small_data, "--out", run, "--set", "d_model=64", "--max-steps", "6")
    assert code == 2
    assert_one_line_error(err, "model.d_model", "cannot change")
    assert (run / "train_log.jsonl").read_bytes() == log


# ------------------------------------------------------------------ J10: Ctrl-C and SIGTERM
def _long_input(tmp_path: Path) -> Path:
    path = tmp_path / "long.en"
    path.write_text(
        "".join(f"a man number {i} rides a bike down the street .\n" for i in range(6000)),
        encoding="utf-8",
    )
    return path


@pytest.mark.rows("J10", "F19")
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_translate_workers_ends_everything_cleanly(
    run_dir: Path, tmp_path: Path, sig: int, code: int
) -> None:
    out = tmp_path / "long.de"
    proc = aiayn(
        "translate", "--checkpoint", run_dir / "checkpoint_last.pt", "--input",
        _long_input(tmp_path), "--output", out, "--workers", "2", "--beam", "4", "--no-progress",
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len(session_processes(proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)  # the workers are forked: decoding has started
    time.sleep(1)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole group
    else:
        proc.send_signal(sig)  # systemd's stop: the main process only
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "Traceback" not in err
    assert len([x for x in err.splitlines() if "interrupted" in x or "terminated" in x]) == 1
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert gone_within(proc.pid, 5) == []


@pytest.mark.rows("J10")
@pytest.mark.slow
def test_ctrl_c_during_streaming_prepare_and_a_second_one_in_train(
    small_data: Path, tmp_path: Path
) -> None:
    """Slow (~30 s): a corpus big enough to be interrupted, and a training run."""
    for lang in ("en", "de"):
        with gzip.open(MULTI30K / f"train.{lang}.gz", "rb") as f:
            (tmp_path / f"big.{lang}").write_bytes(f.read() * 3)
    runs = [
        (["prepare", "-s", "en", "-t", "de", "--trainpref", tmp_path / "big", "--out",
          tmp_path / "p", "--streaming", "--workers", "2", "--vocab-size", "8000"], 4, 1),
        (["train", small_data, "--out", tmp_path / "t", "--preset", "tiny", "--no-progress",
          *TINY_FLAGS, "--max-steps", "100000", "--save-interval-steps", "1"], 10, 2),
    ]  # fmt: skip
    for argv, after, presses in runs:
        proc = aiayn(*argv)
        deadline = time.monotonic() + 60
        if argv[0] == "prepare":  # once it encodes: its temporary arrays appear
            while not list((tmp_path / "p").glob(".*.tmp")) and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            time.sleep(after)
        for _ in range(presses):
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.05)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err
        assert "Traceback" not in err, err
        assert gone_within(proc.pid, 5) == []


# ---------------------------------------------------- F19 / G8: workers die with the parent
@pytest.mark.rows("F19", "G8")
def test_a_worker_dies_with_its_parent_even_by_kill_9() -> None:
    """A parent forks a worker that calls `worker_init` (as every pool initializer does),
    then is killed with SIGKILL: the worker must be gone within seconds, not blocked on its
    pipe forever. Negative control: without worker_init the worker outlives the parent."""
    code = (
        "import os, sys, time\n"
        "from aiayn.processes import worker_init\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    if sys.argv[1] == '1':\n"
        "        worker_init()\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print(pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    for init, survives in (("1", False), ("0", True)):
        proc = subprocess.Popen(
            [sys.executable, "-c", code, init], stdout=subprocess.PIPE, text=True, env=ENV
        )
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        time.sleep(1.0)  # worker_init has run
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.05)
        assert _alive(child) == survives
        if survives:
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ------------------------------------------------------------------ J11: optional extras
@pytest.mark.rows("J11")
@pytest.mark.parametrize(
    ("argv", "module", "extra"),
    [
        (["attention", "--text", "A dog .", "--out", "{tmp}/att"], "matplotlib", "plot"),
        (["table1", "--n-max", "32", "--out", "{tmp}/t1"], "matplotlib", "plot"),
        (["serve"], "fastapi", "serve"),
        (["serve"], "prometheus_client", "serve"),
        (["export", "--to", "ctranslate2", "--out", "{tmp}/x"], "ctranslate2", "export"),
        (["export", "--to", "marian", "--out", "{tmp}/x"], "transformers", "export"),
    ],
)
def test_a_missing_extra_is_said_before_any_work(
    run_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    module: str,
    extra: str,
) -> None:
    import aiayn.checkpoints

    monkeypatch.setitem(sys.modules, module, None)  # as if not installed

    def no_loading(*a: object, **k: object) -> None:
        raise AssertionError("loaded a checkpoint before checking the extra")

    monkeypatch.setattr(aiayn.checkpoints, "load_ensemble", no_loading)
    args = [a.format(tmp=tmp_path) for a in argv]
    if args[0] != "table1":
        args[1:1] = ["--checkpoint", str(run_dir / "checkpoint_5.pt")]
    code, _, err = cli(*args)
    assert code == 2
    assert_one_line_error(err, module, f"pip install 'aiayn[{extra}]'")


@pytest.mark.rows("J11")
def test_training_without_tensorboard_says_so_first(
    small_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with caplog.at_level("WARNING"):
        code, _, err = cli(
            "train", small_data, "--out", tmp_path / "r", "--preset", "tiny", "--no-progress",
            *TINY_FLAGS, "--max-steps", "1",
        )  # fmt: skip
    assert code == 0, err
    said = [r for r in caplog.records if "pip install 'aiayn[watch]'" in r.getMessage()]
    assert said and said[0].name == "aiayn"  # the CLI's line, before training


# ---------------------------------------------------- E12 / E13: compressed input, offline
@pytest.mark.rows("E12")
def test_a_corrupt_treebank_member_is_named(tmp_path: Path) -> None:
    src = ROOT.parent / "shared" / "data" / "ptb-sample" / "treebank.zip"
    if not src.is_file():
        pytest.skip("needs ../shared/data/ptb-sample")
    bad = tmp_path / "treebank.zip"
    with zipfile.ZipFile(src) as z:
        names = [n for n in z.namelist() if n.endswith(".mrg")][:3]
        with zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as out:
            for n in names:
                out.writestr(n, z.read(n))
    with zipfile.ZipFile(bad) as z:
        info = z.getinfo(names[1])
    data = bytearray(bad.read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    for i in range(start + 10, start + min(info.compress_size, 60)):
        data[i] ^= 0x5A
    bad.write_bytes(bytes(data))
    code, _, err = cli("data", "ptb", "--from", bad, "--out", tmp_path / "ptb")
    assert code == 1
    assert_one_line_error(err, f"{bad}/{names[1]}", "corrupt")


@pytest.mark.rows("E12")
def test_a_corrupt_gzip_corpus_is_named(tmp_path: Path) -> None:
    whole = bytearray(gzip.compress(b"a man rides a bike .\n" * 3000))
    for i in range(len(whole) // 2, len(whole) // 2 + 16):
        whole[i] ^= 0xFF
    for lang in ("en", "de"):
        (tmp_path / f"c.{lang}.gz").write_bytes(bytes(whole))
    for streaming in ((), ("--streaming",)):
        code, _, err = cli(
            "prepare", "-s", "en", "-t", "de", "--trainpref", tmp_path / "c", "--out",
            tmp_path / "p", *streaming,
        )  # fmt: skip
        assert code == 1
        assert_one_line_error(err, "c.en.gz", "corrupt")


@pytest.mark.rows("E13")
def test_offline_errors_name_the_from_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib.error
    import urllib.request

    def offline(*a: object, **k: object) -> None:
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    for argv in (["data", "multi30k", "--splits", "val"], ["data", "ptb"]):
        code, _, err = cli(*argv, "--out", tmp_path / argv[1])
        assert code == 1
        assert_one_line_error(err, "--from DIR")
        assert "from_dir" not in err


# ------------------------------------------------------------------ J12: export names the path
@pytest.mark.rows("J12")
def test_export_errors_name_the_path(run_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("ctranslate2")
    code, _, err = cli(
        "export", "--checkpoint", run_dir / "checkpoint_5.pt", "--to", "ctranslate2", "--out",
        "/proc/aiayn-export/x",
    )  # fmt: skip
    assert code == 4
    assert_one_line_error(err, "/proc/aiayn-export")
    out = tmp_path / "x"
    proc = subprocess.run(
        [sys.executable, "-m", "aiayn", "export", "--checkpoint", str(run_dir / "checkpoint_5.pt"),
         "--to", "ctranslate2", "--out", str(out)],
        env=ENV, capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: __import__("resource").setrlimit(
            __import__("resource").RLIMIT_FSIZE, (4096, 4096)),
    )  # fmt: skip
    assert proc.returncode == 4, proc.stderr
    assert_one_line_error(proc.stderr, str(out))
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".x")]


@pytest.mark.rows("F19")
def test_the_temporary_file_of_a_killed_writer_goes_at_the_next_write(tmp_path: Path) -> None:
    """kill -9 leaves `.<name>.<pid>.tmp` (no handler runs); the next write of that path
    removes it, and leaves a live writer's alone."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    path = tmp_path / "hyp.de"
    orphan = tmp_path / f".hyp.de.{int(dead.stdout)}.tmp"
    live = tmp_path / f".hyp.de.{os.getppid()}.tmp"
    orphan.write_text("half\n")
    live.write_text("in progress\n")
    with atomic_write(path, "w") as f:
        f.write("done\n")
    assert path.read_text() == "done\n" and not orphan.exists() and live.exists()
