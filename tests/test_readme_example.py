"""README.md's manual three-process example, pasted as written: the exact commands of its bash block are
parsed out of README.md, its ports replaced by free ones, and run by bash; the final curl must print a
completion. Every process it started is stopped by its process group at the end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_helpers import port_free, wait_until
from server_utils import free_port

from pdserve.launch.procs import group_members

README = Path(__file__).resolve().parent.parent / "README.md"
RUN_TIMEOUT_S = 360  # bounds only: two instances load the embedded model on a loaded 2-core box


def example_script() -> str:
    """The bash block of README.md that starts `pdserve serve` twice and `pdserve proxy`."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    matches = [b for b in blocks if "pdserve proxy" in b and b.count("pdserve serve") == 2]
    assert len(matches) == 1, "README.md should have exactly one three-process example"
    return matches[0]


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)  # the script's own bound comes first, so its output is shown
def test_readme_three_process_example_runs_as_written(tmp_path: Path) -> None:
    script = example_script()
    ports = {p: free_port() for p in ("8100", "8200", "8192", "5600")}
    for old, new in ports.items():
        assert old in script
        script = re.sub(rf"\b{old}\b", str(new), script)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this venv's `pdserve`
    with open(tmp_path / "out.txt", "wb") as out:
        proc = subprocess.Popen(["bash", "-c", script], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                start_new_session=True)
    group = proc.pid  # bash and its `&` jobs: one process group, outliving bash itself
    try:
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        text = (tmp_path / "out.txt").read_text(errors="replace")
        assert rc == 0, f"the example did not finish (rc {rc}):\n{text[-4000:]}"
        answer = json.loads(text.strip().splitlines()[-1])  # the last curl's body
        assert answer["object"] == "text_completion" and answer["model"] == "smollm2-135m", answer
        assert answer["choices"][0]["text"].strip() and answer["usage"]["completion_tokens"] >= 1
        assert "error" not in answer
    finally:
        for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
            if group_members(group):
                os.killpg(group, sig)
                wait_until(lambda: not group_members(group), wait_s)
        proc.wait(timeout=10)
    assert group_members(group) == []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(port_free(p) for p in ports.values()):
        time.sleep(0.2)
    assert all(port_free(p) for p in ports.values())
