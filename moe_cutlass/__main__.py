"""python -m moe_cutlass: the environment report (moe_cutlass/env.py)."""
import sys

from .env import main

sys.exit(main())
