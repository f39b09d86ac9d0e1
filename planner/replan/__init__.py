"""Plans made again from a run: what-ifs (`hetero simulate`), rebalancing a running pipeline, and recovery
from a lost device. The top wing: it calls ``plan()`` (planner/compose.py)."""
