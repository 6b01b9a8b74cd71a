"""Repack a `ray` wheel into one that runs Ray core (a cluster, tasks, actors, placement groups, named
actors) in a fraction of the size, for a machine reached only through a size-limited file transfer (the
GPU test box takes 64 MiB per call; ray 2.60's manylinux wheel is 76 MiB zipped, 193 MiB unzipped).

    python scripts/slim_ray_wheel.py ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl slim/

(DST: a wheel path, or a folder to write the same file name into.)

What goes, and why it is not needed by `pdserve up --ray` (which uses only Ray core):
- `ray/jars/`: the Java worker runtime (cross-language actors);
- `ray/dashboard/client/`: the dashboard's web UI build (the dashboard *agent*, which every raylet starts,
  is Python under ray/dashboard/ and stays);
- the libraries on top of core: Ray Data, Train, Tune, RLlib, Serve, LLM, AIR, Workflow (`ray.data` etc.
  are imported on first use only; core never imports them);
- test folders, type stubs (.pyi), source maps;
- the symbol tables of the native programs (`strip --strip-unneeded` on gcs_server, raylet, _raylet.so and
  the other ELF files): they only serve debuggers and symbolized crash traces.
RECORD is rewritten with the new files' hashes and sizes, so `pip install` of the result is a normal one.
Check the result before relying on it: it ran tests/test_ray_e2e.py on CPU and the 1P1D of
benchmarks/ray_gpu_smoke.py on an H200 (BENCHMARKS.md, "Ray on one H200").
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import shutil
import subprocess
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

LIBRARIES = ("data", "train", "tune", "rllib", "serve", "llm", "air", "workflow")
DROPPED_PREFIXES = {
    "ray/jars/": "Java workers",
    "ray/dashboard/client/": "dashboard web UI",
    **{f"ray/{lib}/": "libraries above core" for lib in LIBRARIES},
}
ELF_MAGIC = b"\x7fELF"


def drop_reason(name: str) -> str | None:
    """Why `name` (a path inside the wheel) is left out, or None to keep it."""
    for prefix, reason in DROPPED_PREFIXES.items():
        if name.startswith(prefix):
            return reason
    if "/tests/" in name or name.startswith("ray/tests/"):
        return "tests"
    if name.endswith((".pyi", ".js.map", ".map")):
        return "type stubs and source maps"
    return None


def strip_elf(data: bytes, strip: str) -> bytes:
    """The same ELF file without its symbol table (unchanged if `strip` fails on it)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f"
        path.write_bytes(data)
        done = subprocess.run([strip, "--strip-unneeded", str(path)], capture_output=True)
        return path.read_bytes() if done.returncode == 0 else data


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(src: Path, dst: Path, *, strip: str | None) -> Counter[str]:
    """Writes the slimmed wheel; returns the unzipped bytes dropped or saved per reason."""
    saved: Counter[str] = Counter()
    records: list[str] = []
    record_info: zipfile.ZipInfo | None = None
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
        for info in zi.infolist():
            name = info.filename
            if name.endswith(".dist-info/RECORD"):
                record_info = info
                continue
            reason = drop_reason(name)
            if reason is not None:
                saved[reason] += info.file_size
                continue
            data = zi.read(name)
            if strip and data[:4] == ELF_MAGIC:
                slimmer = strip_elf(data, strip)
                saved["ELF symbol tables"] += len(data) - len(slimmer)
                data = slimmer
            zo.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            records.append(record_line(name, data))
        if record_info is None:
            raise SystemExit(f"{src}: no .dist-info/RECORD (not a wheel?)")
        records.append(f"{record_info.filename},,")
        zo.writestr(record_info, "\n".join(records) + "\n", compress_type=zipfile.ZIP_DEFLATED)
    return saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path)
    p.add_argument("dst", help="the slimmed wheel's path, or a folder (ending in /) to write it into")
    p.add_argument("--no-strip", action="store_true", help="keep the native programs' symbol tables")
    args = p.parse_args()
    dst = Path(args.dst)
    if args.dst.endswith("/") or dst.is_dir():  # a folder: keep the wheel's name (pip reads its tags)
        dst.mkdir(parents=True, exist_ok=True)
        dst = dst / args.src.name
    if dst.resolve() == args.src.resolve():
        raise SystemExit("DST must differ from SRC")
    strip = None if args.no_strip else shutil.which("strip")
    if not args.no_strip and strip is None:
        print("note: no `strip` on PATH: the native programs keep their symbol tables")
    saved = slim(args.src, dst, strip=strip)
    mib = 2**20
    for reason, n in saved.most_common():
        print(f"  {reason}: -{n / mib:.1f} MiB unzipped")
    print(f"{args.src.name}: {args.src.stat().st_size / mib:.1f} MiB -> {dst} {dst.stat().st_size / mib:.1f} MiB")


if __name__ == "__main__":
    main()
