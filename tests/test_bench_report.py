"""bench/report.py: one page that lists every result with its provenance, plots, ratios, and staleness."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import report  # noqa: E402


def test_the_report_lists_every_result_and_links_every_plot(tmp_path: Path) -> None:
    out = tmp_path / "REPORT.md"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "report.py"), "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    results = sorted((ROOT / "bench" / "results").glob("*.json"))
    assert results
    for path in results:
        (row,) = [line for line in page.splitlines() if line.startswith(f"| [{path.name}]")]
        assert re.search(r"\| (fresh|\*\*stale\*\*|\*\*unknown\*\*) \|$", row), row
        assert f"\n## {path.name}\n" in page
    for png in (ROOT / "bench" / "results").glob("*.png"):
        (link,) = re.findall(rf"!\[{re.escape(png.name)}\]\(([^)]+)\)", page)
        assert (out.parent / link).resolve() == png.resolve()
    # a file that records its targets shows them as headline rows
    assert "| 4000 x 100 KiB cachesvc warm gRPC / s3torchconnector, 20 ms proxy |" in page


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip


def test_a_result_older_than_the_code_it_measures_is_stale(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "engine.py").write_text("v1\n")
    (repo / "other.py").write_text("v1\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "first")
    old = _git(repo, "rev-parse", "HEAD")
    (repo / "engine.py").write_text("v2\n")
    _git(repo, "commit", "-q", "-am", "the engine changes")
    changed = _git(repo, "rev-parse", "HEAD")
    (repo / "other.py").write_text("v2\n")
    _git(repo, "commit", "-q", "-am", "something else changes")

    results = tmp_path / "results"
    results.mkdir()
    documents = {
        "old.json": {"benchmark": "engine", "machine": {"commit": old[:7], "date_utc": "2026-01-01T00:00:00+00:00"}},
        "new.json": {"benchmark": "engine", "machine": {"code": {"commit": changed}, "date_utc": "2026-01-02"}},
        "bare.json": {"benchmark": "engine", "targets": {"speedup": {"ratio": 2.5, "target": 2.0, "met": True}}},
        "elsewhere.json": {"benchmark": "engine", "machine": {"commit": "0" * 40}},
    }
    for name, doc in documents.items():
        (results / name).write_text(json.dumps(doc))
    shutil.copy(ROOT / "bench" / "results" / "dataloader.png", results / "new.png")

    out = results / "REPORT.md"
    page = report.render(results, out, root=repo, measures={"engine": ["engine.py"]})
    rows = {line.split("]")[0][3:]: line for line in page.splitlines() if line.startswith("| [")}
    assert set(rows) == set(documents)
    assert rows["old.json"].endswith("| **stale** |") and old[:7] in rows["old.json"]
    assert "1 later commit(s) changed the code it measures, the last" in page and "the engine changes" in page
    assert rows["new.json"].endswith("| fresh |")
    assert rows["bare.json"].endswith("| **unknown** |") and "| unknown | unknown |" in rows["bare.json"]
    assert "| speedup | 2.5 | 2 | yes |" in page
    assert rows["elsewhere.json"].endswith("| **unknown** |") and "not in this repository's history" in page
    assert "![new.png](new.png)" in page
