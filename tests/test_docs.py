"""The project documents itself: no file cites a document outside the repository, and every ``docs/`` page
(and section) that a file or a docs link names exists.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
OUTSIDE = (
    "DESIGN.md",
    "te_nemo.md",
    "te_surface.md",
    "h200_anchors.md",
    "tuning_service.md",
    "torch_flux.md",
    "style_anchors.md",
    "../shared",
    "/work/shared",
)
"""Background documents that live outside the repository: a reader of the code cannot follow them."""
OUTSIDE_RE = re.compile("|".join(rf"(?<![\w.]){re.escape(name)}" for name in OUTSIDE))
CITATION = re.compile(r"docs/(?P<page>[\w-]+)\.md(?:[,:] (?P<section>[A-Z][^).;`\n]*))?")
LINK = re.compile(r"\]\((?P<page>[\w-]+\.md)?(?:#(?P<anchor>[\w-]+))?\)")


def tracked_texts() -> dict[str, str]:
    """Every file git tracks or would add (undecodable bytes dropped); this test's own file, which names the
    outside documents, is left out."""
    listing = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    names = subprocess.run(listing, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    return {name: (ROOT / name).read_bytes().decode("utf-8", "ignore") for name in names if name != me}


def headings(page: Path) -> list[str]:
    """The page's headings, outside fenced code blocks."""
    found, fenced = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.append(line.lstrip("#").strip())
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_no_file_cites_a_document_outside_the_repository() -> None:
    cited = {
        f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}"
        for name, text in tracked_texts().items()
        for m in OUTSIDE_RE.finditer(text)
    }
    assert not cited, "cite the repository's docs/ instead:\n" + "\n".join(sorted(cited))


def test_every_docs_page_and_section_a_file_names_exists() -> None:
    missing = []
    for name, text in tracked_texts().items():
        for m in CITATION.finditer(text):
            page = DOCS / f"{m['page']}.md"
            if not page.is_file():
                missing.append(f"{name}: {m.group()} (no such page)")
                continue
            section = " ".join(m["section"].split()) if m["section"] else None
            if section and not any(section.startswith(h) or h.startswith(section) for h in headings(page)):
                missing.append(f"{name}: {m.group()} (no such section)")
    assert not missing, "\n".join(missing)


def test_every_link_between_docs_pages_resolves() -> None:
    broken = []
    for page in sorted(DOCS.glob("*.md")):
        for m in LINK.finditer(page.read_text(encoding="utf-8")):
            target = DOCS / m["page"] if m["page"] else page
            if not target.is_file():
                broken.append(f"{page.name}: {m.group()} (no such page)")
            elif m["anchor"] and m["anchor"] not in {slug(h) for h in headings(target)}:
                broken.append(f"{page.name}: {m.group()} (no such section)")
    assert not broken, "\n".join(broken)


def test_the_readme_links_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert [p.name for p in sorted(DOCS.glob("*.md")) if f"docs/{p.name}" not in readme] == []
