"""scripts/slim_ray_wheel.py on a small wheel of the same layout: what it drops, what it keeps, and a RECORD
that matches the files it wrote (so pip installs the result like any wheel)."""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "slim_ray_wheel.py"


def _wheel(path: Path, elf: bytes) -> None:
    files = {
        "ray/__init__.py": b"version = '2.60.0'\n",
        "ray/core/src/ray/raylet/raylet": elf,
        "ray/jars/ray_dist.jar": b"PK java",
        "ray/dashboard/client/build/static/js/main.js": b"ui",
        "ray/dashboard/agent.py": b"# the agent every raylet starts\n",
        "ray/rllib/algorithms/ppo.py": b"",
        "ray/serve/api.py": b"",
        "ray/data/dataset.py": b"",
        "ray/util/placement_group.py": b"",
        "ray/util/tests/test_x.py": b"",
        "ray/_raylet.pyi": b"",
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("ray-2.60.0.dist-info/RECORD", "".join(f"{n},sha256=x,{len(d)}\n" for n, d in files.items()))


def test_slim_keeps_core_and_rewrites_record(tmp_path: Path) -> None:
    if shutil.which("strip") is None:
        pytest.skip("no `strip`")
    src = tmp_path / "ray-2.60.0-cp311-cp311-manylinux2014_x86_64.whl"
    _wheel(src, Path(sys.executable).resolve().read_bytes())  # a real ELF program, with symbols or not
    out = subprocess.run([sys.executable, str(SCRIPT), str(src), str(tmp_path / "slim") + "/"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    dst = tmp_path / "slim" / src.name
    with zipfile.ZipFile(dst) as z:
        names = set(z.namelist())
        assert names == {"ray/__init__.py", "ray/core/src/ray/raylet/raylet", "ray/dashboard/agent.py",
                         "ray/util/placement_group.py", "ray-2.60.0.dist-info/RECORD"}
        record = z.read("ray-2.60.0.dist-info/RECORD").decode().splitlines()
        assert len(record) == len(names)
        for line in record:
            name, digest, size = line.split(",")
            if name.endswith("RECORD"):
                assert digest == size == ""
                continue
            data = z.read(name)
            assert int(size) == len(data)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert z.read("ray/core/src/ray/raylet/raylet")[:4] == b"\x7fELF"
    assert "Java workers" in out.stdout and "libraries above core" in out.stdout
