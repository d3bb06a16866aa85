import os
import sys
from pathlib import Path

# the cases module sits beside the benchmarks, as upstream's benchmarks do
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RL_WARNINGS", "0")
