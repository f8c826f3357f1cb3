"""Side-by-side benchmarks of offloadd: every figure is a ratio against a baseline measured
in the same run (``docs/design.md``, section 11). Not part of ``pytest``, but for
``--smoke`` (``tests/integration/test_bench_smoke.py``).

``python -m offloadd.bench [--quick | --smoke] [--json FILE] [--only NAME ...] [--profile DIR]``

``--smoke`` runs every group at a tiny size (seconds each; ``Context.pick``) to show that
each still runs, not to measure: its figures are not held to their goals. It ends with one
line per group on stderr, ``smoke: <group>: ran N rows in Ts`` (or ``skipped in Ts: why``,
or ``FAILED in Ts: why``), and exits 1 when a group raised, gave a row without a figure, or
gave no rows without saying why (``Context.skip``: vLLM or mooncake missing).

Groups (``--only`` takes a group name or a result-name pattern such as ``shm_*_1MiB``):

- ``shm``: store/load throughput through a daemon subprocess vs a plain in-process copy of
  the same moves (``shm_store_<size>``, ``shm_load_<size>``, ``..._4ranks``), the ranks'
  memory in /dev/shm files; ``memfd``: the same with sealed memfds (``memfd_store_<size>``...).
- ``lookup``: lookup round-trip p50/p99 and lookups per second (1 and 8 clients) vs a bare
  ZeroMQ DEALER/ROUTER echo of the same payload in the same kind of process; and the lookup
  round trip while another rank keeps 4 MiB stores in flight vs the same daemon idle
  (``lookup_rtt_under_stores``; goal: ratio <= 2).
- ``handshake``: 8 ranks from first Hello to engine ready vs 8 bare echo round trips.
- ``index``: ChunkCache lookup/store cost at 10k, 100k, 1M committed keys vs 10k (random
  keys over the whole index, and keys from a 10k hot set), lookup cost vs a plain dict probe
  of the same keys (``dict_probe_*``), and index bytes per entry vs the key bytes.
- ``bounds``: what the bounds per tenant cost the index: a pinned lookup counted per engine
  and per tenant vs per engine only (``pinned_lookup_tenant_ns``), reservations with a lease
  vs without (``reserve_store_lease_ns``).
- ``events``: KV events per second through EventPublisher -> Subscriber, every seq checked,
  vs raw PUB/SUB of same-size payloads.
- ``vllm``: the vLLM plugin's scheduler-side cost per lookup and per scheduled request vs
  vLLM's own ``CPUOffloadingManager`` driven the same way (needs vLLM 0.33 installed).
- ``checksum``: GB/s of the journal's shard checksum vs memmove of the same extents.
- ``guarded``: GB/s of copies through a rank file's descriptor (pread/pwrite, what the cpu
  engine does) vs memmove through a mapping of the same file (``guarded_store_<page>``,
  ``guarded_load_<page>``).
- ``disk``: GB/s of the disk tier's writes and reads of 1 MiB chunks vs a plain sequential
  file write/read of the same bytes in the same I/O mode (``disk_write_1MiB``,
  ``disk_read_1MiB``).
- ``cuda_marshal``: CPU cost per copy of a 128k-copy cuda store job, planning and the batched
  call's marshalling with the driver call stubbed (no GPU), vs the previous path.
- ``mooncake``: GiB/s of the cluster tier's put and get (``MooncakeTier``, two nodes on a
  loopback ``mooncake_master``) vs raw ``batch_put_from`` / ``batch_get_into`` of the same
  chunks (``mooncake_put_<chunk>``, ``mooncake_get_<chunk>``); and through two served
  daemons: an engine on A stores until A published all, an engine on B looks up, promotes
  and loads them, vs raw puts and gets of the same bytes (``mooncake_daemon_publish``,
  ``mooncake_daemon_promote``); and what the AEAD costs, without the network: the tier's
  sealing and opening of a call's shards vs xxh3_64 of them alone, the plain tier's work
  (``mooncake_seal_<chunk>``, ``mooncake_open_<chunk>``); skipped without the extra.
- ``tiers``: chunk hit rate and time per request of a prefix-sharing workload (Zipf-popular
  documents, each request a document plus its own chunks, several times the arena) on a
  daemon with a disk tier of 4x its arena vs one with the same arena alone, same requests
  interleaved (``tiers_hit_rate_disk4x``, ``tiers_request_time_disk4x``).
- ``sharing``: arena bytes per cached token of an MLA engine (latent replicated on every TP
  rank, stored once) at TP=1/2/4/8 vs one copy of the latent (``mla_bytes_per_token_tp<N>``;
  goal: 1.0, flat).
- ``flood``: a victim's store and lookup round trips while 4 sockets with no session flood
  the daemon with step messages of 4,096 lookups vs the same round trips with no flood, in
  turn (``victim_store_under_flood``, ``victim_lookup_under_flood``).

The development benchmarks that drive vLLM's real scheduler and workers through the test
harness (``vllm_step``, ``vllm_trace``, ``shared_cache``) are not here: the wheel carries no
tests. They run from a checkout, ``python -m benchmarks``, with this runner (``main``'s
``groups``).

Progress goes to stderr, the table to stdout, the results (a list of
``{"name", "value", "unit", "baseline", "ratio", "params"}``) to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from offloadd.bench._util import Context, Progress, Result, Scratch

__all__ = ["GROUPS", "Group", "format_table", "groups_help", "main", "name_problem"]


@dataclass(frozen=True)
class Group:
    """A set of measurements that share their set-up."""

    name: str
    patterns: tuple[str, ...]  # the result names it produces
    run: Callable[[Context], list[Result]]
    about: str  # one line for --help


def _shm(ctx: Context) -> list[Result]:
    from offloadd.bench import datapath

    return datapath.run(ctx)


def _memfd(ctx: Context) -> list[Result]:
    from offloadd.bench import datapath

    return datapath.run(ctx, kind="memfd")


def _lookup(ctx: Context) -> list[Result]:
    from offloadd.bench import control

    return control.run_lookup(ctx) + control.run_under_stores(ctx)


def _handshake(ctx: Context) -> list[Result]:
    from offloadd.bench import control

    return control.run_handshake(ctx)


def _index(ctx: Context) -> list[Result]:
    from offloadd.bench import growth, step_cost

    return growth.run(ctx) + step_cost.run(ctx)


def _bounds(ctx: Context) -> list[Result]:
    from offloadd.bench import bounds

    return bounds.run(ctx)


def _vllm(ctx: Context) -> list[Result]:
    from offloadd.bench import vllm_manager

    return vllm_manager.run(ctx)


def _events(ctx: Context) -> list[Result]:
    from offloadd.bench import events

    return events.run(ctx)


def _checksum(ctx: Context) -> list[Result]:
    from offloadd.bench import integrity

    return integrity.run(ctx)


def _guarded(ctx: Context) -> list[Result]:
    from offloadd.bench import guarded

    return guarded.run(ctx)


def _disk(ctx: Context) -> list[Result]:
    from offloadd.bench import disk

    return disk.run(ctx)


def _cuda_marshal(ctx: Context) -> list[Result]:
    from offloadd.bench import cuda_marshal

    return cuda_marshal.run(ctx)


def _mooncake(ctx: Context) -> list[Result]:
    from offloadd.bench import mooncake, tiers

    return mooncake.run_aead(ctx) + mooncake.run(ctx) + tiers.run_cluster(ctx)


def _sharing(ctx: Context) -> list[Result]:
    from offloadd.bench import sharing

    return sharing.run(ctx)


def _flood(ctx: Context) -> list[Result]:
    from offloadd.bench import flood

    return flood.run(ctx)


def _tiers(ctx: Context) -> list[Result]:
    from offloadd.bench import tiers

    return tiers.run_hit_rate(ctx)


GROUPS = (
    Group("shm", ("shm_store_*", "shm_load_*"), _shm, "store/load GB/s, ranks in /dev/shm files"),
    Group(
        "memfd",
        ("memfd_store_*", "memfd_load_*", "daemon_cpu_per_chunk_2MiB"),
        _memfd,
        "the same, ranks in sealed memfds; the daemon's CPU per 2 MiB chunk",
    ),
    Group("lookup", ("lookup_rtt_*", "lookups_per_s_*"), _lookup, "lookup round trips and rates"),
    Group("handshake", ("handshake_*",), _handshake, "8 ranks from Hello to engine ready"),
    Group(
        "index",
        (
            "lookup_cost_*",
            "lookup_hot_cost_*",
            "store_cost_*",
            "dict_probe_*",
            "index_bytes_per_entry*",
            "store_step_cost",
        ),
        _index,
        "the index's cost and memory as it grows; a scheduler's step on a full arena",
    ),
    Group(
        "bounds",
        ("pinned_lookup_tenant_ns", "reserve_store_lease_ns"),
        _bounds,
        "what the per-tenant bounds cost the index",
    ),
    Group("events", ("events_per_s",), _events, "KV events per second"),
    Group(
        "vllm",
        ("vllm_lookup_*", "vllm_request_*"),
        _vllm,
        "the vLLM plugin's scheduler side (needs vLLM)",
    ),
    Group("checksum", ("checksum_*",), _checksum, "the journal's shard checksum"),
    Group("guarded", ("guarded_*",), _guarded, "copies through a rank file's descriptor"),
    Group("cuda_marshal", ("cuda_marshal_*",), _cuda_marshal, "cuda store job CPU cost, no GPU"),
    Group("disk", ("disk_*",), _disk, "the disk tier's writes and reads"),
    Group("mooncake", ("mooncake_*",), _mooncake, "the cluster tier (needs the mooncake extra)"),
    Group("tiers", ("tiers_*",), _tiers, "hit rate with a disk tier vs the arena alone"),
    Group("sharing", ("mla_bytes_per_token_*",), _sharing, "MLA arena bytes per token by TP"),
    Group("flood", ("victim_*_under_flood",), _flood, "a victim's round trips under a flood"),
)


# What ``name_problem`` adds for a name none of ``offloadd bench``'s groups gives.
ELSEWHERE = "the development benchmarks run from a checkout: python -m benchmarks --help"


def _groups(groups: Sequence[Group] | None) -> Sequence[Group]:
    """``groups``, or this module's ``GROUPS`` (read at call time: tests replace it)."""
    return GROUPS if groups is None else groups


