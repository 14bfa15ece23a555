"""The library the entry points in experiments/*.py share (see experiments/__init__.py for the layout)."""
