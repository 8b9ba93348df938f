"""Lists the tests of torch's distributed suite that one backend passes and another does not.

    python tools/torch_suite/compare.py gloo.json chorus.json
    python tools/torch_suite/compare.py tools/torch_suite/gloo-passes-2.15.txt chorus.json

The reference is run.py's output, or a list of the tests it passed (Gloo's, recorded here: a
first line "# BACKEND on torch VERSION: ...", then one name a line). Exits non-zero if any test the first passes fails on the second, or is skipped there without
being gated to the first backend by name (gated tests are listed apart).
"""

import json
import re
import sys


def load(path):
    """run.py's output, or a list of passed tests read as one."""
    with open(path) as f:
        if not path.endswith(".txt"):
            return json.load(f)
        header, *names = f.read().splitlines()
        backend, version = re.match(r"# (\S+) on torch (\S+):", header).groups()
        return {"backend": backend, "torch": version, "outcomes": {n: "pass" for n in names if n}}


def main(reference, candidate):
    ref, cand = load(reference), load(candidate)
    name = ref["backend"]
    # A skip whose reason names the reference backend is torch gating the test to it by name.
    gated = re.compile(re.escape(name), re.IGNORECASE)
    missing, skipped_by_name = [], []
    for test, outcome in sorted(ref["outcomes"].items()):
        if outcome != "pass":
            continue
        theirs = cand["outcomes"].get(test, "not run")
        if theirs == "pass":
            continue
        if theirs.startswith("skip") and gated.search(theirs):
            skipped_by_name.append((test, theirs))
        else:
            missing.append((test, theirs))
    passed = sum(v == "pass" for v in ref["outcomes"].values())
    print(f"{name} (torch {ref['torch']}) passes {passed}; {cand['backend']} (torch {cand['torch']}) "
          f"misses {len(missing)} of them, {len(skipped_by_name)} more skipped as written for {name}")
    for test, why in skipped_by_name:
        print(f"  gated: {test}: {why.splitlines()[0][:160]}")
    for test, why in missing:
        print(f"  MISSING: {test}: {why.strip().splitlines()[-1][:200] if why.strip() else why}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
