"""The docs name only what exists: repository files that are there, output paths that the
trainer writes, links that resolve, nothing outside the repository."""
import re
from pathlib import Path

import pytest

from minisparse.trainer.checkpoint import NAME

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# a repository file; "REV:path" (git show a66bdc1^:scripts/x.py) is history, not a claim
REPO_FILE = re.compile(r"(?<![:\w/])(?:scripts|configs|docs|minisparse|tests)/[\w./-]*"
                       r"\.(?:py|yaml|md|sh|png)\b")
CHECKPOINT = re.compile(r"\boutputs/[\w./{},-]*checkpoint[\w./-]*")
LINK = re.compile(r"\]\(([^)#\s]+)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_points_inside_the_repository(doc):
    text = doc.read_text()
    assert not re.findall(r"\.\./[\w]", text), "a path outside the repository"
    assert not re.findall(r"\bshared/(?:data|gpu)\b", text), "the workspace's shared folder"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_files_and_links_exist(doc):
    text = doc.read_text()
    missing = [p for p in REPO_FILE.findall(text) if not (REPO / p).exists()]
    links = [l for l in LINK.findall(text) if not l.startswith(("http:", "https:", "mailto:"))]
    missing += [l for l in links if not (doc.parent / l).exists()]
    assert not missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_checkpoint_paths_are_the_ones_runs_write(doc):
    """OUTPUT_DIR/checkpoints/rollout_NNNNNN[/hf] (trainer/checkpoint.py), not an older layout."""
    for path in CHECKPOINT.findall(doc.read_text()):
        parts = path.rstrip("/.,").split("/")
        assert "checkpoints" in parts, path
        after = parts[parts.index("checkpoints") + 1:]
        assert after and NAME.match(after[0]) and after[1:] in ([], ["hf"]), path


def test_scripts_run_as_modules():
    """scripts/*.py import the package as train.py does, run as `python -m scripts.NAME`
    from the repository root: none edits sys.path, and no doc or shell script runs one by
    its path (which would leave minisparse unimportable)."""
    scripts = sorted((REPO / "scripts").glob("*.py"))
    assert [p.name for p in scripts if "sys.path.insert" in p.read_text()] == []
    by_path = re.compile(r"(?:python3?|torchrun)(?:\s+--?[\w-]+(?:[ =][\w.]+)?)*\s+scripts/\w+\.py")
    texts = [*DOCS, *(REPO / "scripts").glob("*.sh"), *scripts]
    assert [p.name for p in texts if by_path.search(p.read_text())] == []
