"""The coordinator: the I/O-free core (rules) and the broker service around it."""

from qlm.coordinator.core import CoordinatorCore, TrackedRequest, TrackState

__all__ = ["CoordinatorCore", "TrackState", "TrackedRequest"]
