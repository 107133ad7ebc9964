"""Tests for aiayn.checkpoints: section 6.1 (checkpoints, averaging) and RELIABILITY.md rows
A9-A11, B1-B5, C3 and I1-I5."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import random
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import aiayn.checkpoints as C
from aiayn import files
from aiayn.checkpoints import (
    FORMAT,
    CheckpointError,
    RunLock,
    average_checkpoints,
    check_run_dir,
    latest_valid_checkpoint,
    list_checkpoints,
    list_last,
    load_checkpoint,
    save_checkpoint,
    save_checkpoint_file,
    sidecar_path,
)
from aiayn.checkpoints import average as checkpoint_average
from aiayn.checkpoints import io as checkpoint_io
from aiayn.config import Config, ModelConfig
from aiayn.model import Transformer

TINY = ModelConfig(N=1, d_model=16, d_ff=32, h=2, d_k=8, d_v=8, max_positions=32, vocab_size=50)
VOCAB = "ab" * 32


def tiny_ckpt(step: int = 1, seed: int = 0, cfg: ModelConfig = TINY) -> dict[str, Any]:
    """What the trainer saves: a tiny Transformer after one Adam step, plus the rest."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    src = torch.randint(4, cfg.vocab_size, (2, 5))
    model(src, src).logsumexp(-1).mean().backward()
    opt.step()
    sched.step()
    return {
        "format": FORMAT,
        "config": Config(model=cfg).to_dict(),
        "vocab_sha256": VOCAB,
        "tokenizer": torch.tensor(list(b"sentencepiece model bytes"), dtype=torch.uint8),
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "step": step,
        "epoch": 0,
        "train_state": {"offset": 7, "best_bleu": 12.5, "patience": 0, "losses": [3.5, 3.25]},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }


def plain_ckpt(
    model: dict[str, Any],
    step: int = 1,
    vocab: str = VOCAB,
    model_cfg: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "config": {"model": model_cfg or {"d_model": 2}},
        "vocab_sha256": vocab,
        "model": model,
        "step": step,
    }


def assert_same(a: Any, b: Any, where: str = "ckpt") -> None:
    """Bitwise equality of nested checkpoint contents (torch.equal on every tensor)."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so that -0.0 and 0.0 differ."""
    ints = {
        torch.float64: torch.int64,
        torch.float32: torch.int32,
        torch.bfloat16: torch.int16,
        torch.float16: torch.int16,
    }
    return t.view(ints[t.dtype]) if t.dtype in ints else t


def tmp_files(d: Path) -> list[Path]:
    return sorted(d.glob(".*.tmp"))


def python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout
    )


# --------------------------------------------------------------------------- save / load
@pytest.mark.rows("B5")
def raw_load(path: Path) -> dict[str, Any]:
    """torch.load(weights_only=True) of a checkpoint, less the digest aiayn adds to the file
    (checked equal to the content's own)."""
    raw = torch.load(path, weights_only=True)
    inner = raw.pop(checkpoint_io.INTEGRITY_KEY)
    assert inner["sha256"] == checkpoint_io.content_digests(raw)
    return raw


def test_round_trip_is_bitwise_and_weights_only(tmp_path: Path) -> None:
    """B5 and STYLE "save/load round-trips exactly": every tensor torch.equal, plain
    torch.load(weights_only=True) reads the file, the shared embedding (section 3.4) stays
    one tensor, and the manifest is sha256sum format."""
    ckpt = tiny_ckpt(step=42)
    path = tmp_path / "c.pt"
    save_checkpoint_file(path, ckpt)
    loaded = load_checkpoint(path)
    assert_same(ckpt, loaded)
    assert_same(ckpt, raw_load(path))
    m = loaded["model"]
    ptr = m["src_embed.token.weight"].untyped_storage().data_ptr()
    assert m["tgt_embed.token.weight"].untyped_storage().data_ptr() == ptr
    assert m["generator.weight"].untyped_storage().data_ptr() == ptr
    Transformer(TINY).load_state_dict(m)  # strict
    assert sidecar_path(path).read_text() == f"{files.sha256_file(path)}  c.pt\n"


