# Tutor's file tools (SWE-agent style), one implementation for every sandbox.
#
# Installed into the sandbox (local or Docker) next to one tiny shim per tool; the shim
# runs `python3 tutor_tools.py TOOL ARGS...`. The viewer state (open file, first line of
# the window) lives in $TUTOR_STATE_DIR, so it persists across commands, and the current
# file is written to $TUTOR_STATE_DIR/current_file for the observation footer.
#
# Tools:
#   open FILE [LINE]            show FILE in a window of $TUTOR_WINDOW lines (around LINE)
#   goto LINE                   move the window of the open file to LINE
#   scroll_down / scroll_up     move the window by one window (two lines overlap)
#   create FILE                 create FILE (body from stdin, e.g. a here-document) and open it
#   edit START:END              replace lines START..END (1-based, inclusive) of the open file
#                               with stdin; END = START-1 inserts before START
#   replace SEARCH REPLACE [--replace-all]
#                               replace text in the open file (exactly one match unless
#                               --replace-all)
#   search_file TERM [FILE]     lines of FILE (default: the open file) containing TERM
#   search_dir TERM [DIR]       files under DIR (default .) containing TERM, with counts
#   find_file NAME [DIR]        files under DIR whose name matches NAME (shell pattern)
#
# Errors go to stdout with exit status 1 and change nothing.

import fnmatch
import json
import os
import sys

WINDOW = max(5, int(os.environ.get("TUTOR_WINDOW", "100") or 100))
OVERLAP = 2
MAX_MATCHES = 100
STATE_DIR = os.environ.get("TUTOR_STATE_DIR") or os.path.join(os.path.expanduser("~"), ".tutor")
REPO = os.environ.get("TUTOR_REPO", "")
REPO_DISPLAY = os.environ.get("TUTOR_REPO_DISPLAY", REPO)
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", "node_modules", ".tox", ".venv"}


class ToolError(Exception):
    pass


def display(path):
    """How a path is shown: under the repository as REPO_DISPLAY/rel, else absolute."""
    path = os.path.abspath(path)
    if REPO:
        root = os.path.abspath(REPO)
        if path == root:
            return REPO_DISPLAY
        if path.startswith(root + os.sep):
            return REPO_DISPLAY + "/" + os.path.relpath(path, root)
    return path


def load_state():
    try:
        with open(os.path.join(STATE_DIR, "viewer.json"), encoding="utf-8") as f:
            st = json.load(f)
        if isinstance(st, dict) and isinstance(st.get("file"), str):
            return st
    except (OSError, ValueError):
        pass
    return {}


