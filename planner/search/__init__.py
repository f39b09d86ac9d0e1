"""The placement searches: the exact DP, the ILP, the simulated search with its bounds, the deadline they
share, and interleaving. Imports model/ and schedule/."""
