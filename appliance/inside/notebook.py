"""Notebook lines in cells, translated to plain Python before the cell is compiled. Pure:
text in, text out (runs inside the jail: standard library only).

    !cmd                 -> __appliance_magics__.shell('cmd')   a shell command in this jail
    !pip install x       -> __appliance_magics__.pip('install x')
    %pip install x       -> __appliance_magics__.pip('install x')
    %matplotlib inline   -> nothing (figures are always captured)
    %%bash / %%sh        -> the rest of the cell as one shell script

A line counts only where a statement may start (not inside a string or brackets), keeps its
indentation (`for f in files:` / `    !wc -l {f}` works as a loop body) and its line number
(a command continued with a trailing backslash leaves blank lines behind), so tracebacks
still point at the cell's own lines. The command text becomes a Python string literal
(`repr`), never code. An unknown magic is a SyntaxError naming the supported ones, raised
before anything of the cell runs.
"""

from __future__ import annotations

import io
import tokenize

HOOK = "__appliance_magics__"
SUPPORTED = (
    "`!cmd` (shell command), `%pip install pkg` or `!pip install pkg`, "
    "`%%bash` / `%%sh` (the cell as a shell script), `%matplotlib inline` (a no-op)"
)
_PIP_COMMANDS = ("pip", "pip3", "python -m pip", "python3 -m pip")
_NOOP_MAGICS = ("matplotlib",)
_SHELL_CELL_MAGICS = ("bash", "sh")


def has_magics(code: str) -> bool:
    """Whether any line could be a notebook line (the cheap test before translating)."""
    if "!" not in code and "%" not in code:  # most cells: one scan in C, no line split
        return False
    return any(line.lstrip()[:1] in ("!", "%") for line in code.splitlines())


def translate(code: str, filename: str = "<cell>") -> str:
    """The cell with its notebook lines turned into calls on HOOK; SyntaxError for an unknown magic."""
    if not has_magics(code):
        return code
    lines = code.splitlines(keepends=True)
    cell = _cell_magic(lines, filename)
    if cell is not None:
        return cell
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip(" \t")
        if stripped[:1] not in ("!", "%") or not _at_statement_start("".join(out)):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(stripped)]
        text = stripped.rstrip("\r\n")
        consumed = 1
        while text.endswith("\\") and i + consumed < len(lines):  # `!cmd a \` + next line
            text = text[:-1] + " " + lines[i + consumed].strip()
            consumed += 1
        call = _call(text, i + 1, filename, line)
        out.append(f"{indent}{call}\n" + "\n" * (consumed - 1))
        i += consumed
    return "".join(out)


def _cell_magic(lines: list[str], filename: str) -> str | None:
    first = next((n for n, line in enumerate(lines) if line.strip()), None)
    if first is None or not lines[first].lstrip().startswith("%%"):
        return None
    head = lines[first].strip()
    name, _, _args = head[2:].partition(" ")
    if name not in _SHELL_CELL_MAGICS:
        raise _unknown(head, first + 1, filename, lines[first])
    body = "".join(lines[first + 1 :])
    # One line for the whole cell: the script's own line numbers are the shell's business.
    return "\n" * first + f"{HOOK}.shell({body!r})\n"


def _call(text: str, lineno: int, filename: str, line: str) -> str:
    if text.startswith("!"):
        command = text[1:].strip()
        if not command:
            raise SyntaxError(
                "`!` needs a shell command after it, e.g. `!ls -l`", (filename, lineno, 1, line)
            )
        for pip in _PIP_COMMANDS:
            if command == pip or command.startswith(pip + " "):
                return f"{HOOK}.pip({command[len(pip) :].strip()!r})"
        return f"{HOOK}.shell({command!r})"
    name, _, rest = text[1:].partition(" ")
    if name in ("pip", "pip3"):
        return f"{HOOK}.pip({rest.strip()!r})"
    if name in _NOOP_MAGICS:
        return "pass"
    raise _unknown(text, lineno, filename, line)


def _unknown(text: str, lineno: int, filename: str, line: str) -> SyntaxError:
    word = text.split()[0] if text.split() else text
    return SyntaxError(
        f"unsupported magic {word}: the supported notebook lines are {SUPPORTED}", (filename, lineno, 1, line)
    )


def _at_statement_start(prefix: str) -> bool:
    """Whether the code before a line leaves it at the start of a statement: not inside a
    string, brackets, or a backslash continuation."""
    if not prefix.strip():
        return True
    if not prefix.endswith("\n"):
        prefix += "\n"
    try:
        for _token in tokenize.generate_tokens(io.StringIO(prefix).readline):
            pass
    except tokenize.TokenError:
        return False  # EOF inside a multi-line string or statement
    except (IndentationError, SyntaxError):
        return True  # the compiler will say what is wrong with the code before
    return True
