"""Ctrl-C in the middle of an upload (issue 25): the real process, interrupted by SIGINT while its
first upload part is in flight to a loopback S3 API (moto's, in a thread of this process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch
from conftest import ROOT
from remote_servers import skip_without_s3, start_s3

skip_without_s3()


def test_sigint_mid_upload_is_exit_130_with_no_object_and_no_upload(tmp_path: Path) -> None:
    import s3fs

    src = tmp_path / "small.pth"
    torch.save({f"w{i}": torch.ones(1000) for i in range(4)}, src)  # one part, sent when the writer is done
    server = start_s3()
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=server.endpoint, skip_instance_cache=True)
    fs.mkdir("interrupted")
    in_flight, release = threading.Event(), threading.Event()

    def hold_the_first_part(method: str, path: str, range_: str) -> int | None:
        if method == "PUT" and "partNumber=1" in path:
            in_flight.set()
            release.wait(30)  # answered once the process is gone
        return None

    server.traffic.on_request = hold_the_first_part
    env = {
        **os.environ,
        "FSSPEC_S3_ENDPOINT_URL": server.endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    }
    out = "s3://interrupted/out/model.safetensors"
    # Ctrl-C reaches a process whose SIGINT is not ignored. pytest started in the background by a
    # shell without job control (`pytest ... &`, nohup, some CI runners) has SIGINT ignored, and a
    # child inherits that (Python leaves an ignored SIGINT ignored): it would finish the upload
    # once the held part is answered -- the "timeout after SIGINT" or "exit 0, empty stderr" this
    # test used to fail with. A handler here is reset to the default in the child by exec.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ckptfix", "convert", str(src), out],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert in_flight.wait(60), "the upload never started"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        release.set()
        if proc.poll() is None:
            proc.kill()
        server.traffic.on_request = None
    try:
        assert proc.returncode == 130, stderr
        assert b"interrupted" in stderr and b"Traceback" not in stderr
        assert not fs.exists("interrupted/out/model.safetensors")
        assert fs.call_s3("list_multipart_uploads", Bucket="interrupted").get("Uploads", []) == []
        assert any(r[0] == "DELETE" and "uploadId=" in r[1] for r in server.traffic.requests)  # aborted
    finally:
        server.stop()
