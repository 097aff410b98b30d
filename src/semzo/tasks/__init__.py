"""What the ZO optimizer optimizes: the tasks (see :mod:`.base`)."""
