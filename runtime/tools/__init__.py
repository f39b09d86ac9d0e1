"""Tools beside a run: profiling devices, evaluating, generating, exporting, comparing a run with its plan."""
