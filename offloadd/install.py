"""``offloadd install``: set up a node for the daemon in one command (as root).

It makes what docs/operations.md ("Running as a service") lists: the system group
``offloadd-clients`` and user ``offloadd``, the venv ``/opt/offloadd/venv`` with the wheel
``make dist`` builds, the unit ``/etc/systemd/system/offloadd.service`` and the settings file
``/etc/offloadd/offloadd.toml``, both from the package's data (``offloadd/data/``, which
``systemd/`` in the checkout links to), then prints the ``vllm serve`` line for this node.

Each step first looks at what is there and does only what is missing, so a second run
changes nothing and says so: the group, the user and group memberships are created when
absent; the venv is created when absent (an existing one is kept, with what was installed
in it first, such as the torch build for the node's CUDA) and the wheel is installed when
its sha256 differs from the one recorded in the venv; the unit is written when it differs
from the shipped one; the settings file only when absent (it is the operator's).

``--prefix DIR`` puts every path under DIR and the unit names them there (a venv cannot be
moved once made, so DIR is where they are used); it creates no user or group unless
``--create-users`` asks, and runs no ``systemctl``. ``--dry-run`` prints the steps and changes
nothing.

It needs the standard library only, so that a node with nothing but Python runs it from the
wheel itself (``PYTHONPATH=offloadd-*.whl python3 -m offloadd install``: ``__main__`` comes
here before the command line imports its dependencies; the wheel it runs from is the one it
installs). The settings file is read with ``tomllib`` for the endpoint alone; the venv's own
``offloadd check-config`` validates it.
"""

from __future__ import annotations

import argparse
import functools
import grp
import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import NoReturn, TextIO

import offloadd
from offloadd import __version__
from offloadd.endpoint import NODE_RUNTIME_DIR

__all__ = [
    "CONFIG",
    "GROUP",
    "UNIT",
    "USER",
    "VENV",
    "Options",
    "Step",
    "add_command",
    "main",
    "main_argv",
    "plan",
    "shipped",
    "unit_text",
    "vllm_serve_line",
]

# The places the shipped unit names (ExecStart=, --config) and where it is installed.
VENV = "/opt/offloadd/venv"
CONFIG = "/etc/offloadd/offloadd.toml"
UNIT = "/etc/systemd/system/offloadd.service"
# The unit's User= and Group= (the group of the ranks' users: they reach its socket).
USER = "offloadd"
GROUP = "offloadd-clients"
# The wheel installed in the venv, recorded so that a second run can tell it is the same.
MARKER = "offloadd-wheel.sha256"
DEFAULT_WHEEL = f"dist/offloadd-{__version__}-py3-none-any.whl"
NODE_ENDPOINT = f"ipc://{NODE_RUNTIME_DIR}/offloadd.sock"  # the unit's RuntimeDirectory=
FAILED = 1
BAD_USAGE = 2


@dataclass(frozen=True)
class Options:
    """What ``offloadd install`` was asked to do."""

    wheel: Path
    prefix: Path | None = None
    dry_run: bool = False
    create_users: bool = False  # the command: True without --prefix
    clients: tuple[str, ...] = ()
    python: str = sys.executable
    no_deps: bool = False
    pip_args: tuple[str, ...] = ()

    def path(self, absolute: str) -> Path:
        """``absolute`` under the prefix (itself without one)."""
        return self.prefix / absolute.lstrip("/") if self.prefix else Path(absolute)


@dataclass(frozen=True)
class Step:
    """One thing the node needs: ``change`` says what doing it does, ``state`` what is there
    when it is done already (``action`` None)."""

    change: str
    state: str
    action: Callable[[], None] | None


def shipped(name: str) -> str:
    """The text of a file of ``offloadd/data/`` (``offloadd.service``, ``offloadd.toml``)."""
    return resources.files("offloadd").joinpath("data", name).read_text()


