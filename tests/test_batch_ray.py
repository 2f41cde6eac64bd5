"""The Ray engine on a local Ray instance with 2 workers gives the local engine's output,
with the same resume rule. Kept light: 2 CPUs, no dashboard, a small object store."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import lmtrace
from lmtrace.batch import defaults_of, local_engine, run_job
from lmtrace.params import SamplingParams
from tests.same_record import assert_same, by_id, one_thread, read_records  # noqa: F401

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
pytestmark = pytest.mark.usefixtures("one_thread")

LINES = [
    {"id": "a", "prompt": "Hello world"},
    {"id": "zh", "prompt": "很久很久以前，"},
    {"id": 3, "prompt": "Once upon a time", "temperature": 0.8, "seed": 5},
    {"id": "bad", "prompt": "Hi", "top_k": -1},
    {"id": "b", "prompt": "the quick brown fox jumps"},
    {"id": "c", "prompt": "🙂 wörld"},
]


@pytest.fixture
def local_ray(monkeypatch):
    # Ray's workers are new processes: they must import the lmtrace under test
    src = str(Path(lmtrace.__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=100 * 2**20,
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()


def test_ray_engine_gives_the_local_output_and_resumes(local_ray, tiny_dir, tmp_path):
    from lmtrace.batch.ray_engine import ray_engine

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in LINES), encoding="utf-8")
    defaults = defaults_of(SamplingParams(temperature=0, max_new_tokens=6, top_logprobs=2))
    local_out = tmp_path / "local.jsonl"
    run_job(src, local_out, local_engine(lambda: lmtrace.load(tiny_dir, device="cpu"), defaults, 2))
    expected = by_id(read_records(local_out))

    ray_out = tmp_path / "ray.jsonl"  # two lines already done: the Ray run adds the other four
    ray_out.write_text("".join(json.dumps(expected[i], ensure_ascii=False) + "\n" for i in ("a", "bad")))
    engine = ray_engine({"source": str(tiny_dir), "device": "cpu"}, defaults, 2, num_workers=2)
    summary = run_job(src, ray_out, engine)
    assert (summary.already_done, summary.written, summary.errors) == (2, 4, 0)
    assert_same(by_id(read_records(ray_out)), expected)
