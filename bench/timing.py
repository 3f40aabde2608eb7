"""Timing and environment helpers shared by the benchmarks."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from flashspark.train.common import hardware_string


def run_child(script: str, build: str, args=()) -> dict:
    """Run `script --child ARGS` with `build` (a package directory holding flashspark/) first on
    PYTHONPATH, and return the JSON object it prints last: how the *_ab benchmarks time or
    decode under two builds side by side."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.abspath(build), os.path.dirname(script)])}
    res = subprocess.run(
        [sys.executable, script, "--child", *args], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def median_time(fn, repeats: int, device: torch.device) -> float:
    """Median wall time of fn() in seconds over `repeats` runs after one warm-up,
    synchronizing the GPU around each run."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_info(device: torch.device) -> dict:
    """Date, hardware and versions recorded with every benchmark result."""
    return dict(
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        hardware=dict(
            machine=platform.machine(),
            processor=platform.processor() or platform.machine(),
            cpu_count=os.cpu_count(),
            torch_threads=torch.get_num_threads(),
            gpu=torch.cuda.get_device_name() if device.type == "cuda" else None,
        ),
        torch=torch.__version__,
        device=str(device),
    )


def write_result(benchmark: str, script: str, argv, device: torch.device, rows: list, out: str) -> dict:
    """The JSON every benchmark writes: its name, the command that produced it (script +
    argv, or the process's own arguments), run_info and the rows; returns it."""
    result = dict(
        benchmark=benchmark,
        command=" ".join(["python", script] + (list(argv) if argv is not None else sys.argv[1:])),
        **run_info(device),
        rows=rows,
    )
    save_result(result, out)
    return result


def result_header(benchmark: str, script: str, argv, device, dtype=None) -> dict:
    """The first keys of an end-to-end benchmark's JSON: its name, when, where (the GPU's name,
    then the host's), the dtype and thread count, and the command line that produced it."""
    device = torch.device(device)
    hw = hardware_string()
    if device.type == "cuda":
        hw = f"{torch.cuda.get_device_name(device)}; host {hw}"
    header = {
        "benchmark": benchmark,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware": hw,
        "device": str(device),
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "command": f"python bench/{script} " + shlex.join(sys.argv[1:] if argv is None else argv),
    }
    return header if dtype is not None else {k: v for k, v in header.items() if k != "dtype"}


def save_result(result: dict, out, plot=None) -> None:
    """Write a benchmark's JSON to `out` and, given `plot(result, png_path)`, its PNG beside it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    written = [out]
    if plot is not None:
        plot(result, out.with_suffix(".png"))
        written.append(out.with_suffix(".png"))
    print(f"wrote {' and '.join(os.path.relpath(w) for w in written)}")