def groups_help(groups: Sequence[Group] | None = None) -> str:
    """The groups, one a line: the epilog of ``--help`` here and in ``offloadd bench``."""
    groups = _groups(groups)
    width = max(len(g.name) for g in groups)
    lines = [f"  {g.name.ljust(width)}  {g.about}" for g in groups]
    return "groups (for --only):\n" + "\n".join(lines)


def _parser(groups: Sequence[Group] | None, prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=groups_help(groups),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true", help="fewer repetitions (about 7 minutes on a 2-core VM)"
    )
    size.add_argument(
        "--smoke",
        action="store_true",
        help="every group at a tiny size, to check that each runs (not to measure): a "
        "group that fails, or runs nothing without saying why, makes the exit status 1",
    )
    parser.add_argument("--json", metavar="FILE", help="write the results as a JSON list")

    def only(word: str) -> str:
        problem = name_problem(word, groups)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return word

    parser.add_argument(
        "--only",
        type=only,
        nargs="+",
        metavar="NAME",
        default=[],
        help="groups (" + ", ".join(g.name for g in _groups(groups)) + ") or result-name patterns",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="record each daemon subprocess with py-spy (collapsed stacks) into DIR",
    )
    return parser


def _selected(
    only: Sequence[str], groups: Sequence[Group] | None = None
) -> tuple[list[Group], list[str]]:
    """Groups to run and result-name patterns to keep (empty: all)."""
    groups = _groups(groups)
    if not only:
        return list(groups), []
    chosen: list[Group] = []
    patterns: list[str] = []
    for word in only:
        named = [g for g in groups if g.name == word]
        if named:
            patterns.extend(named[0].patterns)
        else:
            patterns.append(word)
    for group in groups:
        if any(_overlaps(p, gp) for p in patterns for gp in group.patterns):
            chosen.append(group)
    return chosen, patterns


