"""Summaries of py-spy's collapsed stacks (``--format raw``): where the daemon spends time.

``python -m offloadd.bench._profile FILE...`` prints, per file, the busiest threads and the
functions with the most samples, by self time (the leaf frame) and inclusive (anywhere on
the stack). ``--profile DIR`` of the benchmarks writes one ``.summary`` per profile.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter

_LINE = re.compile(r"^(.*) (\d+)$")
_FRAME = re.compile(r"^(.*) \(([^()]*?)(?::\d+)?\)$")
# The directory holding the offloadd package (a checkout or site-packages), with a slash.
_IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + "/"


def _function(frame: str) -> str:
    """``handle (offloadd/server/daemon.py:123)`` -> ``handle (offloadd/server/daemon.py)``."""
    match = _FRAME.match(frame)
    if not match:
        return frame
    name, path = match.groups()
    for marker in ("/site-packages/", _IMPORT_ROOT, "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{name} ({path})"


def summarize(path: str, top: int = 25) -> str:
    """A text summary of one collapsed-stack file."""
    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    with open(path) as handle:
        for line in handle:
            match = _LINE.match(line.rstrip("\n"))
            if not match:
                continue
            stack, count_text = match.groups()
            count = int(count_text)
            frames = stack.split(";")
            if frames and frames[0].startswith(("thread ", "process ")):
                threads[frames[0]] += count
                frames = frames[1:]
            if not frames:
                continue
            total += count
            functions = [_function(f) for f in frames]
            own[functions[-1]] += count
            for function in set(functions):
                inclusive[function] += count
    lines = [f"{path}: {total} samples"]
    lines.append("threads:")
    lines += [f"  {n / total:6.1%}  {name}" for name, n in threads.most_common(8)] if total else []
    for title, counter in (("self", own), ("inclusive", inclusive)):
        lines.append(f"top {top} by {title}:")
        lines += [f"  {n / total:6.1%}  {name}" for name, n in counter.most_common(top)]
    return "\n".join(lines)


def summarize_dir(directory: str) -> None:
    """Write ``<profile>.summary`` beside each ``.txt`` profile in ``directory``."""
    for name in sorted(os.listdir(directory)):
        if name.endswith(".txt"):
            path = os.path.join(directory, name)
            with open(path[: -len(".txt")] + ".summary", "w") as handle:
                handle.write(summarize(path) + "\n")


if __name__ == "__main__":
    for argument in sys.argv[1:]:
        print(summarize(argument))
        print()
