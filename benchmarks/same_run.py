"""Are two training runs the same, bit for bit? Every logged value but the clocks, and the HF export.

    .venv/bin/python -m benchmarks.same_run RUN_A RUN_B

For a refactor that must not change behaviour: train the same config (fp32, the same seed) from the
old tree and the new one, then compare. ``metrics.jsonl`` is compared line by line, key by key, with
``==`` on the floats as written (``time/*``, ``actor/time_s``, the throughputs derived from them and
the peak memory are left out: they are the clocks' and the allocator's); the HF export (``<run>/hf``) file by file by sha256. Prints what differs and a
JSON summary; exit 0 when nothing does, 1 otherwise.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

CLOCKS = re.compile(r"^(time/|perf/)|tokens_per_s$|/time_s$|peak_memory_gib$")


def logged(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not CLOCKS.search(k)} for row in rows]


def digests(folder: Path) -> dict[str, str]:
    if not folder.is_dir():
        return {}
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def main(a: Path, b: Path) -> int:
    rows_a, rows_b = logged(a), logged(b)
    diffs = []
    if len(rows_a) != len(rows_b):
        diffs.append(f"metrics.jsonl: {len(rows_a)} lines against {len(rows_b)}")
    values = 0
    for i, (ra, rb) in enumerate(zip(rows_a, rows_b)):
        for key in sorted(set(ra) | set(rb)):
            values += 1
            if ra.get(key, "<absent>") != rb.get(key, "<absent>"):
                diffs.append(f"line {i} {key}: {ra.get(key, '<absent>')!r} != {rb.get(key, '<absent>')!r}")
    hf_a, hf_b = digests(a / "hf"), digests(b / "hf")
    for name in sorted(set(hf_a) | set(hf_b)):
        if hf_a.get(name) != hf_b.get(name):
            diffs.append(f"hf/{name}: sha256 {hf_a.get(name)} != {hf_b.get(name)}")
    for line in diffs:
        print(line)
    summary = {
        "lines": len(rows_a),
        "values_compared": values,
        "hf_files": len(hf_a),
        "hf_weights_sha256": {n: d for n, d in hf_a.items() if n.endswith(".safetensors")},
        "differences": len(diffs),
    }
    print(json.dumps(summary, indent=1))
    return 1 if diffs else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
