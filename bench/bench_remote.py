"""Checkpoints in a bucket on loopback: remote inspect (requests, bytes, time) and remote conversion
throughput next to a plain fsspec copy of the same bytes.

    python bench/bench_remote.py [--size-mb 256] [--runs 3] [--workdir bench/_work]

Two servers on 127.0.0.1, in threads of this process (tests/remote_servers.py), each counting the
requests it answered and the body bytes it produced: moto's S3 API, and a static HTTP server that
answers ranged GETs with ``pread`` (moto reads the whole object for every ranged GET, so on it any
ranged reader pays O(object) per request: its throughput figures say more about moto than about
the client). Every contender is its own process, configured the way a user would (fsspec's
environment configuration: FSSPEC_S3_ENDPOINT_URL and the AWS_* keys). Contenders, interleaved:

- ``ckptfix inspect`` of the object, and ``fs.info`` (one HEAD) for scale;
- ``ckptfix convert URL local.safetensors`` vs ``fs.get`` of the object (the same bytes down);
- S3 only: ``ckptfix convert s3://... s3://.../out.safetensors`` vs ``fs.get`` then ``fs.put``.

Peak RSS is not reported: the children are forked from this process, which holds the servers,
and ``ru_maxrss`` counts what they inherit; CPU time (user + system) of each child is.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness import Run, timed
from remote_servers import start_http, start_s3

MAKE = """
import sys, torch
count, per = 64, int(float(sys.argv[2]) * 1e6 / 4 / 64)
sd = {f"module.layer{i}.weight": torch.randn(per) for i in range(count)}
torch.save({"state_dict": sd, "epoch": 1}, sys.argv[1])
"""
GET = """
import sys, fsspec
fs, path = fsspec.core.url_to_fs(sys.argv[1])
fs.get(path, sys.argv[2])
if len(sys.argv) > 3:
    fs.put(sys.argv[2], fsspec.core.url_to_fs(sys.argv[3])[1])
"""
INFO = """
import sys, fsspec
fs, path = fsspec.core.url_to_fs(sys.argv[1])
fs.info(path)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mb", type=float, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(__file__).parent / "_work")
    parser.add_argument(
        "--serve",
        action="store_true",
        help="only start the servers with the input uploaded, print their settings and wait (for farm-bench)",
    )
    args = parser.parse_args()
    ckptfix = shutil.which("ckptfix") or sys.exit("ckptfix is not installed (pip install -e '.[remote]')")
    work = args.workdir / "remote"
    work.mkdir(parents=True, exist_ok=True)
    src = work / "train.pth"
    if not src.exists() or abs(src.stat().st_size - args.size_mb * 1e6) > 0.05 * args.size_mb * 1e6:
        subprocess.run([sys.executable, "-c", MAKE, str(src), str(args.size_mb)], check=True)

    server = start_s3()
    http = start_http(work)
    os.environ.update(
        {"FSSPEC_S3_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    )
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=server.endpoint, key="testing", secret="testing")
    fs.mkdir("bench")
    fs.put(str(src), "bench/run/train.pth")
    url, http_url = "s3://bench/run/train.pth", f"{http.endpoint}/train.pth"
    if args.serve:  # e.g. farm-bench -n 5 --vs "python -c GET ..." -- ckptfix convert ... (see RESULTS.md)
        keys = "AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing"
        print(f"export FSSPEC_S3_ENDPOINT_URL={server.endpoint} {keys}")
        print(f"input: {url} {http_url} {src}", flush=True)
        import time

        while True:
            time.sleep(3600)
    local_out, copy = work / "out.safetensors", work / "copy.pth"
    select = ["--select", "state_dict"]
    contenders = {
        "s3: ckptfix inspect": (server, [ckptfix, "inspect", url]),
        "s3: fsspec info (one HEAD)": (server, [sys.executable, "-c", INFO, url]),
        "s3: ckptfix convert -> local .safetensors": (server, [ckptfix, "convert", url, str(local_out), *select]),
        "s3: fsspec get (same bytes down)": (server, [sys.executable, "-c", GET, url, str(copy)]),
        "s3: ckptfix convert -> s3 .safetensors": (
            server,
            [ckptfix, "convert", url, "s3://bench/out/model.safetensors", *select, "--force"],
        ),
        "s3: fsspec get + put (down and up)": (
            server,
            [sys.executable, "-c", GET, url, str(copy), "s3://bench/out/copy.pth"],
        ),
        "http: ckptfix inspect": (http, [ckptfix, "inspect", http_url]),
        "http: ckptfix convert -> local .safetensors": (http, [ckptfix, "convert", http_url, str(local_out), *select]),
        "http: fsspec get (same bytes down)": (http, [sys.executable, "-c", GET, http_url, str(copy)]),
    }
    results: dict[str, list[Run]] = {name: [] for name in contenders}
    traffic: dict[str, tuple[int, int]] = {}
    for _ in range(args.runs):
        for name, (where, cmd) in contenders.items():
            for p in (local_out, copy):
                p.unlink(missing_ok=True)
            where.traffic.reset()
            results[name].append(timed(cmd))
            requests = [r for r in where.traffic.requests if "list-type" not in r[1]]
            traffic[name] = (len(requests), where.traffic.bytes_sent)
    server.stop()
    http.stop()

    size = src.stat().st_size
    print(f"input: {size / 1e6:.0f} MB torch zip (64 float32 tensors + epoch); {args.runs} runs each, interleaved")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print()
    print("| command | median wall (s) | all runs (s) | MB/s of input | CPU (s) | requests | bytes sent by server |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        times = [r.wall for r in runs]
        median = statistics.median(times)
        requests, sent = traffic[name]
        rate = "-" if "inspect" in name or "info" in name else f"{size / 1e6 / median:.0f}"
        cpu = statistics.median(r.cpu for r in runs)
        print(
            f"| {name} | {median:.2f} | {', '.join(f'{t:.2f}' for t in times)} | {rate} | {cpu:.2f} | {requests} "
            f"| {sent:,} |"
        )


if __name__ == "__main__":
    main()