def unit_text(options: Options) -> str:
    """The shipped unit, naming the venv and settings file where ``options`` puts them."""
    text = shipped("offloadd.service")
    if options.prefix:
        for path in (VENV, CONFIG):
            text = text.replace(path, str(options.path(path)))
    return text


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _run(command: Sequence[str]) -> None:
    subprocess.run(list(command), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _write(path: Path, text: str, *, mode: int = 0o644) -> None:
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.new")
    temporary.write_text(text)
    temporary.chmod(mode)
    temporary.replace(path)


def _user_steps(options: Options) -> list[Step]:
    steps = []
    try:
        grp.getgrnam(GROUP)
        steps.append(Step("", f"group {GROUP} exists", None))
    except KeyError:
        steps.append(
            Step(f"create system group {GROUP}", "", lambda: _run(["groupadd", "--system", GROUP]))
        )
    try:
        pwd.getpwnam(USER)
        steps.append(Step("", f"user {USER} exists", None))
    except KeyError:
        command = ["useradd", "--system", "--gid", GROUP, "--no-create-home"]
        command += ["--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", USER]
        steps.append(Step(f"create system user {USER} (group {GROUP})", "", lambda: _run(command)))
    for client in options.clients:
        try:
            members = grp.getgrnam(GROUP).gr_mem
        except KeyError:
            members = []
        if client in members:
            steps.append(Step("", f"user {client} is in {GROUP}", None))
        else:
            add = functools.partial(_run, ["usermod", "-aG", GROUP, client])
            steps.append(Step(f"add user {client} to {GROUP}", "", add))
    return steps


def _venv_step(options: Options) -> Step:
    venv = options.path(VENV)
    python = venv / "bin" / "python"
    marker = venv / MARKER
    record = f"{_sha256(options.wheel)}  {options.wheel.name}\n"
    if python.exists() and marker.exists() and marker.read_text() == record:
        return Step("", f"venv {venv} has {options.wheel.name} (same sha256)", None)

    def make() -> None:
        if not python.exists():
            _run([options.python, "-m", "venv", str(venv)])
        pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q", "install"]
        pip += options.pip_args
        if not options.no_deps:  # the dependencies pip resolves (an existing torch is kept)
            _run([*pip, str(options.wheel)])
        # The same version rebuilt is installed again, its dependencies left as they are.
        _run([*pip, "--no-deps", "--force-reinstall", str(options.wheel)])
        _write(marker, record)

    made = "install" if python.exists() else "create venv and install"
    return Step(f"{made} {options.wheel.name} in {venv}", "", make)


def _unit_step(options: Options) -> Step:
    unit, text = options.path(UNIT), unit_text(options)
    if unit.exists() and unit.read_text() == text:
        return Step("", f"unit {unit} is up to date", None)
    verb = "replace" if unit.exists() else "write"
    return Step(f"{verb} unit {unit}", "", lambda: _write(unit, text))


def _config_step(options: Options) -> Step:
    config = options.path(CONFIG)
    if config.exists():
        return Step("", f"settings {config} exist (kept: they are yours)", None)
    text = shipped("offloadd.toml")
    return Step(f"write settings {config}", "", lambda: _write(config, text))


def plan(options: Options) -> list[Step]:
    """What installing on this node takes, in order; a step with no action is done already."""
    steps = _user_steps(options) if options.create_users else []
    unit = _unit_step(options)
    steps += [_venv_step(options), unit, _config_step(options)]
    if unit.action and not options.prefix and Path("/run/systemd/system").is_dir():
        reload = ["systemctl", "daemon-reload"]
        steps.append(Step("run systemctl daemon-reload", "", lambda: _run(reload)))
    return steps


def node_endpoint(options: Options) -> str:
    """The control endpoint the installed daemon listens on: its settings file's, else the
    unit's runtime directory."""
    config = options.path(CONFIG)
    try:
        with config.open("rb") as file:
            server = tomllib.load(file).get("server", {})
    except (OSError, tomllib.TOMLDecodeError):
        return NODE_ENDPOINT  # none yet (check-config says what is wrong with a bad one)
    endpoint = server.get("endpoint") if isinstance(server, dict) else None
    return endpoint if isinstance(endpoint, str) and endpoint else NODE_ENDPOINT


def vllm_serve_line(endpoint: str) -> str:
    """The ``vllm serve`` command that offloads to the daemon at ``endpoint`` (README's)."""
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "OffloaddSpec",
            "spec_module_path": "offloadd.vllm",
            "offloadd_endpoint": endpoint,
            "block_size": 256,
        },
    }
    return f"vllm serve MODEL --kv-transfer-config '{json.dumps(transfer)}'"


