#!/usr/bin/env python3
"""Regenerates the generated parts of benches/RESULTS.md from the raw rounds kept in
benches/results/; with --check, changes nothing and fails if a part differs from what its
rounds give.

    python3 benches/baselines/regenerate.py [--check]

A generated part sits between two comments. The first names a script of
benches/baselines/ and its arguments, paths relative to benches/ (globs expanded, in
order); the script's output is the part:

    <!-- generated: every_row_table.py results/every-row/round-*.txt -->
    ...
    <!-- end generated -->

With "> PATH" after the arguments the output goes to that file instead (a plot), and the
lines between the comments are left as they are.
"""

import glob
import os
import re
import subprocess
import sys

BENCHES = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DOCUMENT = os.path.join(BENCHES, "RESULTS.md")
PART = re.compile(r"(<!-- generated: (.+?) -->\n)(.*?)(<!-- end generated -->)", re.S)


def output(command):
    """The output of `command` (a script of baselines/ and its arguments), and the file it
    goes to (None: the document)."""
    words = command.split()
    target = None
    if ">" in words:
        at = words.index(">")
        words, target = words[:at], words[at + 1]
    args = []
    for word in words[1:]:
        found = sorted(glob.glob(os.path.join(BENCHES, word)))
        if any(ch in word for ch in "*?[") and not found:
            sys.exit(f"regenerate.py: no file matches {word} (in {command!r})")
        args.extend(found or [word])
    script = os.path.join(BENCHES, "baselines", words[0])
    text = subprocess.run([sys.executable, script, *args], check=True, capture_output=True,
                          text=True, cwd=BENCHES).stdout
    return text, target and os.path.join(BENCHES, target)


def main(argv):
    check = argv == ["--check"]
    if argv and not check:
        sys.exit(__doc__)
    with open(DOCUMENT) as f:
        document = f.read()
    stale = []

    def regenerate(m):
        opening, command, old, closing = m.groups()
        text, target = output(command)
        if target is None:
            if text != old:
                stale.append(command)
            return opening + text + closing
        current = open(target).read() if os.path.exists(target) else None
        if text != current:
            stale.append(f"{command} (its file)")
            if not check:
                with open(target, "w") as f:
                    f.write(text)
        return m.group(0)

    updated = PART.sub(regenerate, document)
    if check:
        if stale:
            sys.exit("benches/RESULTS.md is not what its rounds give; run "
                     "benches/baselines/regenerate.py for: " + "; ".join(stale))
        return
    if updated != document:
        with open(DOCUMENT, "w") as f:
            f.write(updated)
    print(f"regenerated {len(stale)} part(s)" + (": " + "; ".join(stale) if stale else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
