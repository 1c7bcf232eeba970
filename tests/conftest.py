import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
# one TVM thread per test process (pytest -n 2 runs two): autoq would otherwise size each
# pool to every physical core (autoq.threads); tests check results, not speed
os.environ.setdefault("TVM_NUM_THREADS", "1")
# the compile cache (autoq.ir.compile_cache) in a folder of this test process, removed at
# its end: tests run the cached path as users do, never read or fill ~/.cache
if "AUTOQ_COMPILE_CACHE" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="autoq-test-compiled-")
    os.environ["AUTOQ_COMPILE_CACHE"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """The MetaSchedule tests (tests/test_tune.py, the suite's longest: 25-100 s each on 2
    cores) run first, so that under ``pytest -n 2`` no worker is left running them alone
    at the end while the other one idles (they sorted last by file name)."""
    items.sort(key=lambda item: item.path.name != "test_tune.py")
