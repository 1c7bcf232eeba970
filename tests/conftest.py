import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
# one TVM thread per test process (pytest -n 2 runs two): autoq would otherwise size each
# pool to every physical core (autoq.threads); tests check results, not speed
os.environ.setdefault("TVM_NUM_THREADS", "1")
