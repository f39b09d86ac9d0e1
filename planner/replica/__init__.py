"""Data-parallel pipeline replicas: how the fleet packs into replicas, their bounds, fronts, plans and the
choice between them. Imports search/, model/ and schedule/."""
