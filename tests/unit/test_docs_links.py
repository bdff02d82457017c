"""The documentation's links and the paths it names exist.

Every relative Markdown link in README.md and docs/*.md points at a file of
the repository, and its #anchor (if any) at a heading or an explicit
``<a id>`` of that file; every backticked repository path (``csrc/x.c``,
``tests/...py``, ``dcp_optim/...``) names a file or folder that exists.
Stale names (files renamed or merged away) fail here instead of misleading a
reader.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_PATH = re.compile(r"`((?:csrc|dcp_optim|tests|tools|benchmarks|docs|\.ci)/[\w./-]*)`")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    out = set(re.findall(r'<a id="([^"]+)"', text))
    for title in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_links_resolve(doc):
    text = _FENCE.sub("", doc.read_text())
    bad = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(target)
    assert not bad, f"{doc.name}: broken links {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_named_paths_exist(doc):
    bad = []
    for ref in _PATH.findall(doc.read_text()):
        ref = ref.rstrip(".")
        if "*" in ref or "<" in ref:
            continue
        if not (ROOT / ref).exists():
            bad.append(ref)
    assert not bad, f"{doc.name}: paths that do not exist {bad}"
