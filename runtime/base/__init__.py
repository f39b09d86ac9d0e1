"""The runtime's ground floor: what every process of a run shares, below the stage and the run.

The run directory's layout and its atomic files (``rundir``), a process's environment (``env``), process
limits and lines from a process's log (``processes``), how records become prompt text (``prompts``), and where
third-party warnings go (``warnings_log``: the run's or the plan's log, not the terminal).
Nothing here imports another runtime package (tests/unit/test_import_rules.py: floors).
"""