@pytest.mark.rows("B3")
def test_manifest_is_written_after_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B3: the sha256 manifest is written after the file it describes."""
    order: list[str] = []
    real_atomic, real_text = checkpoint_io.atomic_write, checkpoint_io.write_text_atomic

    def atomic(path: Path, mode: str = "wb") -> Any:
        order.append(Path(path).name)
        return real_atomic(path, mode)

    def text(path: Path, s: str) -> None:
        order.append(Path(path).name)
        real_text(path, s)

    monkeypatch.setattr(checkpoint_io, "atomic_write", atomic)
    monkeypatch.setattr(checkpoint_io, "write_text_atomic", text)
    save_checkpoint_file(tmp_path / "c.pt", plain_ckpt({"w": torch.ones(3)}))
    assert order == ["c.pt", "c.pt.sha256"]


@pytest.mark.rows("C3")
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_model_is_not_saved(tmp_path: Path, bad: float) -> None:
    """C3: a model with NaN/inf weights is refused; the last good checkpoint is kept."""
    path = tmp_path / "c.pt"
    save_checkpoint_file(path, plain_ckpt({"w": torch.ones(3)}, step=1))
    with pytest.raises(CheckpointError, match=r"refusing to save .*c\.pt.*non-finite.*'?w"):
        save_checkpoint_file(path, plain_ckpt({"w": torch.tensor([1.0, bad, 2.0])}, step=2))
    assert load_checkpoint(path)["step"] == 1
    assert tmp_files(tmp_path) == []


@pytest.mark.rows("B5")
def test_unplain_values_are_refused_at_save(tmp_path: Path) -> None:
    """B5, section 3 E1: a Namespace saves but fails under weights_only; refuse it at save."""
    ckpt = plain_ckpt({"w": torch.ones(3)})
    ckpt["config"]["args"] = argparse.Namespace(lr=1.0)
    with pytest.raises(
        CheckpointError, match=r"\['config'\]\['args'\] is of type argparse.Namespace"
    ):
        save_checkpoint_file(tmp_path / "c.pt", ckpt)
    assert not (tmp_path / "c.pt").exists()


@pytest.mark.rows("B3", "B5")
def test_load_errors_name_the_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """B3/B5: missing file, wrong format, missing keys; a missing manifest only warns
    ("unverified")."""
    with pytest.raises(CheckpointError, match=r"missing\.pt: no such checkpoint file"):
        load_checkpoint(tmp_path / "missing.pt")
    torch.save({"format": "other", "model": {}}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match=r"other\.pt: not an aiayn checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    torch.save({"format": FORMAT, "model": {}}, tmp_path / "partial.pt")
    with pytest.raises(CheckpointError, match=r"partial\.pt: malformed checkpoint, no config"):
        load_checkpoint(tmp_path / "partial.pt")
    path = tmp_path / "c.pt"
    save_checkpoint_file(path, plain_ckpt({"w": torch.ones(3)}))
    sidecar_path(path).unlink()
    with caplog.at_level(logging.WARNING, logger="aiayn.checkpoints"):
        assert load_checkpoint(path)["step"] == 1  # verified by the digest inside it
    assert "unverified" not in caplog.text
    legacy = tmp_path / "legacy.pt"  # written before checkpoints carried a digest
    torch.save(plain_ckpt({"w": torch.ones(3)}), legacy)
    with caplog.at_level(logging.WARNING, logger="aiayn.checkpoints"):
        assert load_checkpoint(legacy)["step"] == 1
    assert "legacy.pt" in caplog.text and "unverified" in caplog.text


# --------------------------------------------------------------------------- B2 disk full
class _FullDisk:
    """A file that takes `room` bytes, then fails like a full disk."""

    def __init__(self, f: Any, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()


@pytest.mark.rows("B2")
@pytest.mark.parametrize("where", ["write", "fsync"])
def test_disk_full_keeps_previous_checkpoint(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
    record_property: pytest.RecordProperty,
) -> None:
    """B2: ENOSPC from write (or from fsync, as with delayed allocation) says "no space left",
    leaves the previous checkpoint and its manifest valid, and no temp file."""
    record_property("faults", {"ENOSPC during a save": 1})
    path = tmp_path / "c.pt"
    save_checkpoint_file(path, plain_ckpt({"w": torch.ones(3)}, step=1))
    if where == "write":

        @contextlib.contextmanager
        def full(p: Path, mode: str = "wb") -> Any:
            with files.atomic_write(p, mode) as f:
                yield _FullDisk(f, room=1000)

        monkeypatch.setattr(checkpoint_io, "atomic_write", full)
    else:

        def fsync(fd: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(
        CheckpointError, match=rf"checkpoint write failed: {path}: no space left on device"
    ):
        save_checkpoint_file(path, plain_ckpt({"w": torch.zeros(10_000)}, step=2))
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1
    assert sidecar_path(path).exists()  # still verified, not merely loadable
    assert tmp_files(tmp_path) == []


FSIZE_CHILD = r"""
import resource, signal, sys
import torch
import aiayn.checkpoints as C
path = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
def ckpt(step, n):
    return {"format": C.FORMAT, "config": {}, "vocab_sha256": "", "step": step,
            "model": {"w": torch.full((n,), float(step))}}
