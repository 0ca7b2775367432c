#!/usr/bin/env python3
"""Prints graft's and llama.cpp's figures side by side, from the raw results that
scripts/peer/compare.sh writes into one folder:

    llama.<file>.main.json       llama-bench -o json of `-p P -n N` (a pp and a tg record)
    graft.<file>.main.json       graft bench --json of `-p P -n N`
    llama.<file>.d<D>.<x>.json   llama-bench -o json of `-p 0 -n N -d D` (x: a, b: runs
                                 before and after graft's)
    graft.<file>.d<D>.json       graft bench --json of `-p D -n N --reps 1`

    python3 scripts/peer/table.py FOLDER [--graft-rev REV]

One markdown row per file and case (ppP, tgN, tgN after D tokens): llama.cpp's mean ±
its standard deviation (each run where there are several), graft's figure and the ratio
of graft's to the mean of llama.cpp's. graft's tgN is timed after its P-token prompt,
llama-bench's from an empty context, which favours llama.cpp.
"""
import argparse
import json
import re
import sys
from pathlib import Path

NAME = re.compile(r"^(llama|graft)\.(.+)\.(main|d(\d+))(?:\.[a-z])?\.json$")


def fail(msg):
    sys.exit(f"table: error: {msg}")


def read_json(path):
    """The JSON in a file: llama-bench writes one array, graft bench one object a line."""
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            return [json.loads(line) for line in lines]
        except json.JSONDecodeError as e:
            fail(f"{path} is not JSON ({e}); the run that wrote it may have failed")


def llama_case(rec):
    """The case a llama-bench record measures, e.g. pp512, tg128, tg128@4096."""
    p, n, d = rec.get("n_prompt", 0), rec.get("n_gen", 0), rec.get("n_depth", 0)
    if p and not n:
        return f"pp{p}" if not d else f"pp{p}@{d}"
    if n and not p:
        return f"tg{n}" if not d else f"tg{n}@{d}"
    return f"pp{p}+tg{n}"


def collect(folder):
    """{(file, case): {"llama": [(mean, sd)], "graft": [tok/s]}} and the devices seen."""
    rows, devices = {}, set()
    names = sorted(folder.glob("*.json"))
    if not names:
        fail(f"{folder} holds no results (*.json)")
    for path in names:
        m = NAME.match(path.name)
        if not m:
            continue
        tool, stem, tag, depth = m.group(1), m.group(2), m.group(3), m.group(4)
        data = read_json(path)
        if tool == "llama":
            records = data if isinstance(data, list) else [data]
            for rec in records:
                devices.add(rec.get("gpu_info") or rec.get("cpu_info") or "unknown device")
                key = (stem, llama_case(rec))
                rows.setdefault(key, {"llama": [], "graft": []})["llama"].append(
                    (float(rec["avg_ts"]), float(rec.get("stddev_ts", 0.0))))
            continue
        rec = data[-1] if isinstance(data, list) else data
        p, n = rec["n_prompt"], rec["n_gen"]
        if tag == "main":
            cases = [(f"pp{p}", rec["prompt_tokens_per_s"]), (f"tg{n}", rec["gen_tokens_per_s"])]
        else:
            cases = [(f"tg{n}@{depth}", rec["gen_tokens_per_s"])]
        for case, tps in cases:
            rows.setdefault((stem, case), {"llama": [], "graft": []})["graft"].append(float(tps))
    return rows, devices


def fmt(x):
    return f"{x:,.0f}" if x >= 1000 else f"{x:.2f}"


def order(key):
    """Files in name order; in a file, pp, then tg, then tg after a depth."""
    stem, case = key
    kind = 0 if case.startswith("pp") else 2 if "@" in case else 1
    return stem, kind, case


def table(rows):
    out = ["| file | case | llama.cpp tok/s | graft tok/s | graft / llama.cpp |",
           "| --- | --- | ---: | ---: | ---: |"]
    for key in sorted(rows, key=order):
        stem, case = key
        llama, graft = rows[key]["llama"], rows[key]["graft"]
        label = case.replace("@", " after ") + (" tokens" if "@" in case else "")
        peer = ", ".join(f"{fmt(m)} ± {fmt(sd)}" for m, sd in llama) or "-"
        ours = ", ".join(fmt(t) for t in graft) or "-"
        ratio = "-"
        if llama and graft:
            mean = sum(m for m, _ in llama) / len(llama)
            ratio = f"{(sum(graft) / len(graft)) / mean:.2f}x"
        out.append(f"| {stem} | {label} | {peer} | {ours} | {ratio} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--graft-rev", default="unknown", help="graft's commit, for the header")
    a = ap.parse_args()
    if not a.folder.is_dir():
        fail(f"{a.folder} is not a folder")
    rows, devices = collect(a.folder)
    if not rows:
        fail(f"{a.folder} holds no llama.<file>.*.json or graft.<file>.*.json results")
    print(f"graft {a.graft_rev} against llama.cpp on {'; '.join(sorted(devices)) or 'unknown device'}")
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
