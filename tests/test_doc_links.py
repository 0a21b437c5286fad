"""Every relative link and #anchor in README.md and docs/**/*.md resolves (issue 52 item 2: the
manuals were split by purpose, and a link into a moved section must follow it). Anchors are GitHub's:
a heading's text lower-cased, punctuation but `-` and `_` dropped, spaces as `-`, repeats `-1`, `-2`;
or an explicit `<a id="...">`. Links inside code blocks and spans are not links."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose(text: str) -> list[str]:
    """The page's lines outside fenced code, with inline code spans blanked."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "``", line))
    return out


def slug(heading: str) -> str:
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    found = set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6} (.+)", line)
        if fenced or not heading:
            continue
        base = slug(heading.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken(page: Path) -> list[str]:
    bad = []
    for no, line in enumerate(prose(page.read_text()), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(REPO)}:{no}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no heading or <a id> '{anchor}' in {dest.relative_to(REPO)})")
    return bad


def test_every_relative_link_and_anchor_in_the_readme_and_docs_resolves():
    bad = [b for page in pages() for b in broken(page)]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_broken_anchor_and_a_missing_file(tmp_path, monkeypatch):
    page = tmp_path / "docs" / "a.md"
    page.parent.mkdir()
    page.write_text("# A page\n\n## Its `second` part, (dated)\n\n[ok](#its-second-part-dated) [self](a.md#a-page)\n"
                    "[bad](#nope) [gone](b.md) `[code](#x)`\n```\n[fenced](#y)\n```\n")
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    assert [b.split(": ", 1)[1] for b in broken(page)] == [
        "#nope (no heading or <a id> 'nope' in docs/a.md)", "b.md (no such file)"]


def test_code_names_docs_anchors_that_exist():
    """Docstrings and comments point readers at `docs/<page>.md#anchor`: each must still exist."""
    bad = []
    code = [p for top in ("engine", "testbed", "policies", "workloads", "tests", "scripts") for p in (REPO / top).rglob("*.py")]
    for path in [*code, *REPO.glob("scripts/*.sh"), *REPO.glob("testbed/studies/*.yaml"),
                 *REPO.glob("measurements/*/manifest.yaml")]:
        for page, anchor in re.findall(r"docs/([\w/-]+\.md)#([\w-]+)", path.read_text(errors="replace")):
            dest = REPO / "docs" / page
            if not dest.exists() or anchor not in anchors(dest):
                bad.append(f"{path.relative_to(REPO)}: docs/{page}#{anchor}")
    assert not bad, "\n".join(bad)


def test_every_page_renders_its_tables_and_headings():
    """A split page must still render (issue 52): each table block (a `|` header line over a `|---|`
    line) becomes one <table> whose rows have the header's cell count, each `#` heading outside code
    becomes a heading, and no code fence is left open. Rendered by markdown-it (rich's, a dependency)."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark").enable("table")
    bad = []
    for page in pages():
        text = page.read_text()
        lines = prose(text)
        lines = [ln.strip() for ln in lines]  # a table may sit indented in a list item
        blocks = [i for i in range(len(lines) - 1) if lines[i].startswith("|")
                  and re.match(r"^\|(\s*:?-{3,}:?\s*\|)+$", lines[i + 1])]
        tokens = md.parse(text)
        tables = [t for t in tokens if t.type == "table_open"]
        headings = [t for t in tokens if t.type == "heading_open"]
        name = page.relative_to(REPO)
        if len(tables) != len(blocks):
            bad.append(f"{name}: {len(blocks)} table blocks, {len(tables)} render as tables")
        for i in blocks:
            width = lines[i + 1].count("|") - 1
            for j in range(i + 2, len(lines)):
                row = re.sub(r"\\\|", "", lines[j])
                if not row.startswith("|"):
                    break
                if row.count("|") - 1 != width:
                    bad.append(f"{name}:{j + 1}: {row.count('|') - 1} cells under a {width}-column header")
        expected = sum(1 for ln in prose(text) if re.match(r"#{1,6} ", ln))
        if len(headings) != expected:
            bad.append(f"{name}: {expected} heading lines, {len(headings)} render as headings")
        if sum(1 for ln in text.splitlines() if FENCE.match(ln)) % 2:
            bad.append(f"{name}: a code fence is left open")
    assert not bad, "\n".join(bad)