C.save_checkpoint_file(path, ckpt(1, 1000))
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, hard))
try:
    C.save_checkpoint_file(path, ckpt(2, 1 << 20))
except C.CheckpointError as e:
    print(e)
    sys.exit(3)
"""


@pytest.mark.rows("B2")
def test_file_size_limit_is_reported_as_file_too_large(
    tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    """B2, section 3 E3: under a soft RLIMIT_FSIZE (SIGXFSZ ignored) torch itself only says
    "enforce fail ... unexpected pos"; we say "file too large", keep the previous file and
    remove the temp file; the process exits non-zero."""
    record_property("faults", {"file size limit during a save": 1})
    path = tmp_path / "c.pt"
    r = python(FSIZE_CHILD, str(path))
    assert r.returncode == 3, r.stderr
    assert f"checkpoint write failed: {path}: file too large" in r.stdout
    assert load_checkpoint(path)["step"] == 1
    assert tmp_files(tmp_path) == []


# --------------------------------------------------------------------------- B1 kill -9
# One helper process imports torch once and forks a writer per trial (the helper itself never
# runs a torch op, so forking is safe); a trial kills its writer at a random time, or the
# writer kills itself after B bytes of its second checkpoint (the fault hook of section 2).
KILL_HELPER = r"""
import os, random, signal, sys, time
import torch
import aiayn.checkpoints as C
from aiayn.checkpoints import io as checkpoint_io
root, mode, n, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)

def writer(run_dir, w, kill_at):
    torch.set_num_threads(1)
    real_write, state = checkpoint_io._HashingWriter.write, {"step": 0, "written": 0}
    def write(self, data):  # kill -9 after kill_at bytes of the second checkpoint
        if state["step"] > 1 and state["written"] + len(data) > kill_at >= 0:
            real_write(self, bytes(data)[:kill_at - state["written"]])
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        state["written"] += len(data) if state["step"] > 1 else 0
        return real_write(self, data)
    checkpoint_io._HashingWriter.write = write
    while True:
        state["step"] += 1
        w_ = torch.full((1 << 20,), state["step"] / 1.0)
        C.save_checkpoint(run_dir, {"format": C.FORMAT, "config": {}, "vocab_sha256": "",
                                    "step": state["step"], "model": {"w": w_}}, keep_last=2)
        if state["step"] == 1:
            os.write(w, b"1")

