"""README numbers are copied from benchmark outputs by tools/sync_readme.py, never typed."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_tables_match_the_benchmark_outputs():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "sync_readme.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_targets_table_matches_the_records():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "targets_table.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_sync_copies_a_section_under_its_heading(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import sync_readme
    (tmp_path / "r.md").write_text("# title\n\nintro\n\n### A\n\nrow a\n\n### B\n\nrow b\n")
    monkeypatch.setattr(sync_readme, "ROOT", str(tmp_path))
    text = ("x\n<!-- BEGIN generated: r.md ### B -->\nold\n<!-- END generated -->\n"
            "<!-- BEGIN generated: r.md -->\n<!-- END generated -->\n")
    out = sync_readme.render(text)
    assert "row b" in out and "old" not in out.split("r.md -->")[1].split("<!-- END")[0]
    assert out.count("row a") == 1  # only in the whole-file block