def name_problem(word: str, groups: Sequence[Group] | None = None) -> str:
    """Why ``--only word`` would select nothing among ``groups`` (default ``GROUPS``), or
    ``""``."""
    if not word.strip():
        return f"expected a group or result name, got {word!r}"
    if not _selected([word], groups)[0]:
        names = ", ".join(g.name for g in _groups(groups))
        hint = f"; {ELSEWHERE}" if groups is None else ""
        return f"no benchmark group or result matches {word!r} (groups: {names}){hint}"
    return ""


def _overlaps(pattern: str, group_pattern: str) -> bool:
    """Whether names matching ``pattern`` may come from ``group_pattern`` (literal heads)."""
    head = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    group_head = group_pattern.split("*", 1)[0]
    return head.startswith(group_head) or group_head.startswith(head)


def _number(value: float) -> str:
    if math.isnan(value):
        return "-"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def format_table(results: Sequence[Result]) -> str:
    """The table printed last on stdout."""
    rows = [("name", "value", "baseline", "unit", "ratio", "goal")]
    for r in results:
        goal = str(r.params.get("goal", ""))
        verdict = r.params.get("goal_met")
        if goal and verdict is not None:
            goal += "  ok" if verdict else "  MISSED"
        rows.append((r.name, _number(r.value), _number(r.baseline), r.unit, f"{r.ratio:.2f}", goal))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        cells = [
            cell.ljust(width) if i in (0, 3, 5) else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _judge(result: Result) -> None:
    """Fill ``goal_met`` for the goals stated in ``params["goal"]``."""
    goal = result.params.get("goal")
    if not isinstance(goal, str):
        return
    kind, op, limit = goal.split()
    value = result.ratio if kind == "ratio" else result.value
    bound = float(limit)
    result.params["goal_met"] = value >= bound if op == ">=" else value <= bound


@dataclass
class Outcome:
    """How one group's run went: what ``--smoke`` reports, one line per group."""

    group: str
    seconds: float
    rows: int = 0
    skipped: list[str] = field(default_factory=list)
    failure: str = ""  # why the group failed ("" if it did not)

    def line(self) -> str:
        """``smoke: <group>: ran|skipped|FAILED ...``: the line the smoke test reads."""
        took = f"in {self.seconds:.1f}s"
        skips = "; ".join(self.skipped)
        if self.failure:
            status = f"FAILED {took}: {self.failure}"
        elif self.rows:
            status = f"ran {self.rows} rows {took}" + (f" (skipped {skips})" if skips else "")
        else:
            status = f"skipped {took}: {skips}"
        return f"smoke: {self.group}: {status}"


def _smoke_problem(results: Sequence[Result], skipped: Sequence[str], only: bool) -> str:
    """Why a group's smoke run counts as failed though it raised nothing, or ``""``: it gave
    no rows and no reason, or a row without a figure (the sizes are tiny, the goals moot).
    ``only``: ``--only`` chose the rows, perhaps none of those the smoke's sizes give."""
    if not results and not skipped:
        why = "no rows, and no reason given for none"
        return why + (" (or --only names no row of the smoke's sizes)" if only else "")
    for result in results:
        if not (math.isfinite(result.value) and math.isfinite(result.baseline)):
            return f"{result.name}: value {result.value}, baseline {result.baseline}"
    return ""


def main(
    argv: Sequence[str] | None = None,
    *,
    groups: Sequence[Group] | None = None,
    prog: str = "python -m offloadd.bench",
    description: str = "offloadd benchmarks: ratios against baselines measured side by side.",
) -> int:
    """Run the selected benchmarks of ``groups`` (default ``GROUPS``); print the table; write
    JSON. Returns an exit status. ``python -m benchmarks`` runs its own groups through it."""
    args = _parser(groups, prog, description).parse_args(argv)
    chosen, patterns = _selected(args.only, groups)
    if not chosen:
        print(f"no benchmark matches {args.only}", file=sys.stderr)
        return 2
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    progress = Progress()
    scratch = Scratch()
    quick = args.quick or args.smoke
    ctx = Context(quick, scratch, progress, patterns, args.profile, smoke=args.smoke)
    results: list[Result] = []
    outcomes: list[Outcome] = []
    started = time.perf_counter()
    try:
        for group in chosen:
            progress(f"{group.name}: start")
            skips = len(ctx.skipped)
            began = time.perf_counter()
            outcome = Outcome(group.name, 0.0)
            try:
                rows = group.run(ctx)
            except Exception as exc:  # one broken group must not lose the others' figures
                outcome.failure = repr(exc)
                rows = []
            outcome.seconds = time.perf_counter() - began
            outcome.rows = len(rows)
            outcome.skipped = ctx.skipped[skips:]
            if args.smoke and not outcome.failure:
                outcome.failure = _smoke_problem(rows, outcome.skipped, bool(patterns))
            if outcome.failure:
                progress(f"{group.name}: FAILED: {outcome.failure}")
            results += rows
            outcomes.append(outcome)
    finally:
        scratch.close()
    if not args.smoke:  # a smoke's figures come from tiny runs: no goal is judged on them
        for result in results:
            _judge(result)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    progress(f"done in {time.perf_counter() - started:.0f}s ({mode})")
    if args.profile:
        from offloadd.bench._profile import summarize_dir

        summarize_dir(args.profile)
        progress(f"profiles and summaries in {args.profile}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([r.as_json() for r in results], handle, indent=2)
            handle.write("\n")
    print(format_table(results))
    if args.smoke:
        for outcome in outcomes:
            print(outcome.line(), file=sys.stderr)
    failed = [o.group for o in outcomes if o.failure]
    if failed:
        print(f"failed groups: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
