"""The trainer's components whose state a checkpoint carries, each registered once by name.

Saving and resuming walk the same registry, so a component added to the trainer is saved and
restored by registering it, not by a line in `save` and another in `_resume` (which, written by
hand, drift apart). A name a checkpoint lacks (one written before its component existed) leaves
the component as built.
"""

from __future__ import annotations


class SavedState:
    """Named components with `state_dict()` and `load_state_dict(state)`."""

    def __init__(self, **components):
        self.components = components

    def state_dict(self) -> dict:
        """Each component's state under its name (plain data: the checkpointer reads it back
        weights-only)."""
        return {name: component.state_dict() for name, component in self.components.items()}

    def load_state_dict(self, state: dict) -> None:
        """Restore each component whose name `state` holds."""
        for name, component in self.components.items():
            if name in state:
                component.load_state_dict(state[name])
