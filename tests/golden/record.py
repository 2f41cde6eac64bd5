"""Records the golden JSON (run once, on the code the goldens pin, e91e11d: check it out, copy
tests/golden/ into it and run there; `--cpu` writes this CPU's own recording, recorded/<cpu>/):
    python -m tests.golden.record [--cpu]"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.golden.cases import CLI_CASES, HERE, TRACES_REQUEST, cpu, normalize  # noqa: E402


def run_cli(args: list[str]) -> dict:
    from lmtrace.cli import main
    from lmtrace.trace_file import loads

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        code = main([a.replace("{out}", str(out)) for a in args])
        if code != 0:
            raise SystemExit(f"{args[0]} exited {code}")
        return loads(out.read_text(encoding="utf-8"))  # a trace's packed lens and attention expanded


def traces_answer(lm) -> dict:
    from fastapi.testclient import TestClient

    from lmtrace.server import create_app

    with TestClient(create_app(lm)) as client:
        r = client.post("/v1/traces", json=TRACES_REQUEST)
        r.raise_for_status()
        return r.json()


def main() -> None:
    import sys

    import lmtrace

    where = HERE / cpu() if "--cpu" in sys.argv[1:] else HERE
    where.mkdir(parents=True, exist_ok=True)
    docs = {name: run_cli(args) for name, args in CLI_CASES.items()}
    docs["v1_traces"] = traces_answer(lmtrace.load())
    for name, doc in docs.items():
        text = json.dumps(normalize(doc), ensure_ascii=False, indent=1, allow_nan=False)
        (where / f"{name}.json").write_text(text + "\n", encoding="utf-8")
        print(name, len(text))


if __name__ == "__main__":
    main()
