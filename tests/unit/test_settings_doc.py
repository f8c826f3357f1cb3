"""docs/settings.md is what ``python -m offloadd.settings_doc`` generates from the settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from offloadd import settings_doc
from offloadd.server.reload import LIVE
from offloadd.settings import SETTINGS_SECTIONS

DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_docs_settings_md_matches_the_schema() -> None:
    assert DOC.read_text() == settings_doc.render(), (
        "docs/settings.md is stale: run python -m offloadd.settings_doc"
    )


def test_every_setting_has_a_row_with_its_meaning_and_whether_sighup_applies_it() -> None:
    rows = {
        line.split("|")[1].strip().strip("`"): [cell.strip() for cell in line.split("|")[2:-1]]
        for line in settings_doc.render().splitlines()
        if line.startswith("| `")
    }
    names = {
        f"{s}.{k}" for s, struct in SETTINGS_SECTIONS.items() for k in struct.__struct_fields__
    }
    assert set(rows) == names
    for name, (_kind, _default, applies, meaning) in rows.items():
        section, key = name.split(".")
        assert applies == ("SIGHUP" if (section, key) in LIVE else "restart"), name
        assert len(meaning) > 10, name
    assert rows["cache.capacity"][1] == "`1073741824` (1.0GiB)"
    assert "reaped" in rows["server.session_timeout"][3]  # the comment above the field
    assert rows["server.socket_group"][3] == rows["server.socket_mode"][3]  # one block, two


def test_check_fails_on_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "settings.md"
    stale.write_text("# Settings\n")
    assert settings_doc.main(["--check", "--output", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err
    assert settings_doc.main(["--output", str(stale)]) == 0
    assert settings_doc.main(["--check", "--output", str(stale)]) == 0


def test_a_setting_with_a_meaning_of_its_own_does_not_take_its_neighbours_comment() -> None:
    # A comment block above two adjacent fields is about both, and stops at a field with an
    # entry in MEANINGS (once, 19 limits all read reservation_renewals' comment); MEANINGS
    # holds only fields without a comment of their own.
    assert not set(settings_doc.comments()) & set(settings_doc.MEANINGS)