for trial in range(n):
    run_dir = C.check_run_dir(os.path.join(root, f"r{trial}"))
    kill_at = rng.randrange(4 << 20) if mode == "bytes" else -1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            writer(run_dir, w, kill_at)
        finally:
            os._exit(1)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    if mode == "time":
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    print(kill_at, flush=True)
"""


def _check_killed_run(run_dir: Path, trial: str) -> int:
    """Every final name holds a whole checkpoint; the newest valid one is found; no tmp."""
    pts = sorted(run_dir.glob("*.pt"))
    assert pts, trial
    for p in pts:
        ck = load_checkpoint(p)  # never a partial file under a final name
        assert torch.equal(ck["model"]["w"], torch.full((1 << 20,), ck["step"] / 1.0)), trial
        if p.name != C.LAST_NAME:
            assert p.name == f"checkpoint_{ck['step']}.pt", trial
    had_tmp = len(tmp_files(run_dir))
    found = latest_valid_checkpoint(run_dir)
    assert found is not None, trial
    assert found[1]["step"] == int(list_checkpoints(run_dir)[-1].stem.split("_")[1]), trial
    assert tmp_files(run_dir) == [], trial  # stale tmp removed at the next start
    return had_tmp


def _kill_trials(tmp_path: Path, mode: str, n: int, record: pytest.RecordProperty) -> None:
    record("faults", {"kill -9 during a save": n})
    seed = random.randrange(1 << 30)
    r = python(KILL_HELPER, str(tmp_path), mode, str(n), str(seed), timeout=300)
    assert r.returncode == 0, r.stderr
    kill_at = r.stdout.split()
    assert len(kill_at) == n
    for i in range(n):
        run_dir, trial = tmp_path / f"r{i}", f"{mode} trial {i}, seed {seed}, B={kill_at[i]}"
        if mode == "bytes":  # killed inside the second write: tmp left, final names at step 1
            assert not (run_dir / "checkpoint_2.pt").exists(), trial
            assert _check_killed_run(run_dir, trial) == 1, trial
            assert load_checkpoint(run_dir / C.LAST_NAME)["step"] == 1, trial
        else:
            _check_killed_run(run_dir, trial)


@pytest.mark.rows("B1")
@pytest.mark.parametrize(("mode", "n"), [("time", 5), ("bytes", 3)])
def test_kill_during_save_never_leaves_partial_file(
    tmp_path: Path,
    mode: str,
    n: int,
    record_property: pytest.RecordProperty,
) -> None:
    """B1, section 3 E2: writers SIGKILLed at random times, or after B random bytes of a
    checkpoint: every final name loads (the previous version or the new one, never part of
    one), and the next start removes the stale tmp and finds the newest valid checkpoint."""
    _kill_trials(tmp_path, mode, n, record_property)


@pytest.mark.rows("B1")
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["time", "bytes"])
def test_kill_during_save_20_trials(
    tmp_path: Path, mode: str, record_property: pytest.RecordProperty
) -> None:
    """B1: the 20-trial version of the kill tests."""
    _kill_trials(tmp_path, mode, 20, record_property)


# --------------------------------------------------------------------------- B3 corruption
def _corrupt(path: Path, kind: str, needle: bytes) -> None:
    """Corrupt in place (same inode, as a disk would), so checkpoint_last.pt suffers too."""
    data = path.read_bytes()
    if kind == "truncated":
        new = data[: len(data) // 2]
    elif kind == "zero-length":
        new = b""
    elif kind == "random bytes":
        new = random.Random(0).randbytes(len(data))
    else:
        i = data.find(needle) + len(needle) // 2
        assert i > len(needle) // 2
        new = data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1 :]
    with open(path, "r+b") as f:
        f.write(new)
        f.truncate()


KINDS = {
    "truncated": "sha256 mismatch",
    "zero-length": "empty file",
    "random bytes": "sha256 mismatch",
    "flipped byte": "sha256 mismatch",
}


@pytest.mark.rows("B3")
@pytest.mark.parametrize("kind", KINDS)
def test_corrupt_checkpoint_refused_and_resume_falls_back(
    tmp_path: Path,
    kind: str,
    caplog: pytest.LogCaptureFixture,
    record_property: pytest.RecordProperty,
) -> None:
    """B3, section 3 E1: truncated, zero-length, random bytes and one byte flipped inside
    tensor data are each refused naming the file; auto-resume falls back and says so."""
    record_property("faults", {f"corrupt checkpoint ({kind})": 1})
    save_checkpoint(tmp_path, tiny_ckpt(step=100), keep_last=5)
    ckpt = tiny_ckpt(step=200, seed=1)
    save_checkpoint(tmp_path, ckpt, keep_last=5)
    bad = tmp_path / "checkpoint_200.pt"
    needle = ckpt["model"]["encoder.0.ffn.w_1.weight"].numpy().tobytes()
    _corrupt(bad, kind, needle)
    if kind == "flipped byte":  # E1: torch alone loads it, silently wrong
        raw = torch.load(bad, weights_only=True)["model"]["encoder.0.ffn.w_1.weight"]
        assert not torch.equal(raw, ckpt["model"]["encoder.0.ffn.w_1.weight"])
    with pytest.raises(CheckpointError, match=rf"{bad}: .*{KINDS[kind]}"):
        load_checkpoint(bad)
    with caplog.at_level(logging.WARNING, logger="aiayn.checkpoints"):
        path, resumed = latest_valid_checkpoint(tmp_path)  # type: ignore[misc]
    assert path.name == "checkpoint_100.pt" and resumed["step"] == 100
    assert "skipping invalid checkpoint" in caplog.text and str(bad) in caplog.text
    assert "resuming from" in caplog.text


@pytest.mark.rows("B3")
@pytest.mark.parametrize("kind", ["truncated", "random bytes"])
def test_corrupt_without_manifest_refused_by_name(tmp_path: Path, kind: str) -> None:
    """B3: without a manifest, torch's own error ("failed finding central directory",
    "Weights only load failed") becomes a CheckpointError naming the file."""
    path = tmp_path / "c.pt"
    save_checkpoint_file(path, plain_ckpt({"w": torch.ones(1000)}))
    sidecar_path(path).unlink()
    _corrupt(path, kind, b"")
    with pytest.raises(CheckpointError, match=rf"{path}: unreadable, truncated or corrupt"):
        load_checkpoint(path)


@pytest.mark.rows("B3")
def test_latest_valid_none_empty_and_error_when_all_invalid(tmp_path: Path) -> None:
    """B3: an empty run starts afresh (None); a run whose every checkpoint is invalid is an
    error naming them, not a silent restart from step 0."""
    assert latest_valid_checkpoint(tmp_path / "nope") is None
    assert latest_valid_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, plain_ckpt({"w": torch.ones(3)}, step=5), keep_last=2)
    _corrupt(tmp_path / "checkpoint_5.pt", "zero-length", b"")
    with pytest.raises(CheckpointError, match=r"no valid checkpoint among checkpoint_5.pt"):
        latest_valid_checkpoint(tmp_path)


# --------------------------------------------------------------------------- run directory
@pytest.mark.rows("A9")
def test_check_run_dir_creates_or_fails_fast(tmp_path: Path) -> None:
    """A9: a missing save dir is created; one that cannot be written fails in < 5 s naming
    it (we run as root, so a regular file stands in for an unwritable directory)."""
    assert check_run_dir(tmp_path / "a" / "b").is_dir()
    assert list((tmp_path / "a" / "b").iterdir()) == []  # the write probe is gone
    (tmp_path / "file").write_text("x")
    t0 = time.monotonic()
    for bad in (tmp_path / "file" / "run", tmp_path / "file"):
        with pytest.raises(CheckpointError, match=str(bad)):
            check_run_dir(bad)
    assert time.monotonic() - t0 < 5


@pytest.mark.rows("A9")
def test_check_run_dir_read_only_directory(tmp_path: Path) -> None:
    """A9: a chmod 500 directory fails naming it; as root (whom chmod does not stop) a
    read-only mount stands in for it."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        try:
            (d / "x").write_text("x")
        except PermissionError:
            with pytest.raises(CheckpointError, match=rf"run directory {d} is not writable"):
                check_run_dir(d)
            return
    finally:
        d.chmod(0o700)
    # root ignores chmod; what stops root is a read-only mount (if we may mount one)
    d = tmp_path / "ro_mount"
    d.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip("chmod 500 does not stop root, and mounting a read-only tmpfs failed")
    try:
        with pytest.raises(CheckpointError, match=rf"run directory {d} is not writable"):
            check_run_dir(d)
    finally:
        subprocess.run(["umount", str(d)], check=True)


