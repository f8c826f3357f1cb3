"""docs/settings.md, generated from the settings schema: ``python -m offloadd.settings_doc``.

Each setting of ``offloadd.settings.SETTINGS_SECTIONS`` gets its type (the annotation), its
default (``Settings()``, in TOML), whether SIGHUP applies it (``offloadd.server.reload.LIVE``)
or it waits for a restart, and its meaning: the comment block above its field in
``offloadd/settings.py`` and the comment after it (read from the source, so the code's own
words are the reference), else ``MEANINGS`` below. Each section opens with its struct's
docstring. ``python -m offloadd.settings_doc --check`` exits 1 when docs/settings.md differs
(``tests/unit/test_settings_doc.py`` does the same).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import sys
import tokenize
from pathlib import Path

import msgspec

from offloadd import settings as settings_module
from offloadd.server.reload import LIVE
from offloadd.settings import SETTINGS_SECTIONS, SIZE_SETTINGS, Settings, _toml_value, format_size

__all__ = ["MEANINGS", "comments", "main", "render"]

DOC = Path("docs") / "settings.md"

# Meanings of the settings whose field has no comment in offloadd/settings.py (taken from
# their struct's docstring, the CLI's flags or operations.md). A setting with neither is an
# error: a new setting needs a comment or an entry here.
MEANINGS: dict[str, str] = {
    "server.endpoint": 'The control endpoint (ipc:// or tcp://). "": the default socket in '
    "the runtime directory ($RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/offloadd, "
    "/tmp/offloadd-<uid>).",
    "server.max_frame_bytes": "The largest request frame: one up to 64 KiB larger is refused "
    "(TOO_LARGE), a larger one ends its connection before it is read.",
    "server.shm_dirs": "Directories the ranks' shared-memory KV files live in; the journal may "
    "not be there.",
    "server.drain_seconds": "On SIGTERM, how long copies in flight may run before the daemon "
    "exits anyway.",
    "cache.arena": 'The arena file, an absolute path. "": /dev/shm/offloadd-<uid>/arena.',
    "cache.capacity": 'Arena size: the host memory the cache uses ("64GiB"; "64GB" is '
    '64e9 bytes; a bare "64G" is refused as ambiguous).',
    "cache.policy": "Eviction policy.",
    "cache.pin_lease_seconds": "Seconds a pinned lookup keeps its chunks from eviction when it "
    "names no lease (capped by limits.max_lease_seconds).",
    "log.level": "DEBUG, INFO, WARNING, ERROR or CRITICAL.",
    "log.format": '"journal": <priority>logger: message lines, no timestamps; "plain": '
    'timestamped lines; "auto": journal under systemd ($JOURNAL_STREAM), plain otherwise; '
    '"json": one JSON object per line (time, level, logger, message, exc_info).',
    "metrics.socket_mode": "The unix metrics socket's permission bits (octal).",
    "metrics.socket_group": 'The unix metrics socket\'s group ("": left as created).',
    "tenancy.share_across_uids": "Every local user is one tenant (one trust domain).",
    "tenancy.shared_groups": "Users whose primary group is one of these are one tenant per group.",
    "tenancy.client_topics": "Ranks may name their engine's KV-event topic (else "
    "events.topic_template decides, and a Hello naming another topic is refused).",
    "limits.regions_per_session": "KV regions one Hello may register.",
    "limits.key_bytes": "The longest key.",
    "limits.keys_per_request": "Keys in one request, at most.",
    "limits.protected_fraction": "Bytes an engine's sessions may keep from eviction (pins, "
    "holds, reservations), as a fraction of cache.capacity.",
    "limits.tenant_protected_fraction": "The same for all of one tenant's engines together "
    "(0: protected_fraction).",
    "limits.reservation_seconds": "How long a scheduler's reservation waits for its ranks' "
    "store before it is dropped (counted as expired).",
    "limits.mapped_bytes_per_uid": "Bytes of region files a uid's live sessions may make the "
    "daemon map (0: the host's MemTotal).",
    "limits.max_lease_seconds": "The longest pin lease a Lookup may ask for.",
    "limits.jobs_per_session": "Jobs in flight per session.",
    "limits.sessions_per_uid": "Live sessions per uid.",
    "limits.snapshot_keys": "Chunks announced (KV events) to an engine that becomes ready in "
    "a warm namespace, at most.",
    "limits.event_buffer_bytes": "Each event publisher's replay buffer, at most (besides "
    "events.buffer_steps).",
    "limits.registrations_per_uid": "Registration tokens a uid may have waiting for their Hello.",
    "limits.token_seconds": "How long an unused registration token lasts.",
    "limits.connections_per_uid": "Registration connections a uid may hold open at once.",
    "limits.descriptors_per_uid": "Descriptors a uid's registrations and sessions may make the "
    "daemon hold (keep below the unit's LimitNOFILE).",
    "limits.hello_bytes": "The largest encoded Hello, checked before it is decoded.",
    "disk.path": 'The disk tier\'s directory; "": no disk tier.',
    "events.enabled": "Publish KV-cache events.",
    "mooncake.protocol": 'How the cluster tier moves bytes: "tcp", or "rdma" (with rdma_devices).',
    "limits.lookups_per_message": "Lookups one scheduler step message (Reserve, UpdateHolds) "
    "may carry; more: refused TOO_LARGE whole, before any work.",
    "limits.jobs_per_message": "Jobs in one StepJobs; more: refused TOO_LARGE whole.",
    "limits.keys_per_message": "Keys in one message, every list of it and of its nested "
    "Lookups or jobs together.",
    "limits.fragments_per_page": "Copy fragments in one region's canonical page (a Hello "
    "over it is refused before its files are opened).",
    "limits.fragments_per_hello": "Copy fragments in all the canonical pages of one Hello.",
    "limits.socket_connections": "Connections each ZeroMQ socket (control, events, replay) "
    "keeps open; a newcomer beyond is closed as soon as it is accepted.",
    "limits.socket_connections_per_uid": "The same for one uid (all tcp peers count as one).",
    "limits.metrics_connections": "Connections the metrics server serves at once; idle ones "
    "are closed after 10 s.",
}


def comments() -> dict[str, str]:
    """``section.key`` -> the comments on that field in offloadd/settings.py, joined."""
    source = inspect.getsource(settings_module)
    by_line: dict[int, str] = {}  # comment lines alone
    after: dict[int, str] = {}  # comments after code
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            alone = token.line.lstrip().startswith("#")
            (by_line if alone else after)[token.start[0]] = token.string.lstrip("#").strip()
    classes = {struct.__name__: name for name, struct in SETTINGS_SECTIONS.items()}
    found: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef) or node.name not in classes:
            continue
        shared: list[str] = []  # a block above two adjacent fields is about both
        previous_end = 0
        for field in node.body:
            if not isinstance(field, ast.AnnAssign) or not isinstance(field.target, ast.Name):
                continue
            above: list[str] = []
            line = field.lineno - 1
            while line in by_line:  # the comment block right above the field
                above.insert(0, by_line[line])
                line -= 1
            name = f"{classes[node.name]}.{field.target.id}"
            if not above and previous_end == field.lineno - 1 and name not in MEANINGS:
                above = shared  # (a field with a meaning of its own ends the sharing)
            shared, previous_end = above, field.end_lineno or field.lineno
            inline = after.get(previous_end, "")
            text = " ".join([*above, inline[:1].upper() + inline[1:]]).strip()
            if text:
                found[name] = text
    return found


def render() -> str:
    """docs/settings.md's text."""
    defaults, noted = Settings(), comments()
    lines = [
        "# Settings",
        "",
        "<!-- Generated by `python -m offloadd.settings_doc` from offloadd/settings.py; "
        "do not edit. -->",
        "",
        "Built-in defaults < `--config FILE` (TOML, a `[section]` per table below) < "
        "`OFFLOADD_<SECTION>__<KEY>` environment variables < flags (`offloadd serve --help`).",
        "`offloadd check-config` prints the result; `systemd/offloadd.toml` lists every "
        "setting at its default. *Applies*: `SIGHUP` where `systemctl reload offloadd` (or "
        "`kill -HUP`) applies a change to a running daemon, `restart` where it waits for the "
        "next start (a reload logs which).",
    ]
    for section, struct in SETTINGS_SECTIONS.items():
        doc = " ".join((struct.__doc__ or "").split())
        lines += ["", f"## [{section}]", "", doc, ""]
        lines += [
            "| setting | type | default | applies | meaning |",
            "|---|---|---|---|---|",
        ]
        values = msgspec.to_builtins(getattr(defaults, section))
        for key in struct.__struct_fields__:
            name = f"{section}.{key}"
            meaning = noted.get(name) or MEANINGS.get(name)
            if not meaning:
                raise ValueError(f"{name} has no meaning: comment it in settings.py")
            default = f"`{_toml_value(values[key])}`"
            if (section, key) in SIZE_SETTINGS:
                default += f" ({format_size(values[key])})"
            kind = str(struct.__annotations__[key]).replace("|", "or")
            applies = "SIGHUP" if (section, key) in LIVE else "restart"
            cells = [f"`{name}`", f"`{kind}`", default, applies, _escaped(meaning)]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _escaped(text: str) -> str:
    """``<`` outside code spans as ``&lt;`` (Markdown would take ``<uid>`` for a tag)."""
    parts = text.split("`")
    return "`".join(
        part if odd % 2 else part.replace("<", "&lt;") for odd, part in enumerate(parts)
    )


def main(argv: list[str] | None = None) -> int:
    """Write docs/settings.md (or, with ``--check``, exit 1 when it differs)."""
    parser = argparse.ArgumentParser(prog="python -m offloadd.settings_doc")
    parser.add_argument("--output", type=Path, default=DOC, help=f"default {DOC}")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: run python -m offloadd.settings_doc", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
