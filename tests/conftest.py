import os
import sys
from pathlib import Path

import pytest

from shardfit.launcher import FORBID_ENV

# Make `from launch import torchrun` work from any test sub-folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test not marked `multirank` may not start torchrun: the one launcher (shardfit/launcher.py)
    refuses while this variable is set, in this process and in every CLI subprocess it starts. Set
    before the test's fixtures, so a module fixture that launches is caught too."""
    if item.get_closest_marker("multirank") is None:
        os.environ[FORBID_ENV] = item.nodeid
    else:
        os.environ.pop(FORBID_ENV, None)