@pytest.mark.rows("A10")
def test_retention_keeps_last_k_plus_last(tmp_path: Path) -> None:
    """A10: keep_last=3 leaves at most 4 .pt files (3 numbered + checkpoint_last), each with
    its manifest; checkpoint_last.pt is a hard link to the newest."""
    for step in range(1, 7):
        save_checkpoint(tmp_path, plain_ckpt({"w": torch.full((3,), float(step))}, step), 3)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "checkpoint_4.pt",
        "checkpoint_5.pt",
        "checkpoint_6.pt",
    ]
    assert len(list(tmp_path.glob("*.pt"))) == 4
    assert len(list(tmp_path.glob("*.pt.sha256"))) == 4
    last = tmp_path / C.LAST_NAME
    assert load_checkpoint(last)["step"] == 6
    assert last.stat().st_ino == (tmp_path / "checkpoint_6.pt").stat().st_ino


@pytest.mark.rows("A10", "B1")
def test_last_falls_back_to_copy_without_hard_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A10/B1: where hard links fail, checkpoint_last.pt is a verified copy."""

    def no_link(src: Any, dst: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    save_checkpoint(tmp_path, plain_ckpt({"w": torch.ones(3)}, step=3), keep_last=2)
    last = tmp_path / C.LAST_NAME
    assert load_checkpoint(last)["step"] == 3
    assert last.stat().st_ino != (tmp_path / "checkpoint_3.pt").stat().st_ino


@pytest.mark.rows("A10")
def test_failed_delete_is_logged_and_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A10: deleting an old checkpoint fails; it is logged, saving goes on, the others are
    pruned; the checkpoint just written is never deleted, even if its step is not highest."""
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name == "checkpoint_1.pt":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    with caplog.at_level(logging.WARNING, logger="aiayn.checkpoints"):
        for step in (1, 2, 3):
            save_checkpoint(tmp_path, plain_ckpt({"w": torch.ones(3)}, step), keep_last=1)
    assert "could not delete old checkpoint" in caplog.text and "checkpoint_1.pt" in caplog.text
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_1.pt", "checkpoint_3.pt"]
    monkeypatch.undo()
    save_checkpoint(tmp_path, plain_ckpt({"w": torch.ones(3)}, 2), keep_last=1)
    assert (tmp_path / "checkpoint_2.pt").exists()
    assert load_checkpoint(tmp_path / C.LAST_NAME)["step"] == 2


def test_list_checkpoints_and_list_last(tmp_path: Path) -> None:
    """Section 6.1: the last k checkpoints, ordered by step number, not by name."""
    for step in (100, 9, 10):
        save_checkpoint(tmp_path, plain_ckpt({"w": torch.ones(1)}, step), keep_last=5)
    (tmp_path / "checkpoint_x.pt").write_text("not numbered")
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "checkpoint_9.pt",
        "checkpoint_10.pt",
        "checkpoint_100.pt",
    ]
    assert [p.name for p in list_last(tmp_path, 2)] == ["checkpoint_10.pt", "checkpoint_100.pt"]
    with pytest.raises(CheckpointError, match="asked for the last 5 checkpoints, found 3"):
        list_last(tmp_path, 5)


