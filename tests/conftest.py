import sys
from pathlib import Path

# Make `from launch import torchrun` work from any test sub-folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))
