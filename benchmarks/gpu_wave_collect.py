"""Fold a GPU wave's section folders into the few files a device call brings back (benchmarks/gpu_wave.sh).

    python3 benchmarks/gpu_wave_collect.py --work "$WORK" --out $OUT

The device returns at most 8 files of 16 MiB, so each section's output is merged: `wave.json` (per section its
status, seconds and budget from sections.tsv, every JSON file it wrote, the tail of its output), `wave.md` (the
status table, each gpu_suite.md, and the last lines of each section's output, where the scripts print their
tables) and `logs.tar.gz` (every other file, largest skipped first past the size cap). Standard library only.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import tarfile
from pathlib import Path

TAIL_CHARS = 20_000  # of each section's output in wave.json / wave.md
JSON_MAX_BYTES = 4 << 20  # a JSON file larger than this goes into the tar instead
TAR_MAX_BYTES = 14 << 20  # under the device's 16 MiB a file
SKIP_PARTS = ("torchinductor", "triton", "__pycache__", ".cache")  # caches a section's TMPDIR may hold


def read_sections(work: Path) -> list[dict]:
    rows = []
    tsv = work / "sections.tsv"
    for line in tsv.read_text().splitlines() if tsv.exists() else []:
        name, status, secs, budget = (line.split("\t") + ["", "", "", ""])[:4]
        rows.append({"section": name, "status": status, "seconds": int(secs or 0), "budget_s": int(budget or 0)})
    return rows


def tail(path: Path, chars: int = TAIL_CHARS) -> str:
    if not path.exists():
        return ""
    data = path.read_bytes()[-chars:]
    return data.decode(errors="replace")


def section_files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*")
                  if p.is_file() and not any(s in part for part in p.relative_to(d).parts[:-1] for s in SKIP_PARTS))


def collect(work: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    sections = read_sections(work)
    report: dict = {"sections": sections, "results": {}}
    md: list[str] = []
    rest: list[Path] = []
    for r in sections:
        d = work / r["section"]
        if not d.is_dir():
            continue
        res: dict = {"output_tail": tail(d / "stdout.txt")}
        for p in section_files(d):
            rel = str(p.relative_to(work))
            if p.suffix == ".json" and p.stat().st_size <= JSON_MAX_BYTES:
                try:
                    res[rel] = json.loads(p.read_text())
                    continue
                except ValueError:
                    pass
            if p.name != "stdout.txt":
                rest.append(p)
        report["results"][r["section"]] = res
        r["notes"] = verdicts(res)
        md.append(f"\n## {r['section']} ({r['status']}, {r['seconds']} s)\n")
        for p in sorted(d.rglob("gpu_suite.md")):
            md.append(p.read_text())
        md.append("```\n" + "\n".join(res["output_tail"].splitlines()[-60:]) + "\n```")
    table = ["| section | status | seconds | budget s | notes |", "|---|---|---|---|---|"]
    table += [f"| {r['section']} | {r['status']} | {r['seconds']} | {r['budget_s']} | {r.get('notes', '')} |"
              for r in sections]
    md = table + md
    (out / "wave.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "wave.md").write_text("\n".join(md) + "\n")
    write_tar(out / "logs.tar.gz", work, rest)


def verdicts(res: dict) -> str:
    """What a section's exit status hides: gpu_suite.py exits 0 with failed checks and sections that raised."""
    notes = []
    for name, data in res.items():
        if not (name.endswith("gpu_suite.json") and isinstance(data, dict)):
            continue
        for key, v in data.items():
            if not isinstance(v, dict):
                continue
            if "error" in v:
                notes.append(f"{key}: ERROR")
            elif v.get("ok") is False:
                notes.append(f"{key}: FAIL")
            elif v.get("ok") is True:
                notes.append(f"{key}: PASS")
            elif "skipped" in v:
                notes.append(f"{key}: skipped")
    check = re.search(r"choice check: (\d+) turns checked, (\d+) WRONG", res.get("output_tail", ""))
    if check is not None:  # bench_multiturn.py's summary line (its rows also say WRONG: not counted twice)
        notes.append(f"{check.group(2)} of {check.group(1)} turn(s) WRONG")
    return ", ".join(notes)


def write_tar(dest: Path, work: Path, files: list[Path]) -> None:
    """Smallest files first, so that a few large logs cannot crowd out the rest; what does not fit is listed."""
    left_out = []
    total = 0
    tmp = work / (dest.name + ".tmp")  # never a stray file in $OUT if the call is cut off mid-write
    with tarfile.open(tmp, "w:gz") as tar:
        for p in sorted(files, key=lambda p: p.stat().st_size):
            size = p.stat().st_size
            if total + size > TAR_MAX_BYTES * 3:  # text compresses ~3-10x; checked again on the result below
                left_out.append(f"{p.relative_to(work)} ({size} B)")
                continue
            tar.add(p, arcname=str(p.relative_to(work)))
            total += size
        note = ("\n".join(left_out) + "\n").encode()
        info = tarfile.TarInfo("LEFT_OUT.txt")
        info.size = len(note)
        tar.addfile(info, io.BytesIO(note))
    if tmp.stat().st_size > TAR_MAX_BYTES:  # poorly compressible content: keep the text logs only
        with tarfile.open(tmp, "w:gz") as tar:
            for p in files:
                if p.suffix in (".log", ".txt", ".jsonl", ".md") and p.stat().st_size < (1 << 20):
                    tar.add(p, arcname=str(p.relative_to(work)))
    tmp.replace(dest)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    collect(Path(args.work), Path(args.out))


if __name__ == "__main__":
    main()