LOCK_CHILD = r"""
import sys, time
from aiayn.checkpoints import RunLock
with RunLock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(60)
"""


@pytest.mark.rows("A11")
def test_second_trainer_is_refused_naming_the_pid(tmp_path: Path) -> None:
    """A11: a second trainer on the same dir fails naming the dir and the holder's pid; the
    first is unaffected; after the holder is killed -9 the lock is free again."""
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with (
            pytest.raises(
                CheckpointError, match=rf"run directory {tmp_path} is in use .*pid {holder.pid}"
            ),
            RunLock(tmp_path),
        ):
            pass
        assert holder.poll() is None
        assert (tmp_path / C.LOCK_NAME).read_text() == f"{holder.pid}\n"
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout:
            holder.stdout.close()
    with RunLock(tmp_path):
        assert (tmp_path / C.LOCK_NAME).read_text() == f"{os.getpid()}\n"
        with pytest.raises(CheckpointError, match=rf"pid {os.getpid()}"):
            RunLock(tmp_path).__enter__()


# --------------------------------------------------------------------------- I averaging
@pytest.mark.rows("I1")
def test_average_of_copies_is_bitwise_the_original(tmp_path: Path) -> None:
    """I1, section 6.1: averaging 3 copies returns the original bit for bit (fp32, fp64,
    bf16, -0.0, ints), where summing and dividing would be 1 ulp off; B5 on the output."""
    ckpt = tiny_ckpt()
    x = ckpt["model"]["generator.weight"]
    assert not torch.equal((x + x + x) / 3, x)  # the naive way would fail this test
    ckpt["model"].update(
        {
            "x.fp64": torch.randn(9, dtype=torch.float64),
            "x.bf16": torch.randn(9).bfloat16(),
            "x.zero": torch.tensor([-0.0, 0.0]),
            "x.int": torch.arange(4),
        }
    )
    paths = [save_checkpoint(tmp_path, {**ckpt, "step": s}, keep_last=5) for s in (1, 2, 3)]
    avg = average_checkpoints(paths)
    assert list(avg["model"]) == list(ckpt["model"])
    for k, t in ckpt["model"].items():
        assert avg["model"][k].dtype == t.dtype and torch.equal(bits(avg["model"][k]), bits(t)), k
    assert avg["step"] == 3 and "optimizer" not in avg
    assert avg["averaged_from"] == ["checkpoint_1.pt", "checkpoint_2.pt", "checkpoint_3.pt"]
    assert_same(avg["tokenizer"], ckpt["tokenizer"])
    save_checkpoint_file(tmp_path / "avg.pt", avg)
    assert_same(avg, raw_load(tmp_path / "avg.pt"))
    assert_same(avg, load_checkpoint(tmp_path / "avg.pt"))


@pytest.mark.rows("I2")
def test_average_matches_hand_computation(tmp_path: Path) -> None:
    """I2 (fairseq test_average_checkpoints): double, float, int and tied tensors; the tied
    pair is averaged once and still one tensor, after saving too; unequal ints refused."""
    w1, w2 = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 0.0])
    a = {
        "double": torch.tensor([1.0, 2.5, -3.0], dtype=torch.float64),
        "float": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        "int": torch.tensor([1, 2, 3]),
        "tied_a": w1,
        "tied_b": w1,
        "rand": torch.randn(50),
    }
    b = {
        "double": torch.tensor([3.0, 0.5, 1.0], dtype=torch.float64),
        "float": torch.tensor([[3.0, 6.0], [-1.0, 0.0]]),
        "int": torch.tensor([1, 2, 3]),
        "tied_a": w2,
        "tied_b": w2,
        "rand": torch.randn(50),
    }
    c = {**b, "rand": torch.randn(50)}
    for name, m in {"a": a, "b": b, "c": c}.items():
        save_checkpoint_file(tmp_path / f"{name}.pt", plain_ckpt(m))
    avg = average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"])["model"]
    assert torch.equal(avg["double"], torch.tensor([2.0, 1.5, -1.0], dtype=torch.float64))
    assert torch.equal(avg["float"], torch.tensor([[2.0, 4.0], [1.0, 2.0]]))
    assert torch.equal(avg["int"], torch.tensor([1, 2, 3])) and avg["int"].dtype == torch.int64
    assert torch.equal(avg["tied_a"], torch.tensor([2.0, -1.0])) and avg["tied_a"] is avg["tied_b"]
    avg3 = average_checkpoints([tmp_path / f"{n}.pt" for n in "abc"])
    mean = (a["rand"].double() + b["rand"].double() + c["rand"].double()) / 3
    torch.testing.assert_close(avg3["model"]["rand"], mean.float())
    save_checkpoint_file(tmp_path / "avg.pt", avg3)
    m = load_checkpoint(tmp_path / "avg.pt")["model"]
    assert m["tied_a"].untyped_storage().data_ptr() == m["tied_b"].untyped_storage().data_ptr()
    save_checkpoint_file(tmp_path / "d.pt", plain_ckpt({**b, "int": torch.tensor([1, 2, 4])}))
    with pytest.raises(CheckpointError, match=r"d\.pt: key 'int' differs from a\.pt"):
        average_checkpoints([tmp_path / "a.pt", tmp_path / "d.pt"])
    forced = average_checkpoints([tmp_path / "a.pt", tmp_path / "d.pt"], force=True)
    assert torch.equal(forced["model"]["int"], torch.tensor([1, 2, 4]))


