"""Wall time and peak memory of `aiayn prepare --streaming` on WMT14-sized synthetic corpora.

Generates N WMT-like pairs (aiayn.data.synthetic: ~25 words a sentence, a long tail, a
Zipfian 50K-word vocabulary per language, correlated sides) as gzip files, then runs the
real command line in a child process while a sampler reads /proc every 0.5 s:

- peak_tree_rss_mib: the largest sum of VmRSS over the prepare process and all its
  descendants (the workers) at one sample: what `top` would show, shared pages counted
  once per process (so an upper bound);
- peak_tree_pss_mib: the same with Pss (smaps_rollup), shared pages split between
  their users: the tree's real footprint;
- max_single_rss_mib: getrusage(RUSAGE_CHILDREN).ru_maxrss, the largest peak of any one
  process (exact, not sampled).

Generation is timed apart and is not part of the prepare's figures. The corpora are
deleted afterwards unless --keep.

    python3 benchmarks/prepare_scale.py --pairs 4500000 --out bench/prepare-4.5M.json
    python3 benchmarks/prepare_scale.py --pairs 36000000 --model-type bpe --vocab-size 32000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _kib(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeSampler(threading.Thread):
    """Samples the summed VmRSS and Pss of a process tree until stopped."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_rss = self.peak_pss = self.peak_procs = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            pids = _tree(self.pid)
            rss = sum(_kib(f"/proc/{p}/status", "VmRSS:") for p in pids)
            pss = sum(_kib(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids)
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.peak_procs = max(self.peak_procs, len(pids))
            self.stop.wait(self.interval)


def machine() -> dict[str, object]:
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gib": round(_kib("/proc/meminfo", "MemTotal:") / 2**20, 1),
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg(),
    }


def generate(workdir: Path, pairs: int, plain: bool) -> float:
    """Write train (N pairs) and valid (3000, newstest-sized) corpora; seconds taken.

    In a child process, so that the generator's memory is not the benchmark's."""
    code = (
        "import sys\n"
        "from aiayn.data.synthetic import write_corpus\n"
        "d, n, gz = sys.argv[1], int(sys.argv[2]), sys.argv[3] == '1'\n"
        "write_corpus(d + '/train', n, seed=1, gz=gz, progress=True)\n"
        "write_corpus(d + '/valid', 3000, seed=2, gz=gz)\n"
    )
    t = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", code, str(workdir), str(pairs), "0" if plain else "1"], check=True
    )
    return time.monotonic() - t


def run_prepare(workdir: Path, args: argparse.Namespace) -> dict[str, object]:
    out = workdir / "prepared"
    cmd = [
        sys.executable, "-m", "aiayn", "prepare", "--streaming", "-s", "en", "-t", "de",
        "--trainpref", str(workdir / "train"), "--validpref", str(workdir / "valid"),
        "--out", str(out), "--force", "--vocab-size", str(args.vocab_size),
        "--model-type", args.model_type,
    ]  # fmt: skip
    for flag in ("workers", "spm_sample", "spm_threads"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.monotonic()
    proc = subprocess.Popen(cmd)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    rc = proc.wait()
    wall = time.monotonic() - t
    sampler.stop.set()
    sampler.join()
    if rc != 0:
        raise SystemExit(f"prepare failed with exit code {rc}: {' '.join(cmd)}")
    manifest = json.loads((out / "manifest.json").read_text())
    train = manifest["splits"]["train"]
    return {
        "command": " ".join(cmd),
        "wall_s": round(wall, 1),
        "stage_s": manifest["seconds"],
        "pairs_per_s": round(train["lines"] / wall),
        "peak_tree_rss_mib": round(sampler.peak_rss / 1024),
        "peak_tree_pss_mib": round(sampler.peak_pss / 1024),
        # (ru_maxrss is the largest of all children so far: the generator's if unchanged)
        "max_single_rss_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
        "generator_rss_mib": round(before / 1024),
        "processes": sampler.peak_procs,
        "train": {k: train[k] for k in ("lines", "pairs", "dropped", "src_tokens", "tgt_tokens")},
        "vocabulary": manifest["spm_model"],
        "output_bytes": sum(p.stat().st_size for p in out.iterdir()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pairs", type=int, action="append", help="corpus size(s) (default: 4500000)")
    p.add_argument("--workdir", default="/tmp/aiayn-prepare-scale", help="scratch directory")
    p.add_argument("--out", help="write the JSON results here too")
    p.add_argument("--vocab-size", type=int, default=37000, help="the paper's En-De: 37000")
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    p.add_argument("--workers", type=int, help="prepare --workers (default: its own)")
    p.add_argument("--spm-sample", type=int, help="prepare --spm-sample (default: its own)")
    p.add_argument("--spm-threads", type=int, help="prepare --spm-threads (default: its own)")
    p.add_argument("--plain", action="store_true", help="plain text instead of gzip")
    p.add_argument("--keep", action="store_true", help="keep the corpora and the output")
    args = p.parse_args()
    results: dict[str, object] = {"machine": machine(), "runs": []}
    for n in args.pairs or [4_500_000]:
        workdir = Path(args.workdir) / f"{n}"
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        try:
            gen = generate(workdir, n, args.plain)
            inputs = sum(f.stat().st_size for f in workdir.iterdir() if f.is_file())
            run = {"pairs": n, "generation_s": round(gen, 1), "input_bytes": inputs}
            run.update(run_prepare(workdir, args))
        finally:
            if not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)
        results["runs"].append(run)  # type: ignore[attr-defined]
        print(json.dumps(run, indent=2), flush=True)
    text = json.dumps(results, indent=2) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
