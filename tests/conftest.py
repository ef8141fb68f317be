import os
import sys

# Tests run on CPU; mesh tests opt into 8 host devices themselves (subprocesses).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