def _variant(tmp_path: Path, name: str, **change: Any) -> Path:
    model = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    model.update(change.pop("model", {}))
    for k in change.pop("drop", []):
        del model[k]
    path = tmp_path / f"{name}.pt"
    save_checkpoint_file(path, plain_ckpt(model, **change))
    return path


@pytest.mark.rows("I3")
@pytest.mark.parametrize(
    ("change", "message", "forcible"),
    [
        pytest.param(
            {"model": {"extra": torch.ones(1)}},
            r"key 'extra' not in base\.pt",
            False,
            id="extra-key",
        ),
        pytest.param(
            {"drop": ["b"]}, r"key 'b' missing \(present in base\.pt\)", False, id="missing-key"
        ),
        pytest.param({"model": {"w": torch.ones(3, 2)}}, r"key 'w' is \(3, 2\)", False, id="shape"),
        pytest.param(
            {"model": {"w": torch.ones(2, 3, dtype=torch.int64)}},
            r"key 'w' is \(2, 3\) torch.int64",
            False,
            id="float-vs-int",
        ),
        pytest.param(
            {"model": {"w": torch.ones(2, 3, dtype=torch.float64)}},
            r"key 'w' is torch.float64",
            True,
            id="dtype",
        ),
        pytest.param(
            {"vocab": "cd" * 32}, r"vocab_sha256 'cdcd.*differs from base\.pt", True, id="vocab"
        ),
        pytest.param(
            {"model_cfg": {"d_model": 4}},
            r"config\['model'\] differs from base\.pt's in d_model",
            True,
            id="config",
        ),
    ],
)
def test_mixing_runs_is_refused_naming_file_and_key(
    tmp_path: Path, change: dict[str, Any], message: str, forcible: bool
) -> None:
    """I3: different keys, shapes, vocab hash or model config are refused naming the file and
    key. force=True (--force) mixes runs (vocab, config, dtype) but cannot average tensors
    that do not line up (keys, shapes, float vs int)."""
    base = _variant(tmp_path, "base")
    other = _variant(tmp_path, "other", **change)
    with pytest.raises(CheckpointError, match=rf"{other}: {message}"):
        average_checkpoints([base, other])
    if forcible:
        avg = average_checkpoints([base, other], force=True)
        assert avg["vocab_sha256"] == VOCAB and avg["model"]["w"].dtype == torch.float32
    else:
        with pytest.raises(CheckpointError, match=message):
            average_checkpoints([base, other], force=True)


@pytest.mark.rows("I4")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_accumulated_in_fp32(tmp_path: Path, dtype: torch.dtype) -> None:
    """I4: bf16/fp16 inputs are averaged in fp32 and returned in their own dtype. For
    1, 1+2^-7, 1+2^-7 in bf16 the fp32 mean rounds to 1+2^-7; bf16 arithmetic gives 1."""
    assert C.accumulator_dtype(dtype) == torch.float32
    assert C.accumulator_dtype(torch.float64) == torch.float64
    values = [1.0, 1 + 2**-7, 1 + 2**-7]
    paths = []
    for i, v in enumerate(values):
        paths.append(tmp_path / f"{i}.pt")
        save_checkpoint_file(paths[-1], plain_ckpt({"w": torch.tensor([v], dtype=dtype)}))
    w = average_checkpoints(paths)["model"]["w"]
    assert w.dtype == dtype
    expected = torch.tensor([sum(values) / 3]).to(dtype)
    assert torch.equal(w, expected)
    if dtype == torch.bfloat16:
        low = torch.tensor(values, dtype=dtype)  # bf16 arithmetic, one add at a time:
        assert not torch.equal((low[0] + low[1] + low[2]) / 3, expected[0])


