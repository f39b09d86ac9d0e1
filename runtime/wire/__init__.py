"""The wire: frames, the authenticated transport, what each process accepts, heartbeats and liveness."""