def _check_config(options: Options) -> str:
    """Why the installed venv's ``offloadd check-config`` rejects the settings file ("" when
    it accepts them)."""
    command = [str(options.path(VENV) / "bin" / "offloadd"), "check-config"]
    done = subprocess.run(
        [*command, "--config", str(options.path(CONFIG))],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD_")},
        check=False,
    )
    return "" if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


def main(options: Options, out: TextIO | None = None) -> int:
    """Install as ``options`` say; 0 when the node is installed (or would be, dry-run)."""
    out = out or sys.stdout
    prog = "offloadd install" + (" --dry-run" if options.dry_run else "")
    steps = plan(options)
    to_do = [step for step in steps if step.action]
    out.write(f"{prog}: offloadd {__version__} from {options.wheel}\n")
    for step in steps:
        if not step.action:
            out.write(f"  ok      {step.state}\n")
        elif options.dry_run:
            out.write(f"  would   {step.change}\n")
        else:
            out.write(f"  doing   {step.change}\n")
            out.flush()
            try:
                step.action()
            except subprocess.CalledProcessError as exc:
                why = exc.stderr.decode(errors="replace").strip() if exc.stderr else ""
                command = " ".join(map(str, exc.cmd))
                print(f"{prog}: {command} failed (exit {exc.returncode}): {why}", file=sys.stderr)
                return FAILED
            except OSError as exc:
                print(f"{prog}: {step.change}: {exc}", file=sys.stderr)
                return FAILED
    if options.dry_run:
        out.write(f"{prog}: {_changes(len(to_do))} to make; nothing was changed\n")
    else:
        problem = _check_config(options)
        if problem:
            print(f"{prog}: {options.path(CONFIG)}: {problem}", file=sys.stderr)
            return FAILED
        out.write(f"  ok      check-config accepts {options.path(CONFIG)}\n")
        done = f"{_changes(len(to_do))} made" if to_do else "nothing to change: already installed"
        out.write(f"{prog}: {done}\n")
    _next_steps(options, out)
    return 0


def _changes(count: int) -> str:
    return f"{count} change{'' if count == 1 else 's'}"


def _next_steps(options: Options, out: TextIO) -> None:
    endpoint = node_endpoint(options)
    link = f"systemctl link {options.path(UNIT)} && " if options.prefix else ""
    out.write(
        f"\nNext: set cache.capacity in {options.path(CONFIG)}, then\n"
        f"  {link}systemctl enable --now offloadd\n"
        f"As a user in {GROUP} (the group primary for CUDA ranks: sg {GROUP} -c '...'),\n"
        f"with offloadd installed in vLLM's environment (pip install --no-deps "
        f"{options.wheel.name}):\n"
        f"  {vllm_serve_line(endpoint)}\n"
        f"  offloadd status --endpoint {endpoint}\n"
    )


HELP = "set up this node (as root): user, group, venv, unit, settings file"
DESCRIPTION = (
    f"Create the offloadd user and offloadd-clients group, the venv {VENV} with the wheel, "
    f"the unit {UNIT} and {CONFIG} (kept when it exists), as docs/operations.md describes; "
    "then print the vllm serve line for this node. Only what is missing is done: a second "
    "run changes nothing and says so."
)


