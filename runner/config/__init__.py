"""What a run is asked to do: the schema of every config group (schema.py), credentials kept
out of URLs (credentials.py) and the rules that span groups (rules.py). The command line
that composes it lives with the job (runner/job/commandline.py, compose.py)."""
