#!/usr/bin/env python3
"""Fails when two source files of one crate import each other (directly or round a longer
circle). Part of `make test` (docs/architecture.md, "Rules").

A file's module is its path (`src/a/b.rs` and `src/a/b/mod.rs` are `crate::a::b`). An edge
a -> b is any `crate::`, `super::` or `self::` path in a's code (test modules and
comments left out) that names b or something in b. A parent's `mod child;` and its
`pub use child::...` re-exports are its facade, not a use of the child, so they make no
edge; anything else a parent takes from a child does.

Usage: check-module-cycles.py [CRATE_DIR...] (default: the workspace members in this folder)
"""
import os
import re
import sys


def module_of(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("lib", "main") and len(rel) == 1:
        return ()
    if rel[-1] == "mod":
        rel = rel[:-1]
    return tuple(rel)


def strip(text):
    # Comments and string literals out; the first `#[cfg(test)]` module and what follows it.
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'r#*"(?:.|\n)*?"#*', '""', text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    m = re.search(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", text)
    if m:
        text = text[: m.start()]
    return text


def use_paths(tree, prefix=""):
    """Expands `a::{b, c::{d, e}}` into full paths."""
    tree = tree.strip()
    depth, start, parts = 0, 0, []
    brace = tree.find("{")
    if brace == -1:
        return [prefix + re.split(r"\s+as\s+", tree)[0].strip()]
    head, inner = tree[:brace], tree[brace + 1 : tree.rfind("}")]
    for i, ch in enumerate(inner):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    out = []
    for p in parts:
        if p.strip():
            out += use_paths(p, prefix + head)
    return out


def resolve(path, here, modules):
    segs = [s for s in path.split("::") if s]
    if not segs:
        return None
    if segs[0] == "crate":
        cur, segs = (), segs[1:]
    elif segs[0] == "self":
        cur, segs = here, segs[1:]
    elif segs[0] == "super":
        cur = here
        while segs and segs[0] == "super":
            cur, segs = cur[:-1], segs[1:]
    else:
        return None
    best = cur if cur in modules else None
    for s in segs:
        cur = cur + (s,)
        if cur in modules:
            best = cur
        else:
            break
    return best


def check(crate):
    src = os.path.join(crate, "src")
    files = {}
    for root, _, names in os.walk(src):
        for n in names:
            if n.endswith(".rs"):
                p = os.path.join(root, n)
                files[module_of(src, p)] = p
    modules = set(files)
    edges = {m: set() for m in modules}
    for m, p in files.items():
        is_dir = os.path.basename(p) in ("mod.rs", "lib.rs", "main.rs")
        text = strip(open(p, encoding="utf-8").read())
        found = []
        for stmt in re.finditer(r"\b(pub(\([^)]*\))?\s+)?use\s+([^;]+);", text):
            public = bool(stmt.group(1))
            for path in use_paths(stmt.group(3)):
                path = path.strip()
                first = path.split("::")[0]
                if is_dir and m + (first,) in modules:
                    path = "self::" + path
                found.append((path, public))
        body = re.sub(r"\b(pub(\([^)]*\))?\s+)?use\s+[^;]+;", "", text)
        for ref in re.finditer(r"\b((?:crate|super|self)(?:::\w+)+)", body):
            found.append((ref.group(1), False))
        if is_dir:
            # A directory module names its children without `self::`.
            for ref in re.finditer(r"(?<![:\w])(\w+)::", body):
                if m + (ref.group(1),) in modules:
                    found.append(("self::" + ref.group(1), False))
        for path, public in found:
            target = resolve(path, m, modules)
            if target is None or target == m:
                continue
            child = target[:-1] == m or (target[: len(m)] == m and len(target) > len(m))
            if public and child:
                continue  # a facade's re-export
            edges[m].add(target)
    # Cycles: Tarjan's strongly connected components.
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(modules):
        if v not in index:
            visit(v)
    problems = []
    for comp in out:
        names = sorted(os.path.relpath(files[c], crate) for c in comp)
        pairs = sorted(
            f"{os.path.relpath(files[a], crate)} -> {os.path.relpath(files[b], crate)}"
            for a in comp
            for b in edges[a]
            if b in comp
        )
        problems.append(f"{crate}: these files import each other: {', '.join(names)}\n    " + "\n    ".join(pairs))
    return problems


def main():
    crates = sys.argv[1:]
    if not crates:
        import tomllib

        crates = tomllib.load(open("Cargo.toml", "rb"))["workspace"]["members"]
    problems = [p for c in crates for p in check(c)]
    for p in problems:
        print(p)
    if problems:
        print(
            "module cycles: move what both sides need into a module of its own "
            "(docs/architecture.md, Rules)"
        )
        return 1
    print(f"module cycles: none in {len(crates)} crates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
