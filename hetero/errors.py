"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""

from __future__ import annotations


class HeteroError(Exception):
    """Base class: the message must say what is wrong and what to do about it."""


class ConfigError(HeteroError):
    """A config, fleet or model declaration is malformed or inconsistent."""


class UnknownDeviceError(ConfigError):
    """A fleet names a device type that hardware_specs/ does not describe."""


class UnsupportedModelError(HeteroError):
    """The model's architecture is not one the compiler can trace."""


class InfeasiblePlanError(HeteroError):
    """No placement fits the fleet's memory (the message gives the numbers)."""


class PlanError(HeteroError):
    """A plan file is malformed, from another version, or from another fleet."""


class WireError(HeteroError):
    """A message from a peer is malformed, from another plan, or from another wire version."""


class CheckpointError(HeteroError):
    """A checkpoint or adapter on disk is missing, malformed, or does not match the plan."""


class TrainingDivergedError(HeteroError):
    """Training produced NaN or inf values (the message names the stage, step and what to change)."""
