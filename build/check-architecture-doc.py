#!/usr/bin/env python3
"""Fails when docs/architecture.md no longer matches the code. Part of `make test`.

- The table under "## Crates" (columns: crate, folder, uses at run time) must list every
  workspace member, in its folder, with exactly the workspace crates its
  `[dependencies]` name: the doc is the crate graph, so a new edge is a change to it.
- No service crate (rollout-worker, coordinator, learner) may use another at run time.
- Every file or folder the page names in backticks (`coordinator/src/store.rs`,
  `rollout-worker/src/sandbox/`) must exist.
"""
import os
import re
import sys
import tomllib

DOC = "docs/architecture.md"
SERVICES = {"tutor-rollout-worker", "tutor-coordinator", "tutor-learner"}


def workspace():
    root = tomllib.load(open("Cargo.toml", "rb"))
    crates = {}
    for folder in root["workspace"]["members"]:
        m = tomllib.load(open(os.path.join(folder, "Cargo.toml"), "rb"))
        name = m["package"]["name"]
        deps = {
            d
            for d, spec in m.get("dependencies", {}).items()
            if d.startswith("tutor")
        }
        crates[name] = (folder, deps)
    return crates


def doc_table(text):
    section = re.search(r"^## Crates\s*$(.*?)(?=^## )", text, flags=re.M | re.S)
    if not section:
        return None
    rows = {}
    for line in section.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`tutor"):
            continue
        name = cells[0].strip("`")
        folder = cells[1].strip("`").rstrip("/")
        uses = set(re.findall(r"`(tutor[\w-]*)`", cells[2]))
        rows[name] = (folder, uses)
    return rows


def main():
    if not os.path.exists(DOC):
        print(f"{DOC} is missing")
        return 1
    text = open(DOC, encoding="utf-8").read()
    problems = []
    crates = workspace()
    table = doc_table(text)
    if table is None:
        problems.append(f'{DOC}: no "## Crates" table')
        table = {}
    for name, (folder, deps) in sorted(crates.items()):
        if name not in table:
            problems.append(f"{DOC}: the Crates table lacks {name} ({folder}/)")
            continue
        dfolder, duses = table[name]
        if dfolder != folder:
            problems.append(f"{DOC}: {name} is in {folder}/, the table says {dfolder}/")
        if duses != deps:
            problems.append(
                f"{DOC}: {name} uses {sorted(deps) or 'no tutor crate'} at run time "
                f"({folder}/Cargo.toml), the table says {sorted(duses) or 'none'}"
            )
        if name in SERVICES and deps & (SERVICES - {name}):
            problems.append(
                f"{folder}/Cargo.toml: the service crate {name} uses the service crate(s) "
                f"{sorted(deps & SERVICES)} at run time; move what both need into a lower crate"
            )
    for name in table:
        if name not in crates:
            problems.append(f"{DOC}: the Crates table names {name}, which is no workspace member")
    for path in sorted(set(re.findall(r"`([\w.-]+/[\w./-]*)`", text))):
        if path.endswith(("/", ".rs", ".toml", ".md", ".py", ".proto", ".sh")):
            if not os.path.exists(path.split(":")[0]):
                problems.append(f"{DOC} names `{path}`, which does not exist")
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"{DOC}: matches the {len(crates)} crates and every path it names")
    return 0


if __name__ == "__main__":
    sys.exit(main())