@pytest.mark.rows("I5")
def test_averaging_streams_one_checkpoint_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """I5: while averaging, each loaded checkpoint is released before the next is loaded
    (memory: the running mean plus one checkpoint)."""
    paths = [save_checkpoint(tmp_path, tiny_ckpt(step=s, seed=s), keep_last=4) for s in range(4)]
    alive: list[weakref.ref[torch.Tensor]] = []
    real_load = checkpoint_average.load_checkpoint

    def load(path: Path, map_location: str = "cpu", *, mmap: bool = False) -> dict[str, Any]:
        assert all(r() is None for r in alive), f"an earlier checkpoint is alive at {path}"
        ckpt = real_load(path, map_location, mmap=mmap)
        alive.extend(weakref.ref(t) for t in (*ckpt["model"].values(), ckpt["tokenizer"]))
        return ckpt

    monkeypatch.setattr(checkpoint_average, "load_checkpoint", load)
    avg = average_checkpoints(paths)
    assert all(r() is None for r in alive)
    ref = torch.stack([real_load(p)["model"]["encoder.0.ffn.w_1.weight"] for p in paths])
    torch.testing.assert_close(avg["model"]["encoder.0.ffn.w_1.weight"], ref.mean(0))


def test_load_model_rebuilds_model_vocabulary_and_config(tmp_path: Path) -> None:
    """STYLE "checkpoints carry their config": one file gives back the model (same logits),
    its vocabulary and config; a vocabulary that does not match vocab_sha256 is refused."""
    from aiayn.data.tokenizer import Tokenizer

    tok = Tokenizer.train_from_sentences(["ein zwei drei vier fünf sechs"] * 20, 24, None)
    cfg = ModelConfig(**{**vars(TINY), "vocab_size": tok.vocab_size})
    ckpt = tiny_ckpt(cfg=cfg)
    ckpt["tokenizer"] = torch.frombuffer(bytearray(tok.to_bytes()), dtype=torch.uint8)
    ckpt["vocab_sha256"] = tok.sha256
    save_checkpoint_file(tmp_path / "c.pt", ckpt)
    model, tok2, cfg2 = C.load_model(tmp_path / "c.pt")
    assert tok2.sha256 == tok.sha256 and cfg2.model == cfg and not model.training
    reference = Transformer(cfg)
    reference.load_state_dict(ckpt["model"])
    src = torch.tensor([tok.encode("zwei drei") + [3]])
    assert torch.equal(model(src, src), reference.eval()(src, src))
    save_checkpoint_file(tmp_path / "bad.pt", {**ckpt, "vocab_sha256": VOCAB})
    with pytest.raises(CheckpointError, match=r"bad\.pt: cannot build the model: .*vocab_sha256"):
        C.load_model(tmp_path / "bad.pt")


def test_list_last_of_a_short_run_averages_what_there_is(tmp_path: Path) -> None:
    """Section 6.1 averaging after a run shorter than the window: strict refuses, the
    CLI's lenient mode takes every checkpoint there is."""
    for step in (50, 100, 150, 200):
        (tmp_path / f"checkpoint_{step}.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="found 4"):
        list_last(tmp_path, 5)
    assert [p.name for p in list_last(tmp_path, 5, strict=False)] == [
        "checkpoint_50.pt",
        "checkpoint_100.pt",
        "checkpoint_150.pt",
        "checkpoint_200.pt",
    ]
    with pytest.raises(CheckpointError, match="found 0"):
        list_last(tmp_path / "empty", 5, strict=False)


@pytest.mark.rows("B4")
def test_fsync_before_and_after_the_rename(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """B4 (checked in-process instead of with strace): the temp file is fsynced, then its
    directory, then renamed over the final name, then the directory is fsynced again;
    the manifest follows the same protocol after the checkpoint."""
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        calls.append(("rename", f"{Path(src).name} -> {Path(dst).name}"))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_checkpoint_file(tmp_path / "c.pt", tiny_ckpt())
    d, pid = str(tmp_path), os.getpid()
    # (the checkpoint's temp file is fsynced twice: once early, to see a full disk before
    # the old manifest goes, once by atomic_write)
    calls = [c for i, c in enumerate(calls) if i == 0 or c != calls[i - 1]]
    assert calls == [
        ("fsync", f"{d}/.c.pt.{pid}.tmp"),
        ("fsync", d),
        ("rename", f".c.pt.{pid}.tmp -> c.pt"),
        ("fsync", d),
        ("fsync", f"{d}/.c.pt.sha256.{pid}.tmp"),
        ("fsync", d),
        ("rename", f".c.pt.sha256.{pid}.tmp -> c.pt.sha256"),
        ("fsync", d),
    ]
