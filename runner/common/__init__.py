"""What every layer uses and that imports nothing of the runner: whole-file writes
(atomic.py), the exceptions that decide how a run ends (errors.py), the console's format
(console.py), the registries of records (registry.py) and text for people (text.py)."""
