"""Nothing half-written: a writer killed at random moments leaves either the old file or the
complete new one, never a mix or a truncated file."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

WRITER = """
import sys
from lmtrace.files import write_atomic
path = sys.argv[1]
blobs = ["A" * 3_000_000, "B" * 2_000_000]
write_atomic(path, blobs[1])
print("ready", flush=True)
i = 0
while True:
    write_atomic(path, blobs[i % 2])
    i += 1
"""


def test_a_killed_writer_never_leaves_a_partial_file(tmp_path):
    target = tmp_path / "trace.json"
    target.write_text("old")
    allowed = {"old", "A" * 3_000_000, "B" * 2_000_000}
    rng = random.Random(0)
    kills = 0
    for _ in range(5):
        child = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"  # imports done, one file written
        time.sleep(rng.random() * 0.3)  # then somewhere in the middle of the writes
        child.send_signal(signal.SIGKILL)
        child.wait()
        kills += 1
        assert target.read_text() in allowed
    assert kills == 5
    assert target.read_text() != "old"  # the writer did replace it
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "trace.json"]
    assert all(name.startswith(".trace.json.") and name.endswith(".tmp") for name in leftovers)
