"""Runs torch's own distributed suite (`DistributedTest._DistTestBase`, shipped with torch)
against one backend and writes each test's outcome to a JSON file.

    python tools/torch_suite/run.py --backend chorus --out chorus.json [-k PATTERN] [--features ddp,subgroup]
    python tools/torch_suite/run.py --backend gloo --out gloo.json
    python tools/torch_suite/compare.py gloo.json chorus.json
    python tools/torch_suite/run.py --backend chorus --out ci.json --tests "$(cat tools/torch_suite/ci-subset.txt)" --strict

The chorus backend is imported from `chorus_torch` (installed, or on PYTHONPATH). Each test
spawns WORLD_SIZE processes, as torch's own test_distributed_spawn.py does. torch's feature
sets name only its own backends; `--features` declares the backend in those it implements
(DDP and sub-groups by default), so their tests run instead of skipping.
"""

import argparse
import json
import os
import sys
import tempfile
import unittest


def _arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("-k", dest="pattern", default=None, help="run only tests whose name holds this")
    parser.add_argument("--tests", default=None,
                        help="run only these tests, named in full (separated by commas or white space)")
    parser.add_argument("--strict", action="store_true", help="exit non-zero unless every test run passes")
    parser.add_argument("--features", default="ddp,subgroup",
                        help="the suite's feature sets to declare the backend in (torch lists only its own "
                             "backends there), comma-separated; empty for none")
    return parser.parse_args()


# Spawned ranks import this file again: the environment must be set before torch's suite is
# imported, in the parent and in every rank.
if __name__ == "__main__":
    _ARGS = _arguments()
    os.environ["BACKEND"] = _ARGS.backend
    os.environ["CHORUS_SUITE_FEATURES"] = _ARGS.features
    os.environ["WORLD_SIZE"] = str(_ARGS.world_size)
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="chorus-torch-suite-"))
    os.makedirs(os.path.join(os.environ["TEMP_DIR"], "barrier"), exist_ok=True)

import torch  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

if os.environ.get("BACKEND") == "chorus":
    import chorus_torch  # noqa: F401,E402  (registers the backend, in every rank)

# What the backend implements, declared before the suite's skip conditions are evaluated.
for _feature in filter(None, os.environ.get("CHORUS_SUITE_FEATURES", "").split(",")):
    DistTestCases.backend_feature[_feature].add(os.environ["BACKEND"])

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


class TestSuite(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


class _Record(unittest.TextTestResult):
    """Keeps each test's outcome by name."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes = {}

    def _name(self, test):
        return test.id().rsplit(".", 1)[-1]

    def addSuccess(self, test):
        super().addSuccess(test)
        self.outcomes[self._name(test)] = "pass"

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.outcomes[self._name(test)] = "fail: " + self._exc_info_to_string(err, test)[-2000:]

    def addError(self, test, err):
        super().addError(test, err)
        self.outcomes[self._name(test)] = "error: " + self._exc_info_to_string(err, test)[-2000:]

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.outcomes[self._name(test)] = "skip: " + str(reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self.outcomes[self._name(test)] = "expected failure"

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self.outcomes[self._name(test)] = "unexpected success"


def main():
    loader = unittest.TestLoader()
    if _ARGS.pattern:
        loader.testNamePatterns = [f"*{_ARGS.pattern}*"]
    if _ARGS.tests:
        loader.testNamePatterns = [f"*.{name}" for name in _ARGS.tests.replace(",", " ").split()]
    suite = loader.loadTestsFromTestCase(TestSuite)
    runner = unittest.TextTestRunner(resultclass=_Record, verbosity=1, stream=sys.stderr)
    result = runner.run(suite)
    with open(_ARGS.out, "w") as f:
        json.dump({"torch": torch.__version__, "backend": _ARGS.backend, "outcomes": result.outcomes}, f, indent=1,
                  sort_keys=True)
    print(f"{_ARGS.backend} on torch {torch.__version__}: "
          f"{sum(v == 'pass' for v in result.outcomes.values())} passed, "
          f"{sum(v.startswith(('fail', 'error')) for v in result.outcomes.values())} failed, "
          f"{sum(v.startswith('skip') for v in result.outcomes.values())} skipped")
    if _ARGS.strict:
        failed = sorted(name for name, outcome in result.outcomes.items() if outcome != "pass")
        if failed or not result.outcomes:
            print(f"not passed: {', '.join(failed) or 'no test ran'}")
            sys.exit(1)


if __name__ == "__main__":
    main()