def add_command(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``install`` by the command line's ``add_parser``."""
    _add_arguments(add_parser("install", help=HELP, description=DESCRIPTION))


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, as the rest of the command line gives them."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line and exit with status 2."""
        self.exit(BAD_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main_argv(argv: Sequence[str]) -> int:
    """``offloadd install ARGS`` without the rest of the command line (``__main__``)."""
    parser = _Parser(prog="offloadd install", description=DESCRIPTION)
    _add_arguments(parser)
    return run_command(parser.parse_args(argv))


def _running_wheel() -> str | None:
    """The wheel this code runs from (``PYTHONPATH=X.whl``), if it does."""
    holder = Path(offloadd.__file__).parent.parent
    return str(holder) if holder.suffix == ".whl" else None


def _wheel_file(text: str) -> str:
    if not text.endswith(".whl") or not os.path.isfile(text):
        hint = "run `make dist` in the checkout, or give the path of a built one"
        raise argparse.ArgumentTypeError(f"no wheel (*.whl) at {text!r}: {hint}")
    return text


def _prefix(text: str) -> str:
    if not os.path.isabs(text):
        raise argparse.ArgumentTypeError(f"expected an absolute directory, got {text!r}")
    return text


def _user(text: str) -> str:
    try:
        pwd.getpwnam(text)
    except KeyError:
        raise argparse.ArgumentTypeError(f"no user {text!r} on this host") from None
    return text


def _python(text: str) -> str:
    if not text or shutil.which(text) is None:
        raise argparse.ArgumentTypeError(f"no Python to run at {text!r}")
    return text


def _pip_option(text: str) -> str:
    if not text.startswith("-"):
        raise argparse.ArgumentTypeError(f"expected a pip install option (-...), got {text!r}")
    return text


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    wheel = _running_wheel()
    parser.add_argument(
        "--wheel",
        type=_wheel_file,
        metavar="PATH",
        default=wheel or DEFAULT_WHEEL,
        help="the wheel to install (default: "
        + (f"{wheel}, the one running" if wheel else f"{DEFAULT_WHEEL}, what `make dist` builds")
        + ")",
    )
    parser.add_argument(
        "--prefix",
        type=_prefix,
        metavar="DIR",
        help="put every path under DIR, and name them there in the unit (for packagers and "
        "tests); creates no user or group unless --create-users, runs no systemctl",
    )
    parser.add_argument(
        "--create-users", action="store_true", help="with --prefix: create them anyway (root)"
    )
    parser.add_argument(
        "--client",
        type=_user,
        action="append",
        default=[],
        metavar="USER",
        help="add this user (who runs vLLM) to offloadd-clients; may repeat",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the steps, change nothing")
    parser.add_argument(
        "--python",
        type=_python,
        default=sys.executable,
        metavar="PATH",
        help="the Python the venv is made with (default: this one)",
    )
    parser.add_argument(
        "--no-deps",
        action="store_true",
        help="install the wheel alone: its dependencies are in the venv already",
    )
    parser.add_argument(
        "--pip-arg",
        type=_pip_option,
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to pip install, e.g. --pip-arg=--index-url=URL; may repeat",
    )
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    """``offloadd install``: checks its arguments, then ``main``."""
    wheel = Path(args.wheel).resolve()
    if not wheel.is_file():  # the default, which argparse does not check
        hint = "run `make dist` in the checkout, or give --wheel PATH"
        print(f"offloadd install: no wheel at {args.wheel}: {hint}", file=sys.stderr)
        return BAD_USAGE
    prefix = Path(args.prefix).resolve() if args.prefix else None
    options = Options(
        wheel=wheel,
        prefix=prefix,
        dry_run=args.dry_run,
        create_users=prefix is None or args.create_users,
        clients=tuple(args.client),
        python=args.python,
        no_deps=args.no_deps,
        pip_args=tuple(args.pip_arg),
    )
    if options.create_users and os.geteuid() != 0 and not options.dry_run:
        print(
            "offloadd install: run it as root (it creates users and writes /etc and /opt), "
            "or give --prefix DIR (without --create-users), or --dry-run",
            file=sys.stderr,
        )
        return FAILED
    if args.client and not options.create_users:
        hint = "drop --prefix or add --create-users"
        print(f"offloadd install: --client adds to a group it manages: {hint}", file=sys.stderr)
        return BAD_USAGE
    return main(options)
