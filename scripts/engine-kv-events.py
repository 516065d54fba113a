#!/usr/bin/env python3
"""Fetches the engines' own KV-event message definitions for the fixture.

The Python publisher fixture (worker-agent/tests/fixtures/kv_publisher.py
--classes) can encode with vLLM's and SGLang's own `kv_events.py`. Their
wheels are large (vLLM about 340 MB, SGLang about 40 MB), so this reads only
the one file from each pinned wheel: the zip's central directory and the
file's entry, with HTTP range requests (under 1 MB each). The files land in
DEST (by default .venv/engine-kv-events/, outside the repository: their code
is never vendored) as DEST/<package>-<version>/kv_events.py.

Usage: scripts/engine-kv-events.py [DEST]
Prints one line per engine: `ok PATH` or `skip REASON` (no network, no such
wheel...); exits 0 either way, so a test run without network skips the
engines' own classes with a message.
"""

import io
import json
import os
import sys
import urllib.request
import zipfile

# The pinned engines and where their kv_events.py lives in the wheel.
PINNED = [
    ("vllm", "0.33.0", "vllm/distributed/kv_events.py"),
    ("sglang", "0.5.23", "sglang/srt/disaggregation/kv_events.py"),
]
INDEX = os.environ.get("SWITCHYARD_PYPI_SIMPLE", "https://pypi.org/simple")
TIMEOUT = 60


class RangeFile(io.RawIOBase):
    """A remote file read with HTTP range requests."""

    def __init__(self, url):
        self.url, self.pos, self.fetched = url, 0, 0
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=TIMEOUT) as r:
            self.size = int(r.headers["Content-Length"])

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def readinto(self, buf):
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        headers = {"Range": f"bytes={self.pos}-{self.pos + n - 1}"}
        with urllib.request.urlopen(urllib.request.Request(self.url, headers=headers), timeout=TIMEOUT) as r:
            data = r.read()
        buf[: len(data)] = data
        self.pos += len(data)
        self.fetched += len(data)
        return len(data)


def wheel_url(package, version):
    req = urllib.request.Request(
        f"{INDEX}/{package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        files = json.load(r)["files"]
    for f in files:
        name = f["filename"]
        if name.startswith(f"{package}-{version}-") and name.endswith(".whl") and (
            "x86_64" in name or "none-any" in name
        ):
            return f["url"]
    raise LookupError(f"no wheel of {package}=={version} on {INDEX}")


def fetch(package, version, member, dest):
    out = os.path.join(dest, f"{package}-{version}", "kv_events.py")
    if os.path.exists(out):
        return out, 0
    remote = RangeFile(wheel_url(package, version))
    with zipfile.ZipFile(io.BufferedReader(remote, buffer_size=1 << 16)) as z:
        data = z.read(member)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".tmp", "wb") as f:
        f.write(data)
    os.replace(out + ".tmp", out)
    return out, remote.fetched


def main():
    dest = sys.argv[1] if len(sys.argv) > 1 else ".venv/engine-kv-events"
    for package, version, member in PINNED:
        try:
            path, fetched = fetch(package, version, member, dest)
            print(f"ok {path} ({fetched} bytes fetched)")
        except Exception as e:  # network, index, zip: skip with the reason
            print(f"skip {package}=={version}: {e}")


if __name__ == "__main__":
    main()
