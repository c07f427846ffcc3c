#!/usr/bin/env python3
"""Fails when a workspace crate declares a dependency its code never names. Part of
`make test` (docs/architecture.md, "Rules"); the same test cargo-machete makes, without
a tool to install.

For each member of the workspace in the current folder: a `[dependencies]` entry must be
named (`name::`, `use name`, `name!`, `extern crate name`, with `-` read as `_`) in some
`.rs` file of the crate; a `[dev-dependencies]` entry likewise (tests, benches, examples,
src); a `[build-dependencies]` entry in the build script. A dependency that is needed
though never named (a `links` crate whose build script passes the linker what it needs,
a crate pulled in only to turn a feature on) is listed, with the reason, in the crate's
Cargo.toml:

    [package.metadata.cargo-machete]
    ignored = ["torch-sys"]  # why, in a comment
"""
import os
import re
import sys
import tomllib


def rs_files(folder):
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if d not in ("target", ".git")]
        for n in names:
            if n.endswith(".rs"):
                yield os.path.join(root, n)


def named(ident, texts):
    pat = re.compile(
        rf"(\b{ident}::|\buse\s+{ident}\b|\bextern\s+crate\s+{ident}\b|\b{ident}!)"
    )
    return any(pat.search(t) for t in texts)


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def check(crate):
    manifest = tomllib.load(open(os.path.join(crate, "Cargo.toml"), "rb"))
    package = manifest.get("package", {})
    ignored = set(
        package.get("metadata", {}).get("cargo-machete", {}).get("ignored", [])
    )
    build = package.get("build")
    if build is None and os.path.exists(os.path.join(crate, "build.rs")):
        build = "build.rs"
    build_text = []
    if isinstance(build, str):
        build_text = [strip_comments(open(os.path.join(crate, build)).read())]
    all_text = [strip_comments(open(p).read()) for p in rs_files(crate)]
    problems = []
    for section, texts in (
        ("dependencies", all_text),
        ("dev-dependencies", all_text),
        ("build-dependencies", build_text),
    ):
        for name in manifest.get(section, {}):
            if name in ignored:
                continue
            # Code names a dependency by its key (also when `package =` renames it).
            if not named(name.replace("-", "_"), texts):
                problems.append(
                    f"{crate}/Cargo.toml: [{section}] {name} is never used by the crate's code: "
                    f"remove it (or, if it is needed all the same, list it under "
                    f"[package.metadata.cargo-machete] ignored, saying why)"
                )
    return problems


def main():
    root = tomllib.load(open("Cargo.toml", "rb"))
    members = root.get("workspace", {}).get("members", [])
    problems = [p for m in members for p in check(m)]
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"unused dependencies: none in {len(members)} crates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
