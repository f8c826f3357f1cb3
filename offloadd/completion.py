"""Shell completion for ``offloadd``, generated from the command line's own parser.

``offloadd completion bash|zsh`` prints a script whose tables (the subcommands, the flags and
the choices of each command) are read from the argparse parser when it runs, so a flag added
to the command line is completed without touching this module. Both scripts share one walk:
the words before the cursor choose the command (``cache clear``), skipping the value a flag
takes; the cursor's word is then a flag, a flag's value (its choices, else a file name), or a
subcommand. Standard library only: the command line imports this inside its handler.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterator
from dataclasses import dataclass

SHELLS = ("bash", "zsh")
FUNCTION = "_offloadd"


@dataclass(frozen=True)
class Command:
    """One command of the parser as completion sees it."""

    path: tuple[str, ...]  # () for ``offloadd`` itself, ("cache", "ls") for ``cache ls``
    subcommands: tuple[str, ...]
    flags: tuple[str, ...]  # every option string, ``-h`` included
    positional_choices: tuple[str, ...]  # words a positional argument may be
    value_flags: dict[str, tuple[str, ...]]  # flag taking a value -> its choices (or none)


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[Command]:
    """``parser`` and each of its subcommands' parsers, depth first."""
    subparsers: dict[str, argparse.ArgumentParser] = {}
    flags: list[str] = []
    choices: list[str] = []
    value_flags: dict[str, tuple[str, ...]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subparsers.update(action.choices)
        elif action.option_strings:
            flags.extend(action.option_strings)
            if action.nargs != 0:
                allowed = tuple(str(choice) for choice in action.choices or ())
                value_flags.update(dict.fromkeys(action.option_strings, allowed))
        elif action.choices:
            choices.extend(str(choice) for choice in action.choices)
    yield Command(path, tuple(subparsers), tuple(flags), tuple(choices), value_flags)
    for name, sub in subparsers.items():
        yield from commands(sub, (*path, name))


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script for ``shell`` (one of ``SHELLS``) of ``parser``'s command."""
    tables = _tables(list(commands(parser)))
    if shell == "bash":
        return BASH.format(prog=parser.prog, function=FUNCTION, tables=tables)
    if shell == "zsh":
        return ZSH.format(prog=parser.prog, function=FUNCTION, tables=tables)
    raise ValueError(f"no completion for {shell!r}: one of {', '.join(SHELLS)}")


def _tables(found: list[Command]) -> str:
    """Shell functions (valid in bash and zsh) answering, for a command path, its words."""
    tables = {
        "commands": {command.path: command.subcommands for command in found},
        "words": {
            command.path: command.subcommands + command.positional_choices for command in found
        },
        "flags": {command.path: command.flags for command in found},
        "value_flags": {command.path: tuple(command.value_flags) for command in found},
        "choices": {
            (*command.path, flag): allowed
            for command in found
            for flag, allowed in command.value_flags.items()
            if allowed
        },
    }
    return "\n".join(_case(f"{FUNCTION}_{name}", table) for name, table in tables.items())


def _case(name: str, table: dict[tuple[str, ...], tuple[str, ...]]) -> str:
    """``name KEY`` prints, on one line, the words ``table`` holds for ``KEY`` (a path joined
    by spaces); the walk matches a word against `` LINE `` (no word has a space)."""
    arms = [
        f"        {shlex.quote(' '.join(key))}) printf '%s\\n' {shlex.quote(' '.join(words))} ;;"
        for key, words in table.items()
        if words
    ]
    return "\n".join([f"{name}() {{", '    case "$1" in', *arms, "    esac", "}"])


# The walk, shared: bash and zsh both run it (the cursor's word and those before it given).
_WALK = """\
    local cmdpath="" word flag="" prefix="" skip=0 i
    for ((i = 1; i < cword; i++)); do
        word=${{cwords[i]}}
        if ((skip)); then
            skip=0
            [[ $word == = ]] && skip=1  # --flag = value, split at '=' by bash
            continue
        fi
        if [[ $word == = ]]; then
            skip=1
        elif [[ $word == -* ]]; then
            [[ $word != *=* && " $({function}_value_flags "$cmdpath") " == *" $word "* ]] && skip=1
        elif [[ " $({function}_commands "$cmdpath") " == *" $word "* ]]; then
            cmdpath=${{cmdpath:+$cmdpath }}$word
        fi
    done
    if [[ $cur == = ]]; then
        flag=$prev
        cur=""
    elif [[ $prev == = ]]; then
        flag=${{cwords[cword - 2]}}
    elif [[ $cur == --*=* ]]; then
        flag=${{cur%%=*}}
        prefix=$flag=
        cur=${{cur#*=}}
    elif [[ -n $prev && " $({function}_value_flags "$cmdpath") " == *" $prev "* ]]; then
        flag=$prev
    fi"""

BASH = (
    """\
# bash completion for {prog}, generated by `{prog} completion bash` from its parser.
# Install: {prog} completion bash > /etc/bash_completion.d/{prog}
{tables}

{function}() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}} prev="" cword=$COMP_CWORD
    local -a cwords=("${{COMP_WORDS[@]}}")
    ((cword > 0)) && prev=${{COMP_WORDS[cword - 1]}}
"""
    + _WALK
    + """
    COMPREPLY=()
    if [[ -n $flag ]]; then
        local allowed
        allowed=$({function}_choices "${{cmdpath:+$cmdpath }}$flag")
        if [[ -n $allowed ]]; then
            COMPREPLY=($(compgen -P "$prefix" -W "$allowed" -- "$cur"))
        else
            compopt -o default 2>/dev/null  # a free value: file names
        fi
    elif [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$({function}_flags "$cmdpath")" -- "$cur"))
    else
        COMPREPLY=($(compgen -W "$({function}_words "$cmdpath")" -- "$cur"))
    fi
    return 0
}}

complete -F {function} {prog}
"""
)

ZSH = (
    """\
#compdef {prog}
# zsh completion for {prog}, generated by `{prog} completion zsh` from its parser.
# Install: {prog} completion zsh > "${{fpath[1]}}/_{prog}" (then compinit), or source it.
{tables}

{function}() {{
    emulate -L zsh
    local -a cwords=("${{words[@]}}")
    local cword=$((CURRENT - 1)) cur=${{words[CURRENT]}} prev=${{words[CURRENT-1]}}
    setopt ksh_arrays  # cwords indexed from 0 from here on, as bash's COMP_WORDS
"""
    + _WALK
    + """
    local -a found
    if [[ -n $flag ]]; then
        [[ ${{cwords[cword]}} == --*=* ]] && compset -P '*='  # complete after the '='
        found=($({function}_choices "${{cmdpath:+$cmdpath }}$flag"))
        if ((${{#found[@]}})); then
            compadd -- "${{found[@]}}"
        else
            _files
        fi
    elif [[ $cur == -* ]]; then
        found=($({function}_flags "$cmdpath"))
        compadd -- "${{found[@]}}"
    else
        found=($({function}_words "$cmdpath"))
        compadd -- "${{found[@]}}"
    fi
}}

if [[ ${{zsh_eval_context[-1]}} == loadautofunc ]]; then
    {function} "$@"
else
    compdef {function} {prog}
fi
"""
)
