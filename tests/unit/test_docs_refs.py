"""What the docs name exists: every ``offloadd <command>`` they show is a command of the CLI,
every setting (``section.key``, ``[section] key``, ``OFFLOADD_SECTION__KEY``) is one of
``offloadd.settings``, every markdown link to a local file or ``#anchor`` reaches one, and
every "(README, Section)" cited in prose is a heading of the README.

Read: README.md and docs/*.md. A command is looked for in code (inline spans and fenced
blocks) where ``offloadd`` (or a path ending ``/offloadd``) is the command word: at the start,
after ``sudo``, ``env``'s assignments, ``python -m``, ``--`` or a shell operator. Settings are
looked for everywhere in the text; a section name followed by a dot and a word is a setting
unless it is part of a longer dotted or slashed name, or names a module of the package of
that name (``server.lanes``, ``cache.index``) or a file (``disk.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from offloadd.cli import build_parser
from offloadd.settings import SETTINGS_SECTIONS

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# Words after which ``offloadd`` is the command being run.
COMMAND_POSITION = {"sudo", "env", "-m", "--", "&&", "||", "|", ";", "$", "#"}
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=\S*$")
SECTIONS = "|".join(SETTINGS_SECTIONS)
DOTTED = re.compile(rf"(?<![\w./-])({SECTIONS})\.([a-z_]\w*)(?![\w(/-]|\.\w)")
BRACKETED = re.compile(rf"\[({SECTIONS})\]\s+([a-z_]\w*)")
ENVIRONMENT = re.compile(r"\bOFFLOADD_([A-Z]+)__([A-Z_]+)\b")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def code_texts(text: str) -> Iterator[str]:
    """The fenced blocks' lines and the inline code spans of a markdown ``text``."""
    for block in FENCE.finditer(text):
        yield from block.group(1).splitlines()
    for span in SPAN.finditer(FENCE.sub("", text)):
        yield span.group(2).replace("\n", " ")


def commands_in(code: str) -> Iterator[list[str]]:
    """The words after each ``offloadd`` that is run as a command in ``code``."""
    words = [word.strip("`'\"(),") for word in code.split()]
    for i, word in enumerate(words):
        if word != "offloadd" and not word.endswith("/offloadd"):
            continue
        before = words[i - 1] if i else ""
        if i and before not in COMMAND_POSITION and not ASSIGNMENT.match(before):
            continue
        yield words[i + 1 : i + 3]


def unknown_commands(text: str) -> list[str]:
    """``offloadd WORD [WORD]`` in ``text``'s code that the command line does not have."""
    parser = build_parser()
    found = []
    for code in code_texts(text):
        for after in commands_in(code):
            if not after or not re.fullmatch(r"[a-z][a-z-]*", after[0]):
                continue  # `offloadd`, `offloadd --version`, `offloadd <command>`
            command = parser.commands.get(after[0])
            if command is None:
                found.append(f"offloadd {after[0]}")
                continue
            actions = [a for a in command._actions if a.choices and not a.option_strings]
            nested = actions[0].choices if actions else None
            word = after[1] if len(after) > 1 else ""
            if nested and re.fullmatch(r"[a-z]+", word) and word not in nested:
                found.append(f"offloadd {after[0]} {word}")
    return found


def _module(section: str, key: str) -> bool:
    """Whether ``section.key`` names a module (``server.lanes``) or a file (``disk.py``)."""
    package = REPO / "offloadd" / section
    return key in ("py", "md") or (package / f"{key}.py").exists() or (package / key).is_dir()


def unknown_settings(text: str) -> list[str]:
    """Setting names in ``text`` that ``offloadd.settings`` does not have."""
    names = [(m[1], m[2]) for m in DOTTED.finditer(text) if not _module(m[1], m[2])]
    names += [(m[1], m[2]) for m in BRACKETED.finditer(text)]
    names += [(m[1].lower(), m[2].lower()) for m in ENVIRONMENT.finditer(text)]
    found = []
    for section, key in names:
        struct = SETTINGS_SECTIONS.get(section)
        if struct is None:
            if section not in ("section",):  # OFFLOADD_<SECTION>__<KEY> spelled out
                found.append(f"{section}.{key}")
        elif key not in struct.__struct_fields__:
            found.append(f"{section}.{key}")
    return sorted(set(found))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor in a markdown ``text`` (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", text), re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    found.update(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))
    return found


def broken_links(path: Path) -> list[str]:
    """Links in the markdown file ``path`` to a local file or anchor that is not there."""
    text = path.read_text()
    found = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"^[a-z][a-z+.-]*:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            found.append(f"{target}: no file {file_part}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            found.append(f"{target}: no heading #{anchor} in {_rel(linked)}")
    return found


def unknown_readme_sections(text: str) -> list[str]:
    """Sections cited in prose as "(README, Title)" that README.md has no heading for."""
    readme = anchors((REPO / "README.md").read_text())
    cited = re.findall(r"README, ([A-Z][A-Za-z -]*?)\)", re.sub(r"\s+", " ", text))
    return [title for title in cited if slug(title) not in readme]


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_every_readme_section_cited_exists(path: Path) -> None:
    assert unknown_readme_sections(path.read_text()) == []


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_every_offloadd_command_in_the_docs_exists(path: Path) -> None:
    assert unknown_commands(path.read_text()) == []


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_every_setting_named_in_the_docs_exists(path: Path) -> None:
    assert unknown_settings(path.read_text()) == []


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_every_local_link_and_anchor_in_the_docs_exists(path: Path) -> None:
    assert broken_links(path) == []


def test_the_checks_catch_what_does_not_exist(tmp_path: Path) -> None:
    text = (
        "Run `offloadd serve`, `sudo offloadd stats`, `.venv/bin/offloadd cache purge`\n"
        "and `OFFLOADD_CACHE__SIZE=1 python -m offloadd frobnicate`; not `systemctl stop "
        "offloadd` nor `kubectl -n offloadd exec`.\n"
        "```sh\noffloadd demo --seed 7\noffloadd check-configs\n```\n"
        "Set `cache.capacity`, `cache.size`, `[events] enabled`, `[events] enable`, not "
        "`offloadd.cache.index` or `tiers/disk.py` or `disk.py`.\n"
    )
    assert unknown_commands(text) == [
        "offloadd check-configs",
        "offloadd stats",
        "offloadd cache purge",
        "offloadd frobnicate",
    ]
    assert unknown_settings(text) == ["cache.size", "events.enable"]
    assert unknown_readme_sections("(README, Status) and (see README, Security\nmodel)") == [
        "Security model"
    ]
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# B title\n## Running `it`, twice\n## Running it, twice\n")
    doc.write_text(
        "# A\n[ok](b.md#running-it-twice) [ok](b.md#running-it-twice-1) [ok](#a)\n"
        "[bad](b.md#nowhere) [bad](c.md) [bad](#b) [web](https://example.com/x.md)\n"
    )
    assert broken_links(doc) == [
        "b.md#nowhere: no heading #nowhere in b.md",
        "c.md: no file c.md",
        "#b: no heading #b in a.md",
    ]