def save_state(path, first):
    os.makedirs(STATE_DIR, exist_ok=True)
    tmp = os.path.join(STATE_DIR, "viewer.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"file": os.path.abspath(path), "first": first}, f)
    os.replace(tmp, os.path.join(STATE_DIR, "viewer.json"))
    with open(os.path.join(STATE_DIR, "current_file"), "w", encoding="utf-8") as f:
        f.write(display(path))


def read_text(path):
    if not os.path.exists(path):
        raise ToolError(f"File {path} not found")
    if os.path.isdir(path):
        raise ToolError(f"{path} is a directory. You can only open files. Use cd or ls to navigate directories.")
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data[:8192]:
        raise ToolError(f"{path} looks like a binary file; it cannot be shown or edited here.")
    return data.decode("utf-8", errors="replace")


def split(text):
    """Lines without their newline, and whether the text ended with one."""
    if text == "":
        return [], False
    trailing = text.endswith("\n")
    lines = text.split("\n")
    if trailing:
        lines.pop()
    return lines, trailing


def join(lines, trailing):
    if not lines:
        return ""
    return "\n".join(lines) + ("\n" if trailing else "")


def write_text(path, text):
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def current_file():
    st = load_state()
    path = st.get("file")
    if not path:
        raise ToolError("No file open. Use the open command first.")
    if not os.path.isfile(path):
        raise ToolError(f"The open file {display(path)} no longer exists. Open another file.")
    return path, int(st.get("first", 1) or 1)


def clamp_first(first, total, full):
    """A window start in range; with `full`, one that shows a whole window where the
    file is long enough (open, goto), else any line (scrolling keeps continuity)."""
    last_start = max(1, total - WINDOW + 1) if full else max(1, total)
    return max(1, min(first, last_start))


def show(path, first, full=True):
    lines, _ = split(read_text(path))
    total = len(lines)
    first = clamp_first(first, total, full)
    save_state(path, first)
    end = min(total, first + WINDOW - 1)
    out = [f"[File: {display(path)} ({total} lines total)]"]
    if first > 1:
        out.append(f"({first - 1} more lines above)")
    for i in range(first, end + 1):
        out.append(f"{i}:{lines[i - 1].rstrip(chr(13))}")
    if total == 0:
        out.append("(the file is empty)")
    if end < total:
        out.append(f"({total - end} more lines below)")
    print("\n".join(out))


SNIPPET = 4


def show_snippet(path, line, count):
    """After a replacement: the changed lines with SNIPPET lines either side (as
    SWE-agent's editor shows a snippet, not the whole window); the window moves there."""
    lines, _ = split(read_text(path))
    total = len(lines)
    save_state(path, clamp_first(centered(line), total, True))
    lo = max(1, line - SNIPPET)
    hi = min(total, line + max(1, count) - 1 + SNIPPET)
    out = [f"[File: {display(path)} ({total} lines total), lines {lo}-{hi} after the change]"]
    for i in range(lo, hi + 1):
        out.append(f"{i}:{lines[i - 1].rstrip(chr(13))}")
    print("\n".join(out))


def centered(line):
    return line - WINDOW // 2


def parse_line(s, what="line number"):
    try:
        n = int(s)
    except ValueError:
        raise ToolError(f"{what} must be an integer, got {s!r}")
    return n


def syntax_error(path, text):
    """The SyntaxError message for Python source, or None."""
    if not path.endswith(".py"):
        return None
    try:
        compile(text, path, "exec", dont_inherit=True)
    except SyntaxError as e:
        return f"{e.msg} (line {e.lineno})"
    except ValueError as e:  # null bytes
        return str(e)
    return None


def guarded_write(path, old, new, around):
    """Writes `new` unless it breaks Python syntax that `old` had right."""
    err = syntax_error(path, new)
    if err is not None and syntax_error(path, old) is None:
        lines, _ = split(new)
        lo = max(1, around - 5)
        hi = min(len(lines), around + 10)
        preview = "\n".join(f"{i}:{lines[i - 1]}" for i in range(lo, hi + 1))
        raise ToolError(
            "Your edit was not applied: it would introduce a syntax error: "
            f"{err}.\nThis is how the edited region would have looked:\n{preview}\n"
            "Fix the edit (check indentation and brackets) and try again."
        )
    write_text(path, new)


def stdin_text():
    if sys.stdin is None or sys.stdin.isatty():
        return ""
    return sys.stdin.read()


def cmd_open(args):
    if not args or len(args) > 2:
        raise ToolError("Usage: open FILE [LINE]")
    path = args[0]
    if len(args) == 2:
        line = parse_line(args[1])
        lines, _ = split(read_text(path))
        if line < 1 or line > max(1, len(lines)):
            raise ToolError(f"Line {line} is out of range: {display(path)} has {len(lines)} lines.")
        show(path, centered(line))
    else:
        read_text(path)
        show(path, 1)


def cmd_goto(args):
    if len(args) != 1:
        raise ToolError("Usage: goto LINE")
    path, _ = current_file()
    line = parse_line(args[0])
    lines, _ = split(read_text(path))
    if line < 1 or line > max(1, len(lines)):
        raise ToolError(f"Line {line} is out of range: {display(path)} has {len(lines)} lines.")
    show(path, centered(line))


def cmd_scroll(args, direction):
    if args:
        raise ToolError(f"Usage: scroll_{'down' if direction > 0 else 'up'} (no arguments)")
    path, first = current_file()
    lines, _ = split(read_text(path))
    total = len(lines)
    if direction > 0 and first + WINDOW - 1 >= total:
        print("Already at the end of the file.")
        show(path, first, full=False)
        return
    if direction < 0 and first <= 1:
        print("Already at the start of the file.")
    show(path, first + direction * (WINDOW - OVERLAP), full=False)


def cmd_create(args):
    if len(args) != 1:
        raise ToolError("Usage: create FILE (the content may follow as a here-document)")
    path = args[0]
    if os.path.exists(path):
        raise ToolError(f"File {path} already exists. Use open and edit to change it.")
    body = stdin_text()
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    write_text(path, body)
    show(path, 1)


def cmd_edit(args):
    if len(args) != 1 or ":" not in args[0]:
        raise ToolError(
            "Usage: edit START:END with the new lines as a here-document, for example\n"
            "edit 10:12 <<'EOF'\n    return x + 1\nEOF"
        )
    a, b = args[0].split(":", 1)
    start, end = parse_line(a, "START"), parse_line(b, "END")
    path, _ = current_file()
    old = read_text(path)
    lines, trailing = split(old)
    if start < 1 or start > len(lines) + 1:
        raise ToolError(f"START {start} is out of range: {display(path)} has {len(lines)} lines.")
    if end < start - 1 or end > len(lines):
        raise ToolError(
            f"END {end} is out of range: it must be between START-1 ({start - 1}, to insert) "
            f"and the last line ({len(lines)})."
        )
    new_lines, _ = split(stdin_text())
    merged = lines[: start - 1] + new_lines + lines[end:]
    guarded_write(path, old, join(merged, trailing or not lines), start)
    show(path, centered(start + len(new_lines) // 2))


def cmd_replace(args):
    replace_all = "--replace-all" in args
    rest = [a for a in args if a != "--replace-all"]
    if len(rest) != 2:
        raise ToolError("Usage: replace SEARCH REPLACE [--replace-all] (quote each argument)")
    search, repl = rest
    if search == "":
        raise ToolError("SEARCH must not be empty.")
    path, _ = current_file()
    old = read_text(path)
    count = old.count(search)
    if count == 0:
        raise ToolError(f"No replacement was made: the search text does not occur in {display(path)}.")
    if count > 1 and not replace_all:
        starts, pos = [], old.find(search)
        while pos != -1 and len(starts) < 20:
            starts.append(old.count("\n", 0, pos) + 1)
            pos = old.find(search, pos + 1)
        raise ToolError(
            f"No replacement was made: the search text occurs {count} times in {display(path)} "
            f"(lines {', '.join(map(str, starts))}). Make it unique or add --replace-all."
        )
    first_line = old.count("\n", 0, old.find(search)) + 1
    new = old.replace(search, repl) if replace_all else old.replace(search, repl, 1)
    guarded_write(path, old, new, first_line)
    print(f"Replaced {count if replace_all else 1} occurrence(s).")
    if replace_all and count > 1:
        show(path, centered(first_line))
    else:
        show_snippet(path, first_line, repl.count("\n") + 1)


def cmd_search_file(args):
    if not args or len(args) > 2:
        raise ToolError("Usage: search_file TERM [FILE]")
    term = args[0]
    path = args[1] if len(args) == 2 else current_file()[0]
    lines, _ = split(read_text(path))
    hits = [(i + 1, l) for i, l in enumerate(lines) if term in l]
    if not hits:
        print(f'No matches found for "{term}" in {display(path)}')
        return
    if len(hits) > MAX_MATCHES:
        raise ToolError(f'More than {MAX_MATCHES} lines matched for "{term}" in {display(path)}. Narrow your search.')
    print(f'Found {len(hits)} matches for "{term}" in {display(path)}:')
    for n, l in hits:
        print(f"Line {n}:{l.rstrip(chr(13))}")
    print(f'End of matches for "{term}" in {display(path)}')


def walk(root):
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        for f in sorted(files):
            yield os.path.join(d, f)


def cmd_search_dir(args):
    if not args or len(args) > 2:
        raise ToolError("Usage: search_dir TERM [DIR]")
    term, root = args[0], (args[1] if len(args) == 2 else ".")
    if not os.path.isdir(root):
        raise ToolError(f"Directory {root} not found")
    found = []
    for p in walk(root):
        try:
            with open(p, "rb") as f:
                data = f.read(4 << 20)
        except OSError:
            continue
        if b"\0" in data[:8192]:
            continue
        n = data.decode("utf-8", errors="replace").count(term)
        if n:
            found.append((p, n))
    if not found:
        print(f'No matches found for "{term}" in {display(root)}')
        return
    if len(found) > MAX_MATCHES:
        raise ToolError(f'More than {MAX_MATCHES} files matched for "{term}" in {display(root)}. Narrow your search.')
    print(f'Found {sum(n for _, n in found)} matches for "{term}" in {display(root)}:')
    for p, n in found:
        print(f"{display(p)} ({n} matches)")
    print(f'End of matches for "{term}" in {display(root)}')


def cmd_find_file(args):
    if not args or len(args) > 2:
        raise ToolError("Usage: find_file NAME [DIR]")
    name, root = args[0], (args[1] if len(args) == 2 else ".")
    if not os.path.isdir(root):
        raise ToolError(f"Directory {root} not found")
    found = [p for p in walk(root) if fnmatch.fnmatch(os.path.basename(p), name)]
    if not found:
        print(f'No matches found for "{name}" in {display(root)}')
        return
    print(f'Found {len(found)} matches for "{name}" in {display(root)}:')
    for p in found[:MAX_MATCHES]:
        print(display(p))
    if len(found) > MAX_MATCHES:
        print(f"({len(found) - MAX_MATCHES} more not shown)")


TOOLS = {
    "open": cmd_open,
    "goto": cmd_goto,
    "scroll_down": lambda a: cmd_scroll(a, 1),
    "scroll_up": lambda a: cmd_scroll(a, -1),
    "create": cmd_create,
    "edit": cmd_edit,
    "replace": cmd_replace,
    "search_file": cmd_search_file,
    "search_dir": cmd_search_dir,
    "find_file": cmd_find_file,
}


def main(argv):
    if len(argv) < 2 or argv[1] not in TOOLS:
        print(f"unknown tool; available: {', '.join(sorted(TOOLS))}")
        return 2
    try:
        TOOLS[argv[1]](argv[2:])
    except ToolError as e:
        print(e)
        return 1
    except OSError as e:
        print(f"{argv[1]}: {e.strerror or e}: {e.filename or ''}".rstrip(": "))
        return 1
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
